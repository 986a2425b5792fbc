"""The model families beyond Llama served by `llmtower serve` with their own chat templates:
tiny random Gemma 3, Qwen3-MoE and Granite folders (tests/models/test_families.py's configs),
each with its family's template style in tokenizer_config.json, each behind its own server (the
three start side by side). A chat completion's prompt is the template's rendering as
transformers renders it, and its greedy reply is the offline engine's (``LLM.chat``)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from server_process import ServerProcess
from tests.models.test_families import BASE, FAMILIES

# Short: the tiny tokenizer spells most template markers byte by byte (max_model_len 128).
MESSAGES = [{"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo"},
            {"role": "user", "content": "Why?"}]
MAX_TOKENS = 8

# Each family's template style (shortened from the published ones), and the rendering of
# MESSAGES it must give, from the first user turn on.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set first = messages[0]['content'] + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ (first if loop.first else '') + m['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GRANITE = (
    "{% for m in messages %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}"
    "<|end_of_text|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|start_of_role|>assistant<|end_of_role|>{% endif %}")
TEMPLATES = {
    "gemma3": (GEMMA, "<start_of_turn>user\nBe terse.\n\nHi<end_of_turn>\n"
               "<start_of_turn>model\nYo<end_of_turn>\n<start_of_turn>user\nWhy?"
               "<end_of_turn>\n<start_of_turn>model\n"),
    "qwen3_moe": (CHATML, "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n"
                  "Hi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
                  "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n"),
    "granite": (GRANITE, "<|start_of_role|>system<|end_of_role|>Be terse.<|end_of_text|>\n"
                "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
                "<|start_of_role|>assistant<|end_of_role|>Yo<|end_of_text|>\n"
                "<|start_of_role|>user<|end_of_role|>Why?<|end_of_text|>\n"
                "<|start_of_role|>assistant<|end_of_role|>"),
}
# The markers the family's tokenizer has as special tokens (ids from 512 on: the models' vocabulary
# is grown to VOCAB for them).
SPECIAL = {"gemma3": ["<start_of_turn>", "<end_of_turn>"], "qwen3_moe": [],
           "granite": ["<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"]}
VOCAB = 520
SERVER_ARGS = ["--num-threads", "1", "--max-model-len", "128", "--num-gpu-blocks", "64"]


def _build(out: Path, tokenizer_dir: Path, family: str) -> Path:
    """The family's tiny random model with the tiny tokenizer, the family's markers as special
    tokens and its template in tokenizer_config.json."""
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**{**BASE, "initializer_range": 0.1, **extra,
                                               "vocab_size": VOCAB})
    getattr(transformers, model_cls)(config).float().eval().save_pretrained(out)
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    if SPECIAL[family]:
        tok.add_special_tokens({"additional_special_tokens": SPECIAL[family]})
    tok.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)  # the template goes in the config
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATES[family][0]
    cfg_path.write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer_dir):
    """family -> (model folder, its running server); the servers start concurrently."""
    dirs = {f: _build(tmp_path_factory.mktemp(f), tiny_tokenizer_dir, f) for f in TEMPLATES}
    servers = {f: ServerProcess(["--model", str(d), "--served-model-name", f, *SERVER_ARGS],
                                tmp_path_factory.mktemp(f"serve-{f}") / "server.log")
               for f, d in dirs.items()}
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            for started in [pool.submit(s.start) for s in servers.values()]:
                started.result()
        yield {f: (dirs[f], servers[f]) for f in TEMPLATES}
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="module")
def offline(served):
    """family -> the offline engine's greedy reply (prompt ids, reply ids, text) to MESSAGES."""
    from llmtower.core.sampling_params import SamplingParams
    from llmtower.engine.llm import LLM

    out = {}
    for family, (path, _) in served.items():
        llm = LLM(str(path), num_threads=1, max_model_len=128)
        (r,) = llm.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
        out[family] = (list(r.prompt_token_ids), list(r.outputs[0].token_ids), r.outputs[0].text)
    return out


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_chat_uses_the_family_template_and_matches_offline(family, served, offline):
    from transformers import AutoTokenizer

    path, server = served[family]
    tok = AutoTokenizer.from_pretrained(path)
    rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith(TEMPLATES[family][1])  # the family's own markers
    expected_prompt = tok(rendered, add_special_tokens=False)["input_ids"]

    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": family, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["prompt_token_ids"] == expected_prompt  # what the engine saw
    prompt_ids, reply_ids, reply_text = offline[family]
    assert prompt_ids == expected_prompt
    assert choice["token_ids"] == reply_ids and reply_ids
    assert choice["message"]["content"] == reply_text
    assert body["usage"]["prompt_tokens"] == len(expected_prompt)
