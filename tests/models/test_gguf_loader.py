"""Reading GGUF files: dequantization of each tensor type, llama.cpp's q/k row permutation undone,
tensor names, config and tokenizer rebuilt from metadata, compared with the original model."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmtower.models.gguf_convert import convert_gguf_to_hf_dir
from llmtower.models.gguf_dequant import NUMPY_DEQUANTIZERS, dequantize
from llmtower.models.gguf_loader import gguf_model_config, hf_tensor_name, open_gguf, permute_qk, unpermute_qk
from llmtower.models.loader import load_model_config, load_state_dict, load_tokenizer
from tests.fixtures.tiny_gguf import llama_cpp_permute, write_gguf_from_hf_dir
from tests.fixtures.tiny_models import make_tiny_model_dir

Q = gguf.GGMLQuantizationType
TEXTS = ["What is the capital of France? Paris.", "  spaces\tand\nnewlines  ", "digits 0123456789",
         "<|im_start|>user\nhi<|im_end|>", "naïve café 😀"]


def block_error_bound(x: np.ndarray, qtype) -> np.ndarray:
    """Largest dequantization error each value may have, from its 32-value block's range."""
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    lo, hi = blocks.min(axis=1, keepdims=True), blocks.max(axis=1, keepdims=True)
    bound = {
        Q.Q8_0: 0.6 * amax / 127,                        # half a step, plus the f16 scale's rounding
        Q.Q4_0: 1.1 * amax / 8,                          # a full step at the clamped +8 end
        Q.Q4_1: 0.6 * (hi - lo) / 15 + 1e-3 * np.abs(lo),  # half a step, plus the f16 minimum's rounding
    }[qtype]
    return np.broadcast_to(bound, blocks.shape).reshape(x.shape)


@pytest.fixture(scope="module")
def typed_gguf(tmp_path_factory):
    """A GGUF with one 8x64 tensor of each type, and the float32 values it was written from."""
    rng = np.random.default_rng(0)
    originals = {t: rng.normal(0, 1, (8, 64)).astype(np.float32) for t in (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1)}
    path = tmp_path_factory.mktemp("gguf") / "typed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for qtype, x in originals.items():
        if qtype == Q.F32:
            writer.add_tensor(qtype.name, x)
        elif qtype == Q.F16:
            writer.add_tensor(qtype.name, x.astype(np.float16))
        else:
            writer.add_tensor(qtype.name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return open_gguf(path), originals


def test_float_tensors_read_back(typed_gguf):
    reader, originals = typed_gguf
    tensors = {t.name: t for t in reader.tensors}
    f32 = dequantize(tensors["F32"].data, Q.F32)
    np.testing.assert_array_equal(f32, originals[Q.F32])
    f16 = dequantize(tensors["F16"].data, Q.F16)
    assert f16.dtype == np.float32 and f16.shape == (8, 64)
    np.testing.assert_allclose(f16, originals[Q.F16], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_tensors_within_format_tolerance(typed_gguf, qtype):
    reader, originals = typed_gguf
    tensor = next(t for t in reader.tensors if t.name == qtype.name)
    assert tensor.tensor_type == qtype
    x = originals[qtype]
    got = dequantize(tensor.data, qtype)
    assert got.dtype == np.float32 and got.shape == x.shape
    err = np.abs(got - x)
    assert (err <= block_error_bound(x, qtype)).all()
    assert err.mean() < 0.5 * block_error_bound(x, qtype).mean()  # not just inside the bound: centred


@pytest.mark.parametrize("qtype", list(NUMPY_DEQUANTIZERS))
def test_numpy_fallback_matches_gguf_package(typed_gguf, qtype):
    reader, _ = typed_gguf
    data = next(t for t in reader.tensors if t.name == qtype.name).data
    np.testing.assert_allclose(NUMPY_DEQUANTIZERS[qtype](data), gguf.quants.dequantize(data, qtype),
                               rtol=1e-6, atol=1e-7)


def test_without_gguf_quants_the_numpy_decoders_are_used(typed_gguf, monkeypatch):
    from llmtower.models import gguf_dequant

    monkeypatch.setattr(gguf_dequant, "_gguf_dequantize", None)  # as with gguf releases before it
    reader, originals = typed_gguf
    q4 = next(t for t in reader.tensors if t.name == "Q4_1")
    x = originals[Q.Q4_1]
    assert (np.abs(dequantize(q4.data, Q.Q4_1) - x) <= block_error_bound(x, Q.Q4_1)).all()
    with pytest.raises(ValueError, match="Q6_K cannot be read.*pip install -U gguf"):
        dequantize(q4.data, Q.Q6_K)


@pytest.mark.parametrize("n_head, head_dim", [(4, 16), (2, 8), (9, 64)])
def test_unpermute_inverts_llama_cpp_permutation(n_head, head_dim):
    w = np.arange(n_head * head_dim * 3, dtype=np.float32).reshape(n_head * head_dim, 3)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(permute_qk(w, n_head), permuted)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)
    # Row order inside one head: llama.cpp interleaves the two halves rotate_half pairs up.
    assert permuted[:4, 0].tolist() == [0, head_dim // 2 * 3, 3, (head_dim // 2 + 1) * 3]


@pytest.mark.parametrize("gguf_name, hf_name", [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.12.attn_q.weight", "model.layers.12.self_attn.q_proj.weight"),
    ("blk.0.attn_k.bias", "model.layers.0.self_attn.k_proj.bias"),
    ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
    ("blk.3.ffn_gate.weight", "model.layers.3.mlp.gate_proj.weight"),
    ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
    ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
    ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
])
def test_tensor_names(gguf_name, hf_name):
    assert hf_tensor_name(gguf_name) == hf_name


def test_unknown_tensor_name():
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


@pytest.mark.parametrize("arch, tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_f32_gguf_converts_back_to_the_original_model(tmp_path_factory, tiny_tokenizer_dir, arch, tie):
    original = make_tiny_model_dir(tmp_path_factory, arch, tie=tie, tokenizer_dir=tiny_tokenizer_dir)
    gguf_path = write_gguf_from_hf_dir(original, tmp_path_factory.mktemp("g") / "tiny.gguf")
    converted = tmp_path_factory.mktemp("converted")
    convert_gguf_to_hf_dir(gguf_path, converted)

    assert load_model_config(converted) == load_model_config(original)
    got, want = load_state_dict(converted), load_state_dict(original)
    assert got.keys() == want.keys()
    for name in want:  # exact: F32 storage, and q/k rows back in Hugging Face order
        assert torch.equal(got[name], want[name]), name

    tok_got, tok_want = load_tokenizer(converted), load_tokenizer(original)
    for text in TEXTS:
        assert tok_got.encode(text) == tok_want.encode(text)
        assert tok_got.decode(tok_got.encode(text)) == text
    assert tok_got.encode("<|im_end|>") == [tok_want.eos_token_id]
    messages = [{"role": "user", "content": "hi"}]
    assert (tok_got.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == tok_want.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def test_quantized_gguf_converts_close_to_the_original(tmp_path_factory, tiny_llama_dir):
    gguf_path = write_gguf_from_hf_dir(tiny_llama_dir, tmp_path_factory.mktemp("g") / "q8.gguf",
                                       qtype_of=lambda name, w: Q.Q8_0)
    assert {t.tensor_type for t in open_gguf(gguf_path).tensors} == {Q.Q8_0, Q.F32}
    converted = tmp_path_factory.mktemp("converted_q8")
    convert_gguf_to_hf_dir(gguf_path, converted)
    got, want = load_state_dict(converted), load_state_dict(tiny_llama_dir)
    for name, w in want.items():
        bound = block_error_bound(w.numpy(), Q.Q8_0) if w.ndim == 2 else 0
        assert (np.abs(got[name].numpy() - w.numpy()) <= bound).all(), name


def test_config_from_metadata(tiny_llama_dir, tmp_path):
    reader = open_gguf(write_gguf_from_hf_dir(tiny_llama_dir, tmp_path / "m.gguf"))
    config = gguf_model_config(reader)
    assert config.rms_norm_eps == 1e-6  # float32 in GGUF, read back as written in config.json
    assert (config.num_hidden_layers, config.num_key_value_heads, config.max_position_embeddings) == (2, 2, 512)


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        open_gguf(bad)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'phi3' is not supported.*llama, qwen2"):
        gguf_model_config(open_gguf(path))
