"""Rebuild a Hugging Face fast tokenizer (tokenizer.json + tokenizer_config.json) from the
``tokenizer.ggml.*`` metadata of a GGUF file with a GPT-2 style byte-level BPE vocabulary."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from llmtower.models.gguf_loader import field_value

# llama.cpp token types (gguf.TokenType): control tokens are special, user-defined ones are
# added tokens that are not special.
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(use_regex: bool) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _split_then_bytes(pattern: str) -> pre_tokenizers.Sequence:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False), _byte_level(False)])


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` name."""
    if pre in ("default", "gpt2", ""):
        return _byte_level(True)  # the GPT-2 regex inside ByteLevel
    if pre == "smollm":  # SmolLM/StarCoder: every digit alone, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level(True)])
    if pre in ("llama-bpe", "llama3"):
        return _split_then_bytes(_LLAMA3_SPLIT)
    if pre == "qwen2":
        return _split_then_bytes(_QWEN2_SPLIT)
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported: llmtower reads default, gpt2, "
                     "smollm, llama-bpe and qwen2")


def _token(reader: GGUFReader, key: str, tokens: list[str]) -> str | None:
    token_id = field_value(reader, key, None)
    if token_id is None:
        return None
    if not 0 <= token_id < len(tokens):
        raise ValueError(f"{key}={token_id} is outside the vocabulary of {len(tokens)} tokens")
    return tokens[token_id]


def gguf_tokenizer(reader: GGUFReader) -> tuple[Tokenizer, dict[str, Any]]:
    """The fast tokenizer and the tokenizer_config.json contents described by the GGUF metadata."""
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported: llmtower reads byte-level BPE "
                         "('gpt2') tokenizers")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary holds duplicate tokens, which a BPE vocabulary cannot")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
             for i in range(len(tokens)) if types[i] in (_CONTROL, _USER_DEFINED)]
    tok.add_tokens(added)

    bos = _token(reader, "tokenizer.ggml.bos_token_id", tokens)
    add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": field_value(reader, f"{field_value(reader, 'general.architecture')}.context_length"),
        "bos_token": bos,
        "eos_token": _token(reader, "tokenizer.ggml.eos_token_id", tokens),
        "unk_token": _token(reader, "tokenizer.ggml.unknown_token_id", tokens),
        "pad_token": _token(reader, "tokenizer.ggml.padding_token_id", tokens),
    }
    template = field_value(reader, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return tok, config


def write_gguf_tokenizer(reader: GGUFReader, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for the GGUF's tokenizer into ``out_dir``."""
    tok, config = gguf_tokenizer(reader)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
