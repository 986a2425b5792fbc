"""LoRA over HTTP: --lora-modules (name=path and vLLM's JSON form), /v1/models with each
adapter's parent, ``model=<adapter>`` giving that adapter's greedy tokens (transformers + PEFT
merged), 404 for an unknown model naming the served ones, and /v1/load_lora_adapter and
/v1/unload_lora_adapter with their refusals."""
from __future__ import annotations

import json

import httpx
import pytest

from server_args import MODEL, TINY_SERVER_ARGS, launch_server
from tests.fixtures.lora_adapters import make_peft_adapter, merged_greedy

PROMPT = [5, 77, 300, 12, 9, 450, 8]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("lora_http")
    return {
        "all": make_peft_adapter(tiny_llama_dir, root / "all", r=8, seed=1),
        "attn": make_peft_adapter(tiny_llama_dir, root / "attn", r=4, seed=2,
                                  targets=["q_proj", "v_proj"]),
        "mlp": make_peft_adapter(tiny_llama_dir, root / "mlp", r=16, seed=3,
                                 targets=["gate_proj", "up_proj", "down_proj"]),
        "big": make_peft_adapter(tiny_llama_dir, root / "big", r=32, seed=4),
    }


@pytest.fixture(scope="module")
def lora_servers(tmp_path_factory, tiny_llama_dir, adapters):
    """The module's server, and beside it one whose --lora-modules names an adapter above
    --max-lora-rank (test_bad_lora_modules_stops_the_server waits for it to fail): both
    launched together, so that the failing start overlaps the good one."""
    attn = json.dumps({"name": "attn", "path": str(adapters["attn"])})
    bad = launch_server(tmp_path_factory, "bad_lora", [
        "--model", str(tiny_llama_dir), *TINY_SERVER_ARGS, "--enable-lora",
        "--lora-modules", f"big={adapters['big']}"])
    try:
        good = launch_server(tmp_path_factory, "lora_server", [
            "--model", str(tiny_llama_dir), *TINY_SERVER_ARGS, "--enable-lora",
            "--max-loras", "2", "--max-lora-rank", "16", "--enable-lora-runtime-updating",
            "--lora-modules", f"all={adapters['all']}", attn])
        try:
            good.wait_ready()
            yield {"lora_server": good, "bad_lora": bad}
        finally:
            good.stop()
    finally:
        bad.stop()


@pytest.fixture(scope="module")
def lora_server(lora_servers):
    return lora_servers["lora_server"]


def complete(server, model: str) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})


def tokens(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def test_models_lists_adapters_with_parent(lora_server):
    data = httpx.get(f"{lora_server.base_url}/v1/models").json()["data"]
    cards = {c["id"]: c for c in data}
    assert list(cards) == [MODEL, "all", "attn"]
    assert cards["all"]["parent"] == MODEL and cards["attn"]["parent"] == MODEL
    one = httpx.get(f"{lora_server.base_url}/v1/models/attn").json()
    assert one["id"] == "attn" and one["parent"] == MODEL


def test_model_names_the_adapter(lora_server, tiny_llama_dir, adapters):
    for name in ("all", "attn"):
        assert tokens(complete(lora_server, name)) == merged_greedy(
            tiny_llama_dir, adapters[name], [PROMPT], MAX_TOKENS)[0], name
    base = tokens(complete(lora_server, MODEL))
    assert base == merged_greedy(tiny_llama_dir, None, [PROMPT], MAX_TOKENS)[0]
    assert base != tokens(complete(lora_server, "all"))


def test_responses_name_the_adapter_asked_for(lora_server):
    """As vLLM answers: the response's ``model`` is the adapter, streamed or not, in
    completions and chat; the base model's requests name the base."""
    assert complete(lora_server, "all").json()["model"] == "all"
    assert complete(lora_server, MODEL).json()["model"] == MODEL
    chat = {"model": "attn", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 2}
    url = f"{lora_server.base_url}/v1/chat/completions"
    r = httpx.post(url, json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "attn", r.text
    with httpx.stream("POST", url, json={**chat, "stream": True}, timeout=60) as r:
        models = {json.loads(line[6:])["model"] for line in r.iter_lines()
                  if line.startswith("data: {")}
    assert models == {"attn"}


def test_unknown_model_is_404_naming_the_served_ones(lora_server):
    r = complete(lora_server, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model"
    for name in (MODEL, "all", "attn"):
        assert repr(name) in err["message"]


def test_load_use_and_unload_adapter(lora_server, tiny_llama_dir, adapters):
    url = lora_server.base_url
    r = httpx.post(f"{url}/v1/load_lora_adapter",
                   json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])}, timeout=60)
    assert r.status_code == 200, r.text
    assert tokens(complete(lora_server, "mlp")) == merged_greedy(
        tiny_llama_dir, adapters["mlp"], [PROMPT], MAX_TOKENS)[0]
    # Loaded twice: refused, the first stays.
    r = httpx.post(f"{url}/v1/load_lora_adapter",
                   json={"lora_name": "mlp", "lora_path": str(adapters["mlp"])}, timeout=60)
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=60)
    assert r.status_code == 200, r.text
    assert complete(lora_server, "mlp").status_code == 404
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "mlp"}, timeout=60)
    assert r.status_code == 404


@pytest.mark.parametrize("which, reason", [
    ("big", "rank 32 is above --max-lora-rank=16"),
    ("missing", "is not a directory"),
])
def test_bad_adapter_refused_at_load(lora_server, adapters, which, reason):
    path = str(adapters[which]) if which in adapters else "/nonexistent/adapter"
    r = httpx.post(f"{lora_server.base_url}/v1/load_lora_adapter",
                   json={"lora_name": which, "lora_path": path}, timeout=60)
    assert r.status_code == 400, r.text
    assert reason in r.json()["error"]["message"]
    assert complete(lora_server, which).status_code == 404  # not served
    assert tokens(complete(lora_server, "all"))  # the server still serves


def test_bad_lora_modules_stops_the_server(lora_servers):
    with pytest.raises(RuntimeError, match="rank 32 is above --max-lora-rank=16"):
        lora_servers["bad_lora"].wait_ready()


def test_lora_requests_info_metric(lora_server):
    import time
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = httpx.get(f"{lora_server.base_url}/metrics").text
        lines = [ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{")]
        if lines:
            break
        time.sleep(0.2)
    assert lines and 'max_lora="2"' in lines[0]
    assert "running_lora_adapters=" in lines[0] and "waiting_lora_adapters=" in lines[0]
