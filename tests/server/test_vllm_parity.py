"""What a vLLM user switching to `llmtower serve` relies on: vLLM's request fields (logit_bias,
echo, return_tokens_as_token_ids, truncate_prompt_tokens, top_k/min_p/repetition_penalty),
the response fields clients index, /v1/responses, /ping, /load, /docs, and the vLLM-style
command line (positional MODEL, --config YAML, several keys and names, --chat-template, the
access log)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_args import MODEL, start_server


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60, **kw)


# ------------------------------------------------------------------ request fields
def test_logit_bias_steers_greedy_decoding(client, tokenizer):
    target = tokenizer.encode(" cat", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                  logit_bias={str(target): 100})
    assert r.choices[0].text == tokenizer.decode([target] * 4)
    # A bias on a token outside the vocabulary is a 400 that names logit_bias.
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=2,
                                  logit_bias={"99999": 5})


def test_echo_prepends_the_prompt_streamed_or_not(client):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3,
                                  temperature=0, extra_body={"ignore_eos": True})
    echoed = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3,
                                       temperature=0, echo=True, extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == "Hello there" + r.choices[0].text
    chunks = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3,
                                       temperature=0, echo=True, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text


def test_return_tokens_as_token_ids_names_tokens_by_id(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True,
        top_logprobs=2, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    tokens = r.choices[0].logprobs.content
    assert len(tokens) == 3
    assert all(t.token.startswith("token_id:") for t in tokens)
    assert all(alt.token.startswith("token_id:") for t in tokens for alt in t.top_logprobs)
    c = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True,
                                              "ignore_eos": True})
    assert all(t.startswith("token_id:") for t in c.choices[0].logprobs.tokens)


def test_truncate_prompt_tokens_keeps_the_end_of_a_too_long_prompt(client):
    r = client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 100, "ignore_eos": True})
    assert r.usage.prompt_tokens == 100 and r.usage.completion_tokens == 2


def test_vllm_sampling_extensions_are_accepted_on_both_endpoints(client):
    extra = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3, "ignore_eos": True}
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body=extra)
    assert r.usage.completion_tokens == 3
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3, extra_body=extra)
    assert c.usage.completion_tokens == 3


# ------------------------------------------------------------------ response fields
def test_response_fields_clients_index(tiny_server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = _post(tiny_server, "/v1/chat/completions", body).json()
    assert r["system_fingerprint"]
    message = r["choices"][0]["message"]
    assert {"refusal", "annotations", "tool_calls"} <= message.keys()
    assert message["refusal"] is None and message["annotations"] is None
    models = httpx.get(f"{tiny_server.base_url}/v1/models").json()["data"]
    assert models[0]["parent"] is None
    assert models[0]["permission"][0]["object"] == "model_permission"


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_streamed_chunks_carry_null_finish_reason_and_logprobs(tiny_server, path, body):
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "ignore_eos": True, **body}
    with httpx.stream("POST", f"{tiny_server.base_url}{path}", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [e["choices"][0] for e in events if e["choices"]]
    # A token that ends inside a UTF-8 character adds no text and sends no chunk, so the
    # random model's four sampled tokens may come as one chunk (CI saw '\ufffd\ufffdӢ' alone);
    # chat always opens with its role chunk.
    assert len(choices) >= (2 if "messages" in body else 1)
    assert all("logprobs" in choice for choice in choices)
    for choice in choices[:-1]:
        assert choice["finish_reason"] is None
    assert choices[-1]["finish_reason"] == "length"
    assert all(e["system_fingerprint"] for e in events)


# ------------------------------------------------------------------ routes
def test_responses_api_non_streaming_and_streaming(client):
    r = client.responses.create(model=MODEL, input="Say hi", instructions="Be brief.",
                                max_output_tokens=5, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.output_text == r.output[0].content[0].text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 5
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": "Say hi"}],
                                          instructions="Be brief.", max_output_tokens=5,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    # The same greedy answer, streamed.
    assert text == r.output_text == events[-1].response.output[0].content[0].text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_api_refuses_what_it_cannot_do(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")


def test_ping_load_and_docs(tiny_server):
    base = tiny_server.base_url
    assert httpx.get(f"{base}/ping").status_code == 200
    assert httpx.post(f"{base}/ping").status_code == 200
    assert httpx.get(f"{base}/load").json() == {"server_load": 0}
    assert httpx.get(f"{base}/docs").status_code == 200
    schema = httpx.get(f"{base}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses"} <= schema["paths"].keys()
    assert "CompletionRequest" in schema["components"]["schemas"]


# ------------------------------------------------------------------ the vLLM command line
TEMPLATE = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"


@pytest.fixture(scope="module")
def vllm_style_server(tmp_path_factory, tiny_llama_dir):
    """Started the way a vLLM user would: positional MODEL, a YAML config, vLLM aliases."""
    d = tmp_path_factory.mktemp("vllm_style")
    config = d / "config.yaml"
    config.write_text("max-model-len: 0.5K\nnum_gpu_blocks_override: 256\nscheduling-policy: fcfs\n"
                      "num-threads: 1\nserved-model-name: [first, second]\n"
                      "enable-log-requests: true\n")
    (d / "template.jinja").write_text(TEMPLATE)
    server = start_server(tmp_path_factory, "vllm_style", [
        str(tiny_llama_dir), "--config", str(config), "--api-key", "k1", "k2",
        "--chat-template", str(d / "template.jinja"), "--max-num-batched-tokens", "2k",
        "--disable-log-stats"])
    yield server
    server.stop()


def test_vllm_style_command_line(vllm_style_server, tokenizer):
    base = vllm_style_server.base_url
    models = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer k2"}).json()
    assert [m["id"] for m in models["data"]] == ["first", "second"]
    assert models["data"][0]["max_model_len"] == 512  # "0.5K" from the YAML file
    assert httpx.get(f"{base}/v1/models").status_code == 401
    # Probes and the API's documentation need no key.
    for path in ("/ping", "/load", "/docs", "/openapi.json"):
        assert httpx.get(f"{base}{path}").status_code == 200, path
    # Bound to 127.0.0.1, the start-up log says how to listen on all interfaces.
    assert "--host 0.0.0.0" in vllm_style_server.log_path.read_text()
    for key, name in (("k1", "first"), ("k2", "second")):
        r = _post(vllm_style_server, "/v1/completions",
                  {"model": name, "prompt": "secret prompt text", "max_tokens": 2},
                  headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["model"] == "first"
    # --chat-template replaces the tokenizer's template.
    r = _post(vllm_style_server, "/tokenize",
              {"messages": [{"role": "user", "content": "hi"}]},
              headers={"Authorization": "Bearer k1"})
    assert r.json()["tokens"] == tokenizer.encode("<<hi>>", add_special_tokens=False)


def test_access_log_has_one_line_per_request_without_prompt_text(vllm_style_server):
    r = _post(vllm_style_server, "/v1/completions",
              {"model": "first", "prompt": "another secret", "max_tokens": 3, "ignore_eos": True},
              headers={"Authorization": "Bearer k1"})
    assert r.status_code == 200
    log = vllm_style_server.log_path.read_text()
    lines = [ln for ln in log.splitlines() if '"POST /v1/completions" 200' in ln]
    assert lines and "completion_tokens=3" in lines[-1] and "prompt_tokens=" in lines[-1]
    assert "secret" not in log
    assert any('"GET /v1/models" 401' in ln for ln in log.splitlines())


def test_request_chat_template_needs_the_operators_consent(vllm_style_server):
    r = _post(vllm_style_server, "/v1/chat/completions",
              {"model": "first", "messages": [{"role": "user", "content": "hi"}],
               "chat_template": "{{ 'x' }}", "max_tokens": 2},
              headers={"Authorization": "Bearer k1"})
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]


def test_prompt_logprobs_and_echo_with_logprobs(client, tiny_server, tokenizer):
    ids = tokenizer.encode("the cat sat on the mat", add_special_tokens=False)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2, "ignore_eos": True}
    r = _post(tiny_server, "/v1/completions", body).json()
    pl = r["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for token, entry in zip(ids[1:], pl[1:]):
        assert str(token) in entry and len(entry) <= 3  # the token and its top 2
        assert entry[str(token)]["logprob"] <= 0 and entry[str(token)]["rank"] >= 1
    # echo + logprobs: the prompt's tokens lead the logprobs block, the first without one.
    e = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0,
                                  echo=True, logprobs=1, extra_body={"ignore_eos": True})
    lp = e.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1] == pytest.approx(pl[1][str(ids[1])]["logprob"], abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset)
    # Chat: the rendered prompt's logprobs, on the response.
    c = _post(tiny_server, "/v1/chat/completions",
              {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
               "prompt_logprobs": 0}).json()
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"]) == c["usage"]["prompt_tokens"]
    # Not when streaming (as vLLM): a 400 that says so.
    r = _post(tiny_server, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 400 and "streaming" in r.json()["error"]["message"]


def test_chat_echo_continues_the_assistants_last_message(client):
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hello"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                       extra_body={"echo": True, "ignore_eos": True,
                                                   "add_generation_prompt": False})
    assert r.choices[0].message.content.startswith("Hello")
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, stream=True,
        extra_body={"echo": True, "ignore_eos": True, "add_generation_prompt": False}))
    assert chunks[0].choices[0].delta.content == "Hello"
