"""The scenarios vLLM's own OpenAI-server tests walk through (request validation, logprobs
shapes, stream chunk shapes and usage, echo, token ids, request ids, /tokenize, /v1/models),
checked from the outside against `llmtower serve` with the tiny random-weight Llama. Each test
asserts what a client of a vLLM server would notice if we answered differently."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from prometheus_client.parser import text_string_to_metric_families
from server_args import MODEL, TINY_SERVER_ARGS, start_server

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"}]
NO_EOS = {"ignore_eos": True}


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60, **kw)


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _events(server, path: str, body: dict, headers: dict | None = None) -> list[dict]:
    """The JSON events of a streamed answer (without the final [DONE], which is checked)."""
    with httpx.stream("POST", f"{server.base_url}{path}", json={**body, "stream": True},
                      headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _tokenize(server, **body) -> list[int]:
    return _post(server, "/tokenize", {"model": MODEL, **body}).json()["tokens"]


# ------------------------------------------------------------------ stream_options and usage
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": None},
                                     {"continuous_usage_stats": True}])
def test_stream_options_without_stream_is_400(tiny_server, path, body, options):
    err = _error(_post(tiny_server, path, {"model": MODEL, "max_tokens": 2, **body,
                                           "stream_options": options}))
    assert err["param"] == "stream_options" and "stream=true" in err["message"]


def test_empty_stream_options_and_null_include_usage_are_accepted(tiny_server):
    r = _post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                "stream_options": {}})
    assert r.status_code == 200, r.text
    events = _events(tiny_server, "/v1/completions",
                     {"model": MODEL, "prompt": "hi", "max_tokens": 2,
                      "stream_options": {"include_usage": None}})
    assert events and all("usage" not in e for e in events)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "What is the capital of France?"}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
def test_include_usage_puts_usage_only_on_a_last_chunk_without_choices(tiny_server, path, body):
    events = _events(tiny_server, path, {"model": MODEL, "max_tokens": 5, **NO_EOS, **body,
                                         "stream_options": {"include_usage": True,
                                                            "continuous_usage_stats": False}})
    *content, last = events
    assert all(e.get("usage") is None for e in content)
    assert last["choices"] == []
    usage = last["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # The finish_reason comes once, on the chunk just before the usage chunk.
    finishes = [e for e in content if e["choices"][0]["finish_reason"] is not None]
    assert finishes == [content[-1]] and finishes[0]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "What is the capital of France?"}),
    ("/v1/chat/completions", {"messages": MESSAGES}),
])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(tiny_server, path, body):
    events = _events(tiny_server, path, {"model": MODEL, "max_tokens": 6, "min_tokens": 6,
                                         **body, "stream_options": {
                                             "include_usage": True,
                                             "continuous_usage_stats": True}})
    assert all(e.get("usage") is not None for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events]
    for e in events:
        u = e["usage"]
        assert u["prompt_tokens"] > 0
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # Grows with every chunk that carries text; the final usage-only chunk repeats the total.
    with_text = [e["usage"]["completion_tokens"] for e in events
                 if e["choices"] and (e["choices"][0].get("text")
                                      or e["choices"][0].get("delta", {}).get("content"))]
    assert with_text == sorted(with_text) and len(set(with_text)) == len(with_text)
    assert counts == sorted(counts) and counts[-1] == 6
    assert events[-1]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
    # Without include_usage, continuous_usage_stats alone adds nothing.
    plain = _events(tiny_server, path, {"model": MODEL, "max_tokens": 3, **body,
                                        "stream_options": {"include_usage": False,
                                                           "continuous_usage_stats": True}})
    assert all(e.get("usage") is None for e in plain)


# ------------------------------------------------------------------ logprobs shapes
def test_completion_logprobs_none_zero_and_some(client):
    kw = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0.0,
              extra_body=NO_EOS)
    assert client.completions.create(**kw).choices[0].logprobs is None
    zero = client.completions.create(logprobs=0, **kw).choices[0].logprobs
    assert len(zero.tokens) == len(zero.token_logprobs) == len(zero.top_logprobs) == 4
    assert all(len(top) == 1 for top in zero.top_logprobs)  # the sampled token alone
    some = client.completions.create(logprobs=5, **kw).choices[0].logprobs
    # Five alternatives plus the sampled token when it is not among them; byte-level tokens
    # of the random model may share a text (and so a key), hence the lower bound of 1.
    assert all(1 <= len(top) <= 6 for top in some.top_logprobs)
    assert zero.tokens == some.tokens


def test_chat_logprobs_false_zero_and_some(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=4, temperature=0.0,
              extra_body=NO_EOS)
    assert client.chat.completions.create(logprobs=False, **kw).choices[0].logprobs is None
    zero = client.chat.completions.create(logprobs=True, top_logprobs=0, **kw)
    content = zero.choices[0].logprobs.content
    assert len(content) == 4 and all(t.top_logprobs == [] for t in content)
    some = client.chat.completions.create(logprobs=True, top_logprobs=5, **kw)
    content = some.choices[0].logprobs.content
    assert all(len(t.top_logprobs) == 5 for t in content)
    for t in content:  # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
        assert [a.logprob for a in t.top_logprobs] == sorted(
            (a.logprob for a in t.top_logprobs), reverse=True)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [5, 6, 7], "logprobs": 30}),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}),
])
def test_too_many_logprobs_is_400_streamed_too_and_the_server_goes_on(client, tiny_server,
                                                                       path, body):
    for stream in (False, True):
        r = _post(tiny_server, path, {"model": MODEL, "max_tokens": 3, **body, "stream": stream})
        _error(r)  # a status, not a broken stream
    assert client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=2).choices


def test_prompt_logprobs_of_each_prompt_and_negative_is_400(client, tiny_server):
    prompts = ["A robot may not injure another robot", "My name is"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1,
                                  extra_body={"prompt_logprobs": 0})
    for choice, prompt in zip(r.choices, prompts):
        n = len(_tokenize(tiny_server, prompt=prompt))
        assert len(choice.prompt_logprobs) == n and choice.prompt_logprobs[0] is None
    assert client.completions.create(model=MODEL, prompt=prompts[0],
                                     max_tokens=1).choices[0].prompt_logprobs is None
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        err = _error(_post(tiny_server, path, {"model": MODEL, "max_tokens": 1,
                                               "prompt_logprobs": -1, **body}))
        assert err["param"] == "prompt_logprobs"


def test_chat_prompt_logprobs_hold_the_top_k_by_rank(tiny_server):
    for k in (1, 2):
        r = _post(tiny_server, "/v1/chat/completions",
                  {"model": MODEL, "messages": MESSAGES, "max_tokens": 1,
                   "prompt_logprobs": k}).json()
        entries = r["prompt_logprobs"]
        assert entries[0] is None and len(entries) == r["usage"]["prompt_tokens"]
        for entry in entries[1:]:
            ranks = sorted(v["rank"] for v in entry.values())
            # the prompt's own token (any rank) and the k most likely ones
            assert k <= len(entry) <= k + 1 and ranks[:k] == list(range(1, k + 1))


# ------------------------------------------------------------------ echo
def test_echo_with_max_tokens_0_returns_the_scored_prompt_alone(client, tiny_server):
    """OpenAI's legacy way to score text (lm-eval's loglikelihood): echo + max_tokens=0."""
    prompt = "The capital of France is Paris"
    ids = _tokenize(tiny_server, prompt=prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1)
    (choice,) = r.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    # Streamed: the prompt, then an empty chunk that carries the finish_reason.
    events = _events(tiny_server, "/v1/completions",
                     {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True})
    assert "".join(e["choices"][0]["text"] for e in events) == prompt
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    # Without echo there is nothing to return: a 400 that says what to send.
    err = _error(_post(tiny_server, "/v1/completions",
                       {"model": MODEL, "prompt": prompt, "max_tokens": 0}))
    assert err["param"] == "max_tokens" and "echo" in err["message"]


def test_echo_logprobs_of_a_one_token_prompt_start_with_that_token(client, tiny_server):
    (token,) = _tokenize(tiny_server, prompt="h")
    r = client.completions.create(model=MODEL, prompt=[token], max_tokens=2, echo=True,
                                  logprobs=1, temperature=0.0, extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 3
    assert lp.tokens[0] == "h" and lp.token_logprobs[0] is None and lp.text_offset[0] == 0
    assert r.choices[0].text.startswith("h")
    for _ in range(2):  # max_tokens 0: the one token alone
        r = client.completions.create(model=MODEL, prompt=[token], max_tokens=0, echo=True,
                                      logprobs=1)
        assert r.choices[0].text == "h" and r.choices[0].logprobs.tokens == ["h"]


def test_streamed_text_offsets_match_the_plain_ones(tiny_server):
    """A stop string holds text back while it might be starting; the offsets must not lag."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 12, "temperature": 0.0,
            "logprobs": 0, "stop": ["\n\n"], "ignore_eos": True}
    plain = _post(tiny_server, "/v1/completions", body).json()["choices"][0]
    events = _events(tiny_server, "/v1/completions", body)
    offsets = sum((e["choices"][0]["logprobs"]["text_offset"] for e in events
                   if e["choices"][0].get("logprobs")), [])
    assert offsets == plain["logprobs"]["text_offset"]
    assert "".join(e["choices"][0]["text"] for e in events) == plain["text"]


# ------------------------------------------------------------------ continue_final_message
def test_continue_final_message_continues_the_assistants_text(client, tiny_server, tokenizer):
    saying = "An apple a day, keeps"
    messages = [{"role": "user", "content": "tell me a common saying"},
                {"role": "assistant", "content": saying}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                             continue_final_message=True)
    assert rendered.endswith(saying)  # no end-of-turn after the assistant's text
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    assert _tokenize(tiny_server, messages=messages, **flags) == expected
    for echo in (True, False):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0.0,
            extra_body={**flags, "echo": echo, "return_token_ids": True, "ignore_eos": True})
        assert r.prompt_token_ids == expected
        assert r.choices[0].message.content.startswith(saying) is echo
    # Opening a new assistant message and continuing the last one exclude each other.
    for path in ("/v1/chat/completions", "/tokenize"):
        err = _error(_post(tiny_server, path, {"model": MODEL, "messages": messages,
                                               "max_tokens": 2,
                                               "continue_final_message": True}))
        assert err["param"] == "continue_final_message"
        assert "add_generation_prompt=false" in err["message"]


# ------------------------------------------------------------------ stops and samples
def test_stop_token_ids_outside_the_vocabulary_are_400(client, tiny_server, tokenizer):
    vocab = len(tokenizer)
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        err = _error(_post(tiny_server, path, {"model": MODEL, "max_tokens": 2, **body,
                                               "stop_token_ids": [vocab + 1]}))
        assert err["param"] == "stop_token_ids"
        assert str(vocab + 1) in err["message"] and str(vocab) in err["message"]
        _error(_post(tiny_server, path, {"model": MODEL, "max_tokens": 2, **body,
                                         "stop_token_ids": [-1]}))
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                       extra_body={"stop_token_ids": [vocab - 1]})
    assert r.choices[0].message.content is not None


def test_logit_bias_errors_name_every_bad_key(tiny_server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    err = _error(_post(tiny_server, "/v1/chat/completions",
                       {**body, "logit_bias": {"bad1": 50.0, "bad2": 20.0, "5": 1.0}}))
    assert err["param"] == "logit_bias"
    assert "'bad1'" in err["message"] and "'bad2'" in err["message"]
    assert "'5'" not in err["message"]
    err = _error(_post(tiny_server, "/v1/chat/completions",
                       {**body, "logit_bias": {"1": "not_a_number"}}))
    assert err["param"] == "logit_bias"


def test_stop_token_id_and_min_tokens(client):
    base = client.completions.create(
        max_tokens=8, model=MODEL, prompt=[5, 6, 7], temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    ids = base.token_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # first new token
    stopped = client.completions.create(
        max_tokens=8, model=MODEL, prompt=[5, 6, 7], temperature=0.0,
        extra_body={"return_token_ids": True, "stop_token_ids": [ids[k]],
                    "ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == ids[k]
    assert stopped.token_ids[:k] == ids[:k]
    # min_tokens holds the stop token back until that many tokens are out.
    held = client.completions.create(
        max_tokens=k + 3, model=MODEL, prompt=[5, 6, 7], temperature=0.0,
        extra_body={"return_token_ids": True, "stop_token_ids": [ids[k]],
                    "min_tokens": k + 3, "ignore_eos": True}).choices[0]
    assert held.finish_reason == "length" and len(held.token_ids) == k + 3
    assert ids[k] not in held.token_ids


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", temperature=0.0, max_tokens=30,
              extra_body=NO_EOS)
    full = client.completions.create(**kw).choices[0].text
    stop = full[10:13]
    cut = full.index(stop)
    kept = client.completions.create(stop=[stop], **{
        **kw, "extra_body": {**NO_EOS, "include_stop_str_in_output": True}}).choices[0]
    assert kept.text == full[:cut + len(stop)]
    assert kept.finish_reason == "stop" and kept.model_extra["stop_reason"] == stop


@pytest.mark.parametrize("path,body,text_of", [
    ("/v1/completions", {"prompt": "What is an LLM?"}, lambda c: c.get("text") or ""),
    ("/v1/chat/completions", {"messages": MESSAGES},
     lambda c: c["delta"].get("content") or ""),
])
def test_streamed_n_sends_each_finish_reason_once(tiny_server, path, body, text_of):
    events = _events(tiny_server, path, {"model": MODEL, "max_tokens": 6, "n": 3,
                                         "temperature": 1.0, "seed": 42, **body})
    finishes: dict[int, int] = {}
    texts: dict[int, str] = {}
    for e in events:
        (choice,) = e["choices"]  # one choice per chunk
        texts[choice["index"]] = texts.get(choice["index"], "") + text_of(choice)
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
    assert finishes == {0: 1, 1: 1, 2: 1}
    plain = _post(tiny_server, path, {"model": MODEL, "max_tokens": 6, "n": 3,
                                      "temperature": 1.0, "seed": 42, **body}).json()
    got = [c.get("text", c.get("message", {}).get("content")) for c in plain["choices"]]
    assert [c["index"] for c in plain["choices"]] == [0, 1, 2]
    assert got == [texts[i] for i in range(3)]  # same seed, same samples, streamed or not


def test_a_batch_of_equal_prompts_gets_equal_greedy_answers(client):
    for prompts in (["Hello, my name is"] * 2, [[5, 6, 7, 8]] * 2):
        r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                      temperature=0.0, extra_body=NO_EOS)
        assert len(r.choices) == 2 and r.choices[0].text == r.choices[1].text
        r2 = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2,
                                       temperature=0.0, extra_body=NO_EOS)
        assert [c.index for c in r2.choices] == [0, 1, 2, 3]
        assert r2.choices[0].text == r2.choices[2].text == r.choices[0].text


# ------------------------------------------------------------------ token ids
def test_return_token_ids_of_completions(client, tiny_server, tokenizer):
    prompt = "Complete this sentence: I love coding"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0)
    r = client.completions.create(**kw, extra_body={"return_token_ids": True,
                                                    "ignore_eos": True})
    choice = r.choices[0]
    assert choice.prompt_token_ids == _tokenize(tiny_server, prompt=prompt)
    assert len(choice.token_ids) == r.usage.completion_tokens == 6
    assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.text
    plain = client.completions.create(**kw, extra_body=NO_EOS).model_dump()["choices"][0]
    assert plain.get("token_ids") is None and plain.get("prompt_token_ids") is None
    # The ids agree with logprobs named by id, the prompt's leading them with echo.
    e = client.completions.create(**kw, echo=True, logprobs=1, extra_body={
        "return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True})
    named = [int(t.removeprefix("token_id:")) for t in e.choices[0].logprobs.tokens]
    assert named == e.choices[0].prompt_token_ids + e.choices[0].token_ids
    # Streamed: the prompt's ids on the first chunk only, each chunk its new ids.
    events = _events(tiny_server, "/v1/completions", {**kw, "return_token_ids": True,
                                                      "ignore_eos": True})
    assert events[0]["choices"][0]["prompt_token_ids"] == choice.prompt_token_ids
    assert all("prompt_token_ids" not in ev["choices"][0] for ev in events[1:])
    assert sum((ev["choices"][0]["token_ids"] for ev in events), []) == choice.token_ids


def test_return_token_ids_of_chat(client, tiny_server, tokenizer):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.0)
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True,
                                                         "ignore_eos": True})
    assert r.prompt_token_ids == _tokenize(tiny_server, messages=MESSAGES)
    assert len(r.choices[0].token_ids) == 6
    assert tokenizer.decode(r.choices[0].token_ids,
                            skip_special_tokens=True) == r.choices[0].message.content
    plain = client.chat.completions.create(**kw).model_dump()
    assert plain.get("prompt_token_ids") is None
    assert plain["choices"][0].get("token_ids") is None
    events = _events(tiny_server, "/v1/chat/completions",
                     {**kw, "return_token_ids": True, "ignore_eos": True})
    assert events[0]["prompt_token_ids"] == r.prompt_token_ids
    assert all("prompt_token_ids" not in ev for ev in events[1:])
    streamed = sum((ev["choices"][0].get("token_ids") or [] for ev in events), [])
    assert streamed == r.choices[0].token_ids


def test_chat_usage_counts_prompt_tokens_served_from_the_prefix_cache(client):
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 6},
                {"role": "user", "content": "What is the capital of Germany?"}]
    kw = dict(model=MODEL, messages=messages, max_completion_tokens=3, temperature=0.0)
    client.chat.completions.create(**kw)  # warms the cache
    second = client.chat.completions.create(**kw)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16


# ------------------------------------------------------------------ request ids
def test_x_request_id_and_request_id_name_the_response(tiny_server):
    r = _post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2},
              headers={"X-Request-Id": "trace-123"})
    assert r.json()["id"] == "cmpl-trace-123"
    r = _post(tiny_server, "/v1/chat/completions",
              {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "request_id": "abc"})
    assert r.json()["id"] == "chatcmpl-abc"
    events = _events(tiny_server, "/v1/chat/completions",
                     {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
                     headers={"X-Request-Id": "trace-456"})
    assert {e["id"] for e in events} == {"chatcmpl-trace-456"}
    err = _error(_post(tiny_server, "/v1/completions",
                       {"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers={"X-Request-Id": "has space"}))
    assert err["param"] == "request_id"
    for bad in ("x" * 257, "caf\u00e9"):  # too long; not ASCII (sent as Latin-1 bytes)
        r = httpx.post(f"{tiny_server.base_url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       headers=[("X-Request-Id", bad.encode("latin-1"))])
        assert _error(r)["param"] == "request_id"


def test_the_same_request_id_twice_at_once_serves_both(tiny_server):
    """A retry that reuses its X-Request-Id while the first attempt still runs."""
    url = f"{tiny_server.base_url}/v1/completions"
    headers = {"X-Request-Id": "retry-1"}
    body = {"model": MODEL, "prompt": "first", "max_tokens": 40, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as first:
        lines = first.iter_lines()
        assert next(ln for ln in lines if ln.startswith("data: "))  # the first is running
        second = httpx.post(url, json={"model": MODEL, "prompt": "second", "max_tokens": 3,
                                       "ignore_eos": True}, headers=headers, timeout=60)
        assert second.status_code == 200, second.text
        assert second.json()["id"] == "cmpl-retry-1"
        assert second.json()["usage"]["completion_tokens"] == 3
        rest = [ln for ln in lines if ln.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------ requests vLLM accepts
def test_custom_roles_extra_message_fields_and_text_parts(client):
    kw = dict(model=MODEL, max_tokens=4, temperature=0.0, seed=0, extra_body=NO_EOS)
    as_string = client.chat.completions.create(
        messages=[{"role": "my-custom-role", "content": "what is 1+1?"}], **kw)
    as_parts = client.chat.completions.create(
        messages=[{"role": "my-custom-role",
                   "content": [{"type": "text", "text": "what is 1+1?"}]}], **kw)
    assert as_string.choices[0].message.content == as_parts.choices[0].message.content
    extra = client.chat.completions.create(
        messages=[{"role": "user", "content": "what is 1+1?", "extra_field": "0"}], **kw)
    assert extra.choices[0].message.content is not None


def test_errors_name_the_field_and_prompt_the_client_sent(tiny_server):
    err = _error(_post(tiny_server, "/v1/completions",
                       {"model": MODEL, "prompt": ["fine", "", "also fine"], "max_tokens": 2}))
    assert err["param"] == "prompt" and err["message"].startswith("prompt[1]: ")
    err = _error(_post(tiny_server, "/v1/completions",
                       {"model": MODEL, "prompt": [[5, 6], [5] * 600], "max_tokens": 2}))
    assert err["message"].startswith("prompt[1]: ") and "512" in err["message"]
    assert err["code"] == "context_length_exceeded"
    err = _error(_post(tiny_server, "/v1/chat/completions",
                       {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 0}))
    assert err["param"] == "max_completion_tokens"


def test_a_seeded_request_samples_the_same_alone_or_in_a_batch(tiny_server):
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 16,
            "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    alone = _post(tiny_server, "/v1/completions", body).json()["choices"][0]["text"]
    texts: dict[int, str] = {}

    def one(i: int) -> None:
        b = body if i == 0 else {**body, "seed": None, "prompt": f"other prompt {i}",
                                 "max_tokens": 30}
        texts[i] = _post(tiny_server, "/v1/completions", b).json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert texts[0] == alone


def test_optional_fields_sent_as_null_take_their_defaults(tiny_server):
    """Clients that serialise every optional field send the unset ones as null."""
    nulls = {"n": None, "stream": None, "temperature": None, "top_p": None, "stop": None,
             "seed": None, "presence_penalty": None, "frequency_penalty": None,
             "logit_bias": None, "user": None, "stream_options": None, "min_tokens": None,
             "ignore_eos": None, "skip_special_tokens": None, "priority": None}
    r = _post(tiny_server, "/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_completion_tokens": 3, "max_tokens": None,
        "logprobs": None, "top_logprobs": None, "tools": None, "tool_choice": None,
        "response_format": None, "parallel_tool_calls": None, "echo": None,
        "add_generation_prompt": None, **nulls})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["logprobs"] is None and r.json()["usage"]["completion_tokens"] <= 3
    r = _post(tiny_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                "echo": None, "logprobs": None,
                                                "best_of": None, "suffix": None, **nulls})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["text"] is not None
    r = _post(tiny_server, "/tokenize", {"model": MODEL, "prompt": "hi",
                                         "add_special_tokens": None})
    assert r.status_code == 200 and r.json()["tokens"]
    # A required field is still required.
    assert _error(_post(tiny_server, "/v1/completions",
                        {"model": MODEL, "prompt": None}))["param"] == "prompt"


@pytest.mark.parametrize("content", [b'"just a string"', b"[1, 2]", b"42"])
def test_a_chat_body_that_is_not_an_object_is_400(tiny_server, content):
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"}, timeout=30)
    _error(r)


def test_chat_with_a_form_content_type_is_refused(tiny_server):
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions",
                   content=json.dumps({"model": MODEL, "messages": MESSAGES}),
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30)
    _error(r)


# ------------------------------------------------------------------ /tokenize, /v1/models
def test_tokenize_fields_and_token_strs(tiny_server, tokenizer):
    prompt = "This is a token_strs test prompt!"
    for add_special in (False, True):
        r = _post(tiny_server, "/tokenize", {"model": MODEL, "prompt": prompt,
                                             "add_special_tokens": add_special}).json()
        tokens = tokenizer.encode(prompt, add_special_tokens=add_special)
        assert r == {"tokens": tokens, "count": len(tokens), "max_model_len": 512,
                     "token_strs": None}
    r = _post(tiny_server, "/tokenize", {"model": MODEL, "prompt": prompt,
                                         "return_token_strs": True}).json()
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    chat = _post(tiny_server, "/tokenize", {"model": MODEL, "messages": MESSAGES,
                                            "add_generation_prompt": False}).json()
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                             add_generation_prompt=False)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    plain = tokenizer.encode(prompt, add_special_tokens=False)
    assert _post(tiny_server, "/detokenize", {"model": MODEL, "tokens": plain}
                 ).json() == {"prompt": prompt}


# A template that shows what it was given: tools, a template variable, the messages.
TOOLS_TEMPLATE = ("{% if tools %}[tools:{% for t in tools %}{{ t.function.name }};{% endfor %}]"
                  "{% endif %}{% if greeting is defined %}({{ greeting }}){% endif %}"
                  "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                  "{% for c in m.tool_calls or [] %}call:{{ c.function.name }}{% endfor %}"
                  "{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tools_template_server(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("tools_template")
    (d / "template.jinja").write_text(TOOLS_TEMPLATE)
    server = start_server(tmp_path_factory, "tools_template_server", [
        "--model", str(tiny_llama_dir), *TINY_SERVER_ARGS,
        "--chat-template", str(d / "template.jinja")])
    yield server
    server.stop()


def test_tokenize_renders_tools_and_template_variables_as_chat_does(tools_template_server,
                                                                    tokenizer):
    server = tools_template_server
    messages = [{"role": "user", "content": "weather in Paris?"}]
    r = _post(server, "/tokenize", {"model": MODEL, "messages": messages, "tools": [WEATHER],
                                    "chat_template_kwargs": {"greeting": "hello"}}).json()
    expected = "[tools:get_weather;](hello)<user>weather in Paris?<assistant>"
    assert r["tokens"] == tokenizer.encode(expected, add_special_tokens=False)
    chat = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "tools": [WEATHER], "tool_choice": "required",
        "chat_template_kwargs": {"greeting": "hello"}, "max_tokens": 30}).json()
    assert chat["usage"]["prompt_tokens"] == r["count"]
    # An assistant's tool call in the history counts the same on both routes.
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tok = _post(server, "/tokenize", {"model": MODEL, "messages": history}).json()
    chat = _post(server, "/v1/chat/completions",
                 {"model": MODEL, "messages": history, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == tok["count"]
    assert "call:get_weather" in tokenizer.decode(tok["tokens"])
    # The renderer's own switches stay out of chat_template_kwargs here too.
    err = _error(_post(server, "/tokenize", {"model": MODEL, "messages": messages,
                                             "chat_template_kwargs": {"tokenize": True}}))
    assert err["param"] == "chat_template_kwargs"


def test_models_list_has_vllms_card_fields(tiny_server):
    r = httpx.get(f"{tiny_server.base_url}/v1/models", timeout=30).json()
    assert r["object"] == "list"
    (card,) = r["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert isinstance(card["created"], int) and card["owned_by"]
    assert card["root"] == MODEL and card["parent"] is None and card["max_model_len"] == 512
    (perm,) = card["permission"]
    assert perm["object"] == "model_permission" and perm["allow_sampling"] is True


def test_requests_in_parallel_keep_their_own_ids_and_answers(tiny_server):
    """Several clients with their own ids at once: each answer carries its own id."""
    results: dict[str, dict] = {}

    def one(i: int) -> None:
        r = _post(tiny_server, "/v1/completions",
                  {"model": MODEL, "prompt": f"prompt number {i}", "max_tokens": 4,
                   "ignore_eos": True}, headers={"X-Request-Id": f"par-{i}"})
        results[f"par-{i}"] = r.json()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {k: v["id"] for k, v in results.items()} == {f"par-{i}": f"cmpl-par-{i}"
                                                         for i in range(4)}
    assert all(v["usage"]["completion_tokens"] == 4 for v in results.values())


# ------------------------------------------------------------------ /metrics
def _metric_values(server) -> dict[str, float]:
    """Every vllm: sample summed over its labels (histogram buckets left out)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:") and not sample.name.endswith("_bucket"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _wait_for_metrics(server, done, what: str) -> dict[str, float]:
    """Engine series follow the engine's snapshots: poll until ``done(values)`` holds."""
    deadline = time.monotonic() + 120
    while True:
        values = _metric_values(server)
        if done(values):
            return values
        assert time.monotonic() < deadline, f"{what}: {values}"
        time.sleep(0.1)


def _quiet_metrics(server) -> dict[str, float]:
    """The counters once earlier tests' last snapshots have landed: two reads a second
    apart that agree (the engine snapshots every ~0.5 s while busy and once when idle)."""
    values = _metric_values(server)
    for _ in range(60):
        time.sleep(1.0)
        again = _metric_values(server)
        if again.get("vllm:request_success_total") == values.get("vllm:request_success_total") \
                and again.get("vllm:iteration_tokens_total_count") == \
                values.get("vllm:iteration_tokens_total_count"):
            return again
        values = again
    raise AssertionError("the server's counters never settled")


def test_metrics_count_each_request_and_its_tokens(tiny_server, client):
    before = _quiet_metrics(tiny_server)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    num, max_tokens = 3, 10
    for _ in range(num):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                  extra_body=NO_EOS)
    expected = {
        "vllm:request_success_total": num,
        "vllm:prompt_tokens_total": num * len(prompt),
        "vllm:generation_tokens_total": num * max_tokens,
        "vllm:request_prompt_tokens_sum": num * len(prompt),
        "vllm:request_prompt_tokens_count": num,
        "vllm:request_generation_tokens_sum": num * max_tokens,
        "vllm:request_generation_tokens_count": num,
        "vllm:request_params_n_count": num,
        "vllm:request_params_max_tokens_sum": num * max_tokens,
        "vllm:time_to_first_token_seconds_count": num,
        "vllm:e2e_request_latency_seconds_count": num,
        "vllm:request_queue_time_seconds_count": num,
        "vllm:request_prefill_time_seconds_count": num,
        "vllm:request_decode_time_seconds_count": num,
        "vllm:request_inference_time_seconds_count": num,
        "vllm:inter_token_latency_seconds_count": num * (max_tokens - 1),
        "vllm:iteration_tokens_total_count": num * max_tokens,
    }

    def delta(values: dict[str, float]) -> dict[str, float]:
        return {name: values.get(name, 0) - before.get(name, 0) for name in expected}

    after = _wait_for_metrics(tiny_server, lambda v: all(
        d >= expected[name] for name, d in delta(v).items()), "requests not counted")
    assert delta(after) == expected


def test_a_finished_requests_engine_counters_are_in_metrics_when_it_returns(tiny_server,
                                                                            client):
    # The engine's counters (steps, prefix-cache queries, ...) travel with the step's
    # outputs: read at once, without waiting for a periodic snapshot.
    before = _quiet_metrics(tiny_server)
    prompt, max_tokens = [41, 42, 43, 44, 45, 46, 47, 48, 49], 6
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                              extra_body=NO_EOS)
    after = _metric_values(tiny_server)

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert delta("vllm:request_success_total") == 1
    assert delta("vllm:iteration_tokens_total_count") == max_tokens
    assert delta("vllm:prefix_cache_queries_total") >= len(prompt)


def test_requests_a_client_abandons_leave_no_running_request_or_kv(tiny_server):
    url = f"{tiny_server.base_url}/v1/completions"
    body = {"model": MODEL, "prompt": [5, 6, 7, 8] * 8, "max_tokens": 480, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as c:
        streams = [c.stream("POST", url, json=body) for _ in range(3)]
        for s in streams:
            r = s.__enter__()
            assert r.status_code == 200
            assert next(ln for ln in r.iter_lines() if ln.startswith("data: "))
        for s in streams:  # hang up mid-generation
            s.__exit__(None, None, None)
    _wait_for_metrics(
        tiny_server, lambda v: v["vllm:num_requests_running"] == 0
        and v["vllm:num_requests_waiting"] == 0 and v["vllm:kv_cache_usage_perc"] == 0,
        "abandoned requests still hold the engine")
    assert httpx.get(f"{tiny_server.base_url}/load", timeout=30).json() == {"server_load": 0}


def test_a_client_that_hangs_up_on_a_plain_request_frees_it(tiny_server):
    """vLLM's cancellation scenario without a client timeout that races the server: the
    client sends a long non-streamed request, waits until the server counts it, and closes
    the connection; the request is aborted and its KV freed."""
    import socket
    from urllib.parse import urlparse

    url = urlparse(tiny_server.base_url)
    payload = json.dumps({"model": MODEL, "prompt": [5, 6, 7, 8] * 8, "max_tokens": 480,
                          "min_tokens": 480, "n": 2}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}:{url.port}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    socks = []
    for _ in range(3):
        sock = socket.create_connection((url.hostname, url.port), timeout=60)
        sock.sendall(head + payload)
        socks.append(sock)
    load_url = f"{tiny_server.base_url}/load"
    deadline = time.monotonic() + 120
    while httpx.get(load_url, timeout=30).json()["server_load"] < 3:
        assert time.monotonic() < deadline, "the server never counted the requests"
        time.sleep(0.05)
    for sock in socks:
        sock.close()
    _wait_for_metrics(
        tiny_server, lambda v: v["vllm:num_requests_running"] == 0
        and v["vllm:num_requests_waiting"] == 0 and v["vllm:kv_cache_usage_perc"] == 0
        and httpx.get(load_url, timeout=30).json()["server_load"] == 0,
        "requests of clients that hung up still run")


def test_server_still_answers_after_these_scenarios(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
