"""Issue 11: hostile or malformed requests get a 400 (or 413, 403) in OpenAI's error shape, never
a 500; the event loop keeps answering while they are handled; and the operator's access
options (--metrics-require-auth, --allowed-hosts, --expose-model-path, --max-n,
--trust-request-chat-template) do what they say."""
from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest
from server_args import MODEL, TINY_SERVER_ARGS, start_server


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _post(server, path: str, body: dict | str, **kw) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.base_url}{path}", content=content,
                      headers={"content-type": "application/json", **kw.pop("headers", {})},
                      timeout=kw.pop("timeout", 30), **kw)


def _chat(content="hi", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2, **extra}


# ------------------------------------------------------------------ item 1: integer bounds
@pytest.mark.parametrize("field,value", [
    ("seed", 2**64), ("seed", -2**63 - 1), ("priority", 2**64), ("top_k", 2**64),
    ("stop_token_ids", [2**64]), ("max_tokens", 2**64), ("n", 2**70), ("logprobs", 2**64),
    ("min_tokens", 2**64), ("best_of", 2**64), ("prompt", [2**64]),
])
def test_integers_beyond_64_bits_are_400_naming_the_field(tiny_server, field, value):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    err = _error(_post(tiny_server, "/v1/completions", body), 400)
    assert err["param"] == field and field in err["message"]


@pytest.mark.parametrize("field,value", [
    ("seed", 2**64), ("max_completion_tokens", 2**64), ("top_logprobs", 2**64),
    ("priority", -2**64)])
def test_chat_integers_beyond_64_bits_are_400(tiny_server, field, value):
    err = _error(_post(tiny_server, "/v1/chat/completions",
                       _chat(logprobs=True, **{field: value})), 400)
    assert err["param"] == field


def test_the_largest_64_bit_seed_still_works(tiny_server):
    r = _post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                               "n": 2, "seed": 2**63 - 1})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ item 2: lone surrogates
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"]}'),
    ("/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", ('{"model": "tiny", "messages": [{"role": "user", "content": '
                              '[{"type": "text", "text": "x\\udc00"}]}]}')),
    ("/tokenize", '{"model": "tiny", "prompt": "\\ud800"}'),
    ("/tokenize", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'),
])
def test_a_lone_surrogate_is_400_not_500(tiny_server, path, body):
    err = _error(_post(tiny_server, path, body), 400)
    assert "surrogate" in err["message"]


# ------------------------------------------------------------------ item 3: caps
@pytest.mark.parametrize("path,extra,param,says", [
    ("/v1/completions", {"n": 10000}, "n", "--max-n"),
    ("/v1/completions", {"n": 2, "best_of": 17}, "best_of", "--max-n"),
    ("/v1/completions", {"stop": ["x"] * 17}, "stop", "16"),
    ("/v1/completions", {"stop": "y" * 513}, "stop", "512"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "20"),
    ("/v1/chat/completions", {"n": 17}, "n", "16"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}] * 129},
     "tools", "128"),
])
def test_request_sizes_over_their_caps_are_400_naming_the_limit(tiny_server, path, extra,
                                                                 param, says):
    body = (_chat(**extra) if "chat" in path
            else {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra})
    err = _error(_post(tiny_server, path, body), 400)
    assert err["param"] == param and says in err["message"]


def test_too_many_messages_is_400(tiny_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 4097}
    err = _error(_post(tiny_server, "/v1/chat/completions", body), 400)
    assert err["param"] == "messages" and "4096" in err["message"]


# ------------------------------------------------------------------ item 4: the event loop
def test_health_answers_while_huge_prompts_arrive(tiny_server):
    """A 4 MB prompt (under the 10 MiB body cap) used to be tokenized on the event loop for
    seconds; now it is refused by its character count before tokenizing, and prompts under
    the cap are tokenized on worker threads."""
    url = tiny_server.base_url
    huge = "The quick brown fox jumps over 12 lazy dogs. " * 90_000  # 4 MB
    near_cap = "The quick brown fox jumps over the lazy dog. " * 1400  # 63K chars: under
    results: list[httpx.Response] = []

    def hostile() -> None:
        with httpx.Client(timeout=120) as c:
            for _ in range(2):
                results.append(c.post(f"{url}/v1/completions", json={
                    "model": MODEL, "prompt": huge, "max_tokens": 2}))
                results.append(c.post(f"{url}/v1/chat/completions", json=_chat(huge)))
                results.append(c.post(f"{url}/tokenize", json={"model": MODEL,
                                                               "prompt": near_cap}))

    def probe_while(alive) -> list[float]:
        latencies = []
        with httpx.Client(timeout=30) as probe:
            probe.get(f"{url}/health")  # connect first: only the answer is timed
            while alive():
                t = time.perf_counter()
                assert probe.get(f"{url}/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.01)
        return latencies

    # What the machine alone costs a probe (the test machine is shared and may be loaded).
    end = time.monotonic() + 1.0
    baseline = max(probe_while(lambda: time.monotonic() < end))
    worker = threading.Thread(target=hostile)
    worker.start()
    latencies = probe_while(worker.is_alive)
    worker.join()
    for r in results[:2]:
        err = _error(r, 400)
        assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
    assert results[2].status_code == 200 and results[2].json()["count"] > 1000
    # Every probe within 0.5 s of what an idle server takes on this machine (one outlier
    # allowed); before the fix a probe waited seconds behind the tokenizer. The margin is wide
    # because a loaded CI machine can deschedule the server for a few hundred milliseconds.
    worst = sorted(latencies)[-2 if len(latencies) > 1 else -1]
    assert worst < 0.5 + baseline, (sorted(latencies)[-5:], baseline)


# ------------------------------------------------------------------ item 5: chat templates
EVIL_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}"
                 "{% for k in range(100000) %}{% endfor %}{% endfor %}{% endfor %}")


def test_a_request_cannot_replace_the_chat_template(tiny_server):
    body = _chat(chat_template_kwargs={"chat_template": EVIL_TEMPLATE})
    t = time.monotonic()
    err = _error(_post(tiny_server, "/v1/chat/completions", body), 400)
    assert err["code"] == "chat_template_not_allowed"
    assert "--trust-request-chat-template" in err["message"]
    assert time.monotonic() - t < 5
    err = _error(_post(tiny_server, "/v1/chat/completions",
                       _chat(chat_template_kwargs={"tokenize": True})), 400)
    assert "tokenize" in err["message"]
    # Template variables are still fine.
    ok = _post(tiny_server, "/v1/chat/completions", _chat(chat_template_kwargs={"x": 1}))
    assert ok.status_code == 200, ok.text


# ------------------------------------------------------------------ item 6: n > 1 streams
def _success_total(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return sum(float(m) for m in re.findall(r'^vllm:request_success_total\{[^}]*\} (\S+)$',
                                            text, re.MULTILINE))


def test_streamed_n_finishes_each_choice_once_and_counts_once(tiny_server):
    before = _success_total(tiny_server)
    # Random sampling with a one-letter stop string: the 10 samples end at different steps.
    body = {"model": MODEL, "prompt": "The quick brown", "max_tokens": 40, "n": 10,
            "temperature": 1.0, "seed": 3, "stop": ["e"], "stream": True}
    finishes: dict[int, int] = {}
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/completions", json=body,
                      timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    if choice.get("finish_reason") is not None:
                        finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
    assert finishes == {i: 1 for i in range(10)}
    assert _success_total(tiny_server) - before == 10


# ------------------------------------------------------------------ item 9: 413 is readable
def test_an_oversized_body_gets_a_readable_413_not_a_reset(tiny_server):
    body = b'{"prompt": "' + b"x" * (11 * 2**20) + b'"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{tiny_server.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    # As clients do: the whole body, then read the answer (no half-close, which the HTTP
    # server takes for a hang-up).
    with socket.create_connection(("127.0.0.1", tiny_server.port), timeout=30) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"content-length: (\d+)", data, re.IGNORECASE).group(1)):
            chunk = s.recv(65536)  # a reset would raise ConnectionResetError here
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b'"request_too_large"' in data


# ------------------------------------------------------------------ operator options
def test_models_do_not_disclose_the_model_path_by_default(tiny_server, tiny_llama_dir):
    r = httpx.get(f"{tiny_server.base_url}/v1/models").json()
    assert r["data"][0]["root"] == MODEL
    assert str(tiny_llama_dir) not in json.dumps(r)


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory, tiny_llama_dir):
    server = start_server(tmp_path_factory, "guarded_server", [
        "--model", str(tiny_llama_dir), *TINY_SERVER_ARGS, "--api-key", "sesame",
        "--metrics-require-auth", "--allowed-hosts", "127.0.0.1", "localhost",
        "--expose-model-path", "--max-n", "2", "--trust-request-chat-template"])
    yield server
    server.stop()


KEY = {"Authorization": "Bearer sesame"}


def test_metrics_require_the_key_when_asked(guarded_server):
    _error(httpx.get(f"{guarded_server.base_url}/metrics"), 401)
    assert httpx.get(f"{guarded_server.base_url}/metrics", headers=KEY).status_code == 200
    assert httpx.get(f"{guarded_server.base_url}/health").status_code == 200


def test_hosts_outside_the_allow_list_are_403(guarded_server):
    url = f"{guarded_server.base_url}/health"
    err = _error(httpx.get(url, headers={"Host": "attacker.example:8000"}), 403)
    assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"]
    assert httpx.get(url, headers={"Host": f"localhost:{guarded_server.port}"}).status_code == 200
    assert httpx.get(url).status_code == 200  # Host: 127.0.0.1:port


def test_expose_model_path_and_max_n(guarded_server, tiny_llama_dir):
    r = httpx.get(f"{guarded_server.base_url}/v1/models", headers=KEY).json()
    assert r["data"][0]["root"] == str(tiny_llama_dir)
    err = _error(_post(guarded_server, "/v1/completions",
                       {"model": MODEL, "prompt": "hi", "n": 3}, headers=KEY), 400)
    assert "limit of 2" in err["message"] and err["param"] == "n"


def test_a_trusted_request_template_that_loops_is_stopped(guarded_server):
    t = time.monotonic()
    err = _error(_post(guarded_server, "/v1/chat/completions",
                       _chat(chat_template_kwargs={"chat_template": EVIL_TEMPLATE}),
                       headers=KEY), 400)
    assert "did not finish rendering" in err["message"]
    assert time.monotonic() - t < 15
    ok = _post(guarded_server, "/v1/chat/completions",
               _chat(chat_template_kwargs={"chat_template": "{{ messages[0]['content'] }}"}),
               headers=KEY)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] <= 2  # "hi", without the ChatML wrapping


def test_an_overflow_anywhere_below_the_protocol_is_a_400_not_a_500():
    from llmtower.server.errors import to_api_error
    err = to_api_error(OverflowError("int too big to convert"))
    assert err.status_code == 400 and "out of range" in err.message
