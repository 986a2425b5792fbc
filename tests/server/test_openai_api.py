"""The OpenAI-compatible API as the official `openai` client sees it, against `llmtower serve`
with the tiny random-weight Llama: completions, chat, streaming, n, stop, logprobs, seeds."""
from __future__ import annotations

import json

import httpx

from server_args import MODEL

PROMPT = "The quick brown fox"
GREEDY = dict(temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})


def _greedy_text(client, prompt: str = PROMPT, **kw) -> str:
    return client.completions.create(model=MODEL, prompt=prompt, **{**GREEDY, **kw}).choices[0].text


def test_completion_text_usage_and_finish_reason(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    (choice,) = r.choices
    assert choice.text and choice.finish_reason == "length"
    assert r.model == MODEL and r.object == "text_completion"
    n_prompt = len(tokenizer.encode(PROMPT))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 24
    assert r.usage.total_tokens == n_prompt + 24
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_streamed_completion_equals_the_plain_one_and_ends_with_usage(client):
    plain = _greedy_text(client)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == plain
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 24


def test_raw_stream_is_sse_and_ends_with_done(tiny_server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/completions", json=body,
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_a_list_of_prompts_gets_one_choice_per_prompt(client):
    prompts = ["The quick brown fox", "What is the capital", "Hello world"]
    alone = [_greedy_text(client, p, max_tokens=10) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, **{**GREEDY, "max_tokens": 10})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == alone
    assert r.usage.completion_tokens == 30
    texts = ["", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompts, stream=True,
                                           **{**GREEDY, "max_tokens": 10}):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
    assert texts == alone
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=3)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


def test_chat_applies_the_template_and_streams_the_role_first(client, tiny_server, tokenizer):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                       temperature=0.0)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    tok = httpx.post(f"{tiny_server.base_url}/tokenize", json={"messages": messages}).json()
    assert tok["count"] == r.usage.prompt_tokens
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens <= 12
    stream = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, temperature=0.0, stream=True,
        stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == r.choices[0].message.content
    assert [c for c in stream if c.choices][-1].choices[0].finish_reason is not None
    assert stream[-1].choices == [] and stream[-1].usage.total_tokens == r.usage.total_tokens


def test_n_samples_come_back_as_indexed_choices(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=2, temperature=1.0, seed=3,
                                  max_tokens=8, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    again = client.completions.create(model=MODEL, prompt=PROMPT, n=2, temperature=1.0, seed=3,
                                      max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
        temperature=1.0, seed=3, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


def test_same_seed_same_text_other_seed_other_text(client):
    kw = dict(temperature=1.0, max_tokens=16, extra_body={"ignore_eos": True})
    a = client.completions.create(model=MODEL, prompt=PROMPT, seed=11, **kw).choices[0].text
    b = client.completions.create(model=MODEL, prompt=PROMPT, seed=11, **kw).choices[0].text
    c = client.completions.create(model=MODEL, prompt=PROMPT, seed=12, **kw).choices[0].text
    assert a == b and a != c


def test_stop_string_ends_the_text_before_it(client):
    full = _greedy_text(client, max_tokens=40)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = client.completions.create(model=MODEL, prompt=PROMPT, stop=[stop],
                                  **{**GREEDY, "max_tokens": 40})
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, stop=stop, stream=True, **{**GREEDY, "max_tokens": 40}))
    assert streamed == r.choices[0].text


def test_logprobs_of_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 24
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        # Byte-level tokens of the random model may share a text ("\ufffd"): <= 4 keys.
        assert chosen <= 0 and 1 <= len(top) <= 4
        assert abs(chosen - max(top.values())) < 1e-4  # greedy picks the most likely token
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0.0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_sampling_extensions_are_accepted(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.7, top_p=0.9, seed=1,
        presence_penalty=0.5, frequency_penalty=0.5, user="tester",
        extra_body={"top_k": 20, "min_p": 0.05, "min_tokens": 8, "repetition_penalty": 1.2,
                    "cache_salt": "tenant-a"})
    assert r.usage.completion_tokens == 8


def test_prefix_cache_hits_show_in_usage_and_metrics_extension(tiny_server):
    prompt = "Key-value caches store attention keys and values in fixed-size blocks " * 4
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "include_metrics": True}
    httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=60)
    r = httpx.post(f"{tiny_server.base_url}/v1/completions", json=body, timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    m = r["metrics"]
    assert m["cached_tokens"] == r["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert m["ttft_ms"] > 0 and m["e2e_latency_ms"] >= m["ttft_ms"]
    for key in ("queue_time_ms", "prefill_time_ms", "decode_time_ms", "num_preemptions"):
        assert key in m


def test_models_health_ready_version_tokenize_detokenize(client, tiny_server, tokenizer):
    (card,) = client.models.list().data
    assert card.id == MODEL
    base = tiny_server.base_url
    assert httpx.get(f"{base}/health").status_code == 200
    ready = httpx.get(f"{base}/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert httpx.get(f"{base}/version").json()["version"]
    ids = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert ids == tokenizer.encode(PROMPT)
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT


def test_metrics_use_vllm_names_with_the_model_label(client, tiny_server):
    _greedy_text(client, max_tokens=4)
    text = httpx.get(f"{tiny_server.base_url}/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_requests_swapped", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket",
                 "vllm:request_prefill_time_seconds_bucket",
                 "vllm:request_decode_time_seconds_bucket",
                 "vllm:iteration_tokens_total_bucket", "llmtower:scheduler_step_seconds_bucket",
                 "llmtower:kv_cache_fragmentation_ratio", "llmtower:batch_utilization"):
        assert f'{name}{{' in text and f'model_name="{MODEL}"' in text, name
    assert ('vllm:request_success_total{engine="0",finished_reason="length",'
            'model_name="tiny"}') in text
