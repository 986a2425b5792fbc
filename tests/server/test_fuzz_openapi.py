"""Issue 11: the two generation endpoints fuzzed from the server's own OpenAPI schema
(schemathesis): valid and invalid bodies alike may never give a 5xx, and every 4xx is OpenAI's
error envelope. Bounded: LLMTOWER_FUZZ_EXAMPLES cases per endpoint and mode (default 15), and
LLMTOWER_FUZZ_SECONDS of wall time per endpoint (default 30); raise them for a deeper run."""
from __future__ import annotations

import os
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402 (only where schemathesis is installed)

EXAMPLES = int(os.environ.get("LLMTOWER_FUZZ_EXAMPLES", "15"))
SECONDS = float(os.environ.get("LLMTOWER_FUZZ_SECONDS", "30"))


@pytest.fixture(scope="module")
def api_schema(tiny_server):
    return schemathesis.openapi.from_url(f"{tiny_server.base_url}/openapi.json")


def _check(response) -> None:
    status = response.status_code
    assert status < 500, f"{status}: {response.text[:500]}"
    if status >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], body


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_bodies_never_500_and_4xx_is_the_error_envelope(api_schema, tiny_server, path,
                                                                mode):
    operation = api_schema[path]["POST"]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    deadline = time.monotonic() + SECONDS / 2
    failures: list[str] = []

    # Failures are collected rather than raised: Hypothesis then never replays or shrinks
    # (each case is a real HTTP request), and the time bound cannot make a replay flaky.
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case) -> None:
        if time.monotonic() > deadline:  # the time bound: later cases are skipped
            return
        if isinstance(case.body, dict):
            # Bound the work of a case, not its validity: generation length and n stay as
            # fuzzed when invalid, but a valid huge one must not take minutes on the CPU.
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(case.body.get(key), int) and case.body[key] > 8:
                    case.body[key] = 8
            case.body["stream"] = bool(case.body.get("stream")) and mode == "positive"
        response = case.call(base_url=tiny_server.base_url, timeout=60)
        try:
            _check(response)
        except (AssertionError, ValueError) as e:
            failures.append(f"{case.body!r:.300}\n  -> {e}")

    run()
    assert not failures, f"{len(failures)} failing case(s):\n" + "\n".join(failures[:5])
