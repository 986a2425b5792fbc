"""Request fields the server does not know: answered normally, with one warning line in the
server's log naming them (vLLM's behaviour); --reject-unknown-fields keeps the 400
(tests/server/test_structured_outputs_api.py runs its server with it)."""
from __future__ import annotations

import httpx
import pytest

from server_args import MODEL


def _log_lines_naming(server, name: str) -> list[str]:
    return [line for line in server.log_path.read_text(errors="replace").splitlines()
            if "request fields ignored" in line and repr(name) in line]


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2, "ignore_eos": True, "verbosity": "low"},
     "verbosity"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "ignore_eos": True,
                         "guided_jsn": {}}, "guided_jsn"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "reasoning": {"effort": "low"},
                       "tools": [{"type": "function", "name": "f", "parameters": {},
                                  "defer_loading": True}], "tool_choice": "none"},
     "defer_loading"),
])
def test_unknown_fields_are_ignored_with_a_warning(tiny_server, path, body, field):
    before = len(_log_lines_naming(tiny_server, field))
    r = httpx.post(f"{tiny_server.base_url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    # The Responses API has no ignore_eos: the random model may end after one token there.
    wanted = {2} if body.get("ignore_eos") else {1, 2}
    assert usage.get("completion_tokens", usage.get("output_tokens")) in wanted
    assert len(_log_lines_naming(tiny_server, field)) == before + 1
