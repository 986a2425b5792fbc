"""Write a Llama-shaped GGUF with random block-quantized weights, streamed tensor by tensor
(an 8B-shaped file never sits in memory), with the tokenizer metadata of another GGUF (the
default model's unless --tokenizer-from says otherwise).

Random bytes are valid blocks in every format once their float16 scales are set to finite
values, so no quantizer runs: a 4.9 GB 8B-shaped Q4_K_M file takes about as long as writing it.
Greedy text from it is meaningless; use it for memory and speed.

  python benchmarks/make_random_gguf.py --shape 8b --mix q4_k_m --out /tmp/llama-8b-q4km.gguf
  python benchmarks/make_random_gguf.py --shape 1b --mix q4_0 --out /tmp/llama-1b-q4_0.gguf
"""
from __future__ import annotations

import argparse

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
SHAPES = {  # hidden, intermediate, layers, heads, kv heads (Llama 3.2 1B / 3.1 8B)
    "1b": (2048, 8192, 16, 32, 8),
    "8b": (4096, 14336, 32, 32, 8),
    "tiny": (256, 512, 2, 4, 2),
}
# Offsets of the float16 scale fields in a block of each format.
_HALVES = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
           Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q5_1: (0, 2)}


def mix_type(mix: str, name: str, layer: int, layers: int) -> Q:
    """The block format of tensor ``name`` in llama.cpp-like mixes."""
    if name in ("token_embd", "output"):
        return Q.Q6_K
    if mix == "q4_0":
        return Q.Q4_0
    if mix == "q8_0":
        return Q.Q8_0
    # Q4_K_M: Q4_K, with attn_v and ffn_down in Q6_K for some layers (llama.cpp: the first
    # eighth, the last eighth and every third between).
    if name in ("attn_v", "ffn_down"):
        if layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2:
            return Q.Q6_K
    return Q.Q4_K


def random_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    values, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    nb = n * k // values
    blocks = rng.integers(0, 256, (nb, nbytes), dtype=np.uint8)
    for off in _HALVES[qtype]:
        # Scales giving weights of about N(0, 0.02) (small weights keep 32 layers in range).
        scale = rng.uniform(0.5e-3, 2e-3, nb).astype(np.float16)
        if off and qtype in (Q.Q4_1, Q.Q5_1, Q.Q4_K, Q.Q5_K):
            scale = (scale * 8).astype(np.float16)  # minimums: centre the values on 0
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(nb, 2)
    return blocks.reshape(n, k // values * nbytes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=SHAPES, default="1b")
    ap.add_argument("--mix", choices=["q4_0", "q4_k_m", "q8_0"], default="q4_k_m")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-from", default=None, help="a GGUF whose tokenizer.* keys to copy")
    ap.add_argument("--rope-freqs", action="store_true", help="add Llama 3.1's rope_freqs tensor")
    args = ap.parse_args()
    hidden, inter, layers, heads, kv = SHAPES[args.shape]
    head_dim = hidden // heads
    if args.tokenizer_from is None:
        from llmtower.models.default_model import default_gguf_path
        args.tokenizer_from = str(default_gguf_path())
    src = gguf.GGUFReader(args.tokenizer_from)
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)

    w = gguf.GGUFWriter(args.out, "llama")
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(head_dim)
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            w.add_key_value(key, val, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(field.parts[field.data[0]]).decode("utf-8"), vtype)
        else:
            w.add_key_value(key, field.parts[field.data[0]].tolist()[0], vtype)

    rng = np.random.default_rng(0)
    plan: list[tuple[str, Q | None, tuple[int, ...]]] = [("token_embd.weight", Q.Q6_K, (vocab, hidden))]
    if args.rope_freqs:
        plan.append(("rope_freqs.weight", None, (head_dim // 2,)))
    for i in range(layers):
        for name, shape in (("attn_q", (heads * head_dim, hidden)), ("attn_k", (kv * head_dim, hidden)),
                            ("attn_v", (kv * head_dim, hidden)), ("attn_output", (hidden, heads * head_dim)),
                            ("ffn_gate", (inter, hidden)), ("ffn_up", (inter, hidden)),
                            ("ffn_down", (hidden, inter))):
            plan.append((f"blk.{i}.{name}.weight", mix_type(args.mix, name, i, layers), shape))
        plan.append((f"blk.{i}.attn_norm.weight", None, (hidden,)))
        plan.append((f"blk.{i}.ffn_norm.weight", None, (hidden,)))
    plan.append(("output_norm.weight", None, (hidden,)))

    def make(qtype: Q | None, shape: tuple[int, ...]) -> np.ndarray:
        if qtype is None:
            return np.ones(shape, dtype=np.float32)
        return random_blocks(qtype, shape[0], shape[1], rng)

    for name, qtype, shape in plan:
        values, nbytes = gguf.GGML_QUANT_SIZES[qtype] if qtype else (1, 4)
        byte_shape = shape if qtype is None else (shape[0], shape[1] // values * nbytes)
        w.add_tensor_info(name, byte_shape, np.dtype(np.uint8 if qtype else np.float32),
                          int(np.prod(byte_shape)) * (1 if qtype else 4), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, qtype, shape in plan:
        w.write_tensor_data(make(qtype, shape))
    w.close()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
