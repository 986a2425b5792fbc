"""Rebuild a Hugging Face fast tokenizer (tokenizer.json + tokenizer_config.json) from the
``tokenizer.ggml.*`` metadata of a GGUF file: a GPT-2 style byte-level BPE vocabulary
(``tokenizer.ggml.model == "gpt2"``, with its merges) or a SentencePiece BPE one (``"llama"``,
``models/gguf_spm_tokenizer.py``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from llmtower.models.gguf_loader import field_value
from llmtower.models.gguf_spm_tokenizer import spm_tokenizer

# llama.cpp token types (gguf.TokenType): control and unknown tokens are special, user-defined
# ones are added tokens that are not special.
_UNKNOWN = 2
_CONTROL = 3
_USER_DEFINED = 4
_KINDS = ("gpt2", "llama")

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


def _merge_pairs(merges: list[str]) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges ("left right" strings) as BPE's pairs."""
    pairs = []
    for m in merges:
        left, space, right = m.partition(" ")
        if not space:
            raise ValueError(f"GGUF merge {m!r} is not two tokens separated by a space")
        pairs.append((left, right))
    return pairs


def _byte_level_bpe(reader: GGUFReader, tokens: list[str]) -> Tokenizer:
    merges = _merge_pairs(field_value(reader, "tokenizer.ggml.merges"))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary holds duplicate tokens, which a BPE vocabulary cannot")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    return tok


def _template(bos: str | None, eos: str | None, tokens: list[str]) -> processors.TemplateProcessing:
    """BOS before and EOS after each sequence (either may be None: not added)."""
    single = " ".join(([bos] if bos else []) + ["$A"] + ([eos] if eos else []))
    pair = single + " " + " ".join(([bos] if bos else []) + ["$B"] + ([eos] if eos else []))
    specials = [(t, tokens.index(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def gguf_tokenizer(reader: GGUFReader) -> tuple[Tokenizer, dict[str, Any]]:
    """The fast tokenizer and the tokenizer_config.json contents described by the GGUF metadata."""
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind not in _KINDS:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported: llmtower reads byte-level BPE "
                         "('gpt2') and SentencePiece BPE ('llama') tokenizers")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    bos = _token(reader, "tokenizer.ggml.bos_token_id", tokens)
    eos = _token(reader, "tokenizer.ggml.eos_token_id", tokens)
    unk = _token(reader, "tokenizer.ggml.unknown_token_id", tokens)
    if kind == "gpt2":
        tok = _byte_level_bpe(reader, tokens)
    else:
        scores = field_value(reader, "tokenizer.ggml.scores", None)
        if scores is None:
            raise ValueError("this SentencePiece ('llama') GGUF vocabulary lacks tokenizer.ggml.scores")
        merges = field_value(reader, "tokenizer.ggml.merges", None)
        tok = spm_tokenizer(tokens, scores, types,
                            bool(field_value(reader, "tokenizer.ggml.add_space_prefix", True)), unk,
                            None if merges is None else _merge_pairs(merges))
    special = (_CONTROL, _UNKNOWN) if kind == "llama" else (_CONTROL,)
    added = [AddedToken(tokens[i], special=types[i] in special, normalized=False)
             for i in range(len(tokens)) if types[i] in (*special, _USER_DEFINED)]
    tok.add_tokens(added)

    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise.
    add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(field_value(reader, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    if kind == "llama":
        tok.post_processor = _template(bos if add_bos else None, eos if add_eos else None, tokens)
    elif add_bos:
        tok.post_processor = _template(bos, None, tokens)
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "model_max_length": field_value(reader, f"{field_value(reader, 'general.architecture')}.context_length"),
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": _token(reader, "tokenizer.ggml.padding_token_id", tokens),
    }
    if kind == "llama":
        config.update(add_bos_token=add_bos, add_eos_token=add_eos)
    template = field_value(reader, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return tok, config


def write_gguf_tokenizer(reader: GGUFReader, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json for the GGUF's tokenizer into ``out_dir``."""
    tok, config = gguf_tokenizer(reader)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
