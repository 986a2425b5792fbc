"""A vLLM-style command line against a live `llmtower serve`: HTTPS (--ssl-keyfile,
--ssl-certfile), CORS (--allowed-origins), --enable-request-id-headers,
--enable-force-include-usage, --max-logprobs, --root-path, --disable-fastapi-docs, and the
warning lines of --enforce-eager / --trust-remote-code, all on one tiny-model server."""
from __future__ import annotations

import json
import ssl
import subprocess

import httpx
import pytest

from tests.fixtures.tiny_models import tiny_llama_dir, tiny_tokenizer_dir  # noqa: F401
from tests.server.server_process import ServerProcess

ORIGIN = "https://app.example.com"


class TLSServerProcess(ServerProcess):
    """ServerProcess over https, waited for with the test's own certificate."""

    def __init__(self, args, log_path, cert: str) -> None:
        super().__init__(args, log_path)
        self.base_url = f"https://127.0.0.1:{self.port}"
        self.cert = ssl.create_default_context(cafile=cert)

    def _healthy(self) -> bool:
        return httpx.get(f"{self.base_url}/health", verify=self.cert,
                         timeout=2).status_code == 200


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("vllm_flags")
    key, cert = str(tmp / "key.pem"), str(tmp / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    proc = TLSServerProcess(
        [str(tiny_llama_dir), "--served-model-name", "tiny", "--num-threads", "1",
         "--max-model-len", "256", "--kv-cache-memory-bytes", "16M", "-tp", "1",
         "--enforce-eager", "--trust-remote-code", "--max-logprobs", "3",
         "--ssl-keyfile", key, "--ssl-certfile", cert, "--allowed-origins", f'["{ORIGIN}"]',
         "--enable-request-id-headers", "--enable-force-include-usage",
         "--root-path", "/llm", "--disable-fastapi-docs", "--disable-log-requests"],
        tmp / "server.log", cert).start()
    yield proc
    proc.stop()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, verify=server.cert, timeout=60) as c:
        yield c


def test_start_log_warns_once_per_flag_that_changes_nothing(server):
    log = server.log_path.read_text()
    assert log.count("--enforce-eager changes nothing here") == 1, log[-3000:]
    assert log.count("--trust-remote-code changes nothing here") == 1
    assert f"on https://127.0.0.1:{server.port}" in log


def test_request_id_header_on_every_response(http):
    assert http.get("/health", headers={"X-Request-Id": "probe-1"}).headers["x-request-id"] \
        == "probe-1"
    assert len(http.get("/version").headers["x-request-id"]) == 32  # a fresh uuid4 hex
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                  headers={"X-Request-Id": "abc"})
    assert r.status_code == 200
    ids = r.headers.get_list("x-request-id")  # once: the client's id, or the endpoint's around it
    assert len(ids) == 1 and ids[0] in ("abc", "cmpl-abc"), ids


def test_streams_end_with_usage_without_asking(http):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 1


def test_max_logprobs_is_enforced(http):
    base = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
    assert http.post("/v1/completions", json={**base, "logprobs": 3}).status_code == 200
    r = http.post("/v1/completions", json={**base, "logprobs": 4})
    assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"]


def test_cors_answers_the_allowed_origin_only(http):
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    ok = http.options("/v1/completions", headers={"Origin": ORIGIN, **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = http.options("/v1/completions", headers={"Origin": "https://evil.example", **pre})
    assert "access-control-allow-origin" not in other.headers


def test_docs_are_off_and_the_root_path_is_served(http):
    assert http.get("/docs").status_code == 404
    assert http.get("/openapi.json").status_code == 404
    # Behind a proxy that keeps the prefix, the prefixed path reaches the same route.
    r = http.get("/llm/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    assert http.get("/v1/models").status_code == 200  # and one that strips it
