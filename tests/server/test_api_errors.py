"""Every error status of the API, in OpenAI's error shape, and a server that keeps serving
after garbage."""
from __future__ import annotations

import contextlib

import httpx
import openai
import pytest

from server_args import MODEL, TINY_SERVER_ARGS, start_server


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("body,content_type,param", [
    (b'{"model": "tiny", "prompt": "hi"', "application/json", None),  # truncated JSON
    (b"\x00\xff\xfe garbage \x13", "application/json", None),
    (b"", "application/json", None),
    (b"[1, 2, 3]", "application/json", None),
    (b'{"model": "tiny"}', "application/json", "prompt"),  # prompt missing
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": "many"}', "application/json", "max_tokens"),
    (b'{"model": "tiny", "prompt": {"text": "hi"}}', "application/json", "prompt"),
    (b'{"model": "tiny", "prompt": "hi", "n": "two"}', "application/json", "n"),
    (b'{"model": "tiny", "prompt": "hi", "stream": "maybe"}', "application/json", "stream"),
    (b'{"model": "tiny", "prompt": "hi"}', "text/plain", None),
])
def test_malformed_bodies_and_wrong_types_are_400(tiny_server, body, content_type, param):
    r = httpx.post(f"{tiny_server.base_url}/v1/completions", content=body,
                   headers={"content-type": content_type}, timeout=30)
    err = _error(r, 400)
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


@pytest.mark.parametrize("extra,param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 50}, "logprobs"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"priority": 3}, None),  # needs --policy priority
    ({"logit_bias": {"5": 500.0}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1.0}}, "logit_bias"),
    ({"logit_bias": {"the": 1.0}}, "logit_bias"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_out_of_range_parameters_are_400_with_a_message(tiny_server, extra, param):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **extra}
    err = _error(httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=30), 400)
    if param:
        assert err["param"] == param and param in err["message"]


def test_chat_errors_are_400(tiny_server):
    url = f"{tiny_server.base_url}/v1/chat/completions"
    _error(httpx.post(url, json={"model": MODEL, "messages": "hi"}, timeout=30), 400)
    _error(httpx.post(url, json={"model": MODEL, "messages": []}, timeout=30), 400)
    _error(httpx.post(url, json={"model": MODEL, "messages": [{"content": "no role"}]},
                      timeout=30), 400)
    _error(httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                 "tools": [{"type": "function"}]}, timeout=30), 400)


def test_prompt_longer_than_the_context_says_both_lengths(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=4)
    assert e.value.status_code == 400
    assert "600" in e.value.message and "512" in e.value.message
    # One length rule (as vLLM and the offline LLM): only the prompt is refused; a
    # max_tokens past the context is clamped to what is left, ending with "length".
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=600,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 512


def test_unknown_model_and_route_are_404(client, tiny_server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert "gpt-17" in e.value.message and MODEL in e.value.message
    _error(httpx.get(f"{tiny_server.base_url}/v1/nothing-here"), 404)


def test_the_server_keeps_serving_after_garbage(client, tiny_server):
    for body in (b"{", b"null", b'{"prompt": 12}', b"\xff" * 100):
        r = httpx.post(f"{tiny_server.base_url}/v1/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400
    r = client.completions.create(model=MODEL, prompt="still there?", max_tokens=3,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert httpx.get(f"{tiny_server.base_url}/health").status_code == 200


# ------------------------------------------------------------------ a server with limits
@pytest.fixture(scope="module")
def limited_server(tmp_path_factory, tiny_llama_dir):
    server = start_server(tmp_path_factory, "limited_server", [
        "--model", str(tiny_llama_dir), *TINY_SERVER_ARGS, "--api-key", "sesame",
        "--max-request-body-bytes", "4096", "--max-num-seqs", "1",
        "--max-num-queued-tokens", "64", "--request-timeout", "0.5"])
    yield server
    server.stop()


def _limited_client(server, key: str = "sesame") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0,
                         timeout=60)


def test_api_key_is_required_except_on_probes(limited_server):
    with pytest.raises(openai.AuthenticationError) as e:
        _limited_client(limited_server, "wrong").completions.create(model=MODEL, prompt="hi",
                                                                    max_tokens=2)
    assert e.value.status_code == 401
    _error(httpx.post(f"{limited_server.base_url}/v1/completions",
                      json={"model": MODEL, "prompt": "hi"}), 401)
    assert httpx.get(f"{limited_server.base_url}/health").status_code == 200
    assert httpx.get(f"{limited_server.base_url}/metrics").status_code == 200
    ok = _limited_client(limited_server).completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert ok.choices


def _post_limited(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", json=body,
                      headers={"Authorization": "Bearer sesame"}, timeout=30)


@contextlib.contextmanager
def _blocked_queue(server):
    """--max-num-seqs 1: sixteen samples of 480 tokens run one after another for 7,680 steps
    (seconds even on a quiet machine: four samples took ~1 s, too close to a 0.5 s
    --request-timeout); one runs, fifteen wait in the queue holding some of
    --max-num-queued-tokens=64."""
    client = _limited_client(server)
    blocker = client.completions.create(model=MODEL, prompt="block", max_tokens=480, n=16,
                                        stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(blocker))  # the blocker is running
        yield client
    finally:
        blocker.close()


def test_body_over_the_limit_is_413(limited_server):
    r = _post_limited(limited_server, {"model": MODEL, "prompt": "word " * 2000, "max_tokens": 2})
    err = _error(r, 413)
    assert "4096" in err["message"]


def test_queue_limit_is_429_with_retry_after(limited_server):
    with _blocked_queue(limited_server):
        # A 62-token prompt no longer fits beside the three queued samples.
        r = _post_limited(limited_server, {"model": MODEL, "prompt": [7] * 62, "max_tokens": 2})
        err = _error(r, 429)
        assert "max_num_queued_tokens" in err["message"]
        assert int(r.headers["retry-after"]) >= 1


def test_prompt_larger_than_the_whole_queue_is_400(limited_server):
    # More prompt tokens than --max-num-queued-tokens=64 can ever hold: retrying cannot help.
    r = _post_limited(limited_server, {"model": MODEL, "prompt": [7] * 100, "max_tokens": 2})
    err = _error(r, 400)
    assert "max_num_queued_tokens" in err["message"]


def test_request_still_queued_after_the_timeout_is_408(limited_server):
    with _blocked_queue(limited_server) as client:
        # The next request waits behind the blocker past its 0.5 s --request-timeout.
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="late", max_tokens=2)
        assert e.value.status_code == 408 and "request-timeout" in e.value.message
