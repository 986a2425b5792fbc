"""A GGUF's SentencePiece vocabulary (``tokenizer.ggml.model == "llama"``: Llama 2, Mistral,
TinyLlama, CodeLlama) as a ``tokenizers`` pipeline: the one of Llama 2's own tokenizer.json
(transformers' LlamaTokenizerFast as converted from SentencePiece), which tokenizes as
SentencePiece and llama.cpp do.

The file holds tokens, scores and token types, and no merges: llama.cpp's converter writes the
pieces of a ``tokenizer.model`` with their SentencePiece scores, or those of a tokenizer.json
with -1000 for every score. SentencePiece's BPE merges, at each step, the adjacent pair whose
joined piece scores highest; as a BPE model that is one merge per way of cutting a vocabulary
piece into two vocabulary pieces, ranked by the joined piece's score, then (equal scores, as
the converter's placeholders are) by its position in the vocabulary, which is the order BPE
trainers create pieces in. The rest: byte fallback to the ``<0xNN>`` tokens, "▁" for spaces
with one prepended to each stretch of text (``tokenizer.ggml.add_space_prefix``, default on),
and the decoder that undoes both. Checked against llama.cpp's reference tokenizations of the
real Llama and Phi-3 vocabularies (models/ggml-vocab-llama-spm.gguf.inp/.out: 47 of 47 equal;
ranking the merges by id alone instead of score gets 10 wrong).

A SentencePiece Unigram vocabulary cannot be read this way (its pieces are not merges and its
scores are log-probabilities, not ranks), nor can one without byte tokens; both are refused.
"""
from __future__ import annotations

import math

from tokenizers import Tokenizer, decoders, models, normalizers

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's "▁"


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges of a SentencePiece vocabulary: every split of a normal piece into two
    normal pieces, best joined piece first (highest score, then earliest id, then shortest left
    part, as transformers orders a split's alternatives)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _check_bpe_scores(tokens: list[str], scores: list[float], types: list[int]) -> None:
    """Refuse a Unigram vocabulary: BPE SentencePiece scores are whole numbers (minus the
    merge's rank, 0, or the converter's -1000), Unigram ones log-probabilities."""
    normal = [i for i, t in enumerate(types) if t == NORMAL]
    fractional = [tokens[i] for i in normal if math.isfinite(scores[i]) and scores[i] != round(scores[i])]
    if len(fractional) > len(normal) // 2:
        raise ValueError(
            "this GGUF's SentencePiece ('llama') vocabulary has fractional scores (e.g. "
            f"{fractional[0]!r}: {scores[tokens.index(fractional[0])]}), as a Unigram model's "
            "log-probabilities are: llmtower reads SentencePiece BPE vocabularies only")


def spm_tokenizer(tokens: list[str], scores: list[float], types: list[int],
                  add_space_prefix: bool, unk: str | None,
                  merges: list[tuple[str, str]] | None = None) -> Tokenizer:
    """The fast tokenizer of a SentencePiece BPE vocabulary, without post-processor and added
    tokens (``gguf_tokenizer`` adds those as for every vocabulary). ``merges``: the file's own,
    where it has them (else derived from the scores)."""
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise ValueError(f"the GGUF vocabulary has {len(tokens)} tokens but {len(scores)} scores "
                         f"and {len(types)} token types")
    if sum(t == BYTE for t in types) < 256:
        raise ValueError("this GGUF's SentencePiece ('llama') vocabulary lacks the 256 <0xNN> "
                         "byte tokens of byte fallback: llmtower reads Llama-style vocabularies only")
    if merges is None:
        _check_bpe_scores(tokens, scores, types)
        merges = spm_merges(tokens, scores, types)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("the GGUF vocabulary holds duplicate tokens, which a BPE vocabulary cannot")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges,
                               unk_token=unk, fuse_unk=True, byte_fallback=True))
    # As SentencePiece (and llama.cpp, and Llama 2's own tokenizer.json): every space becomes
    # "▁" and one more goes before each stretch of text, the text's start and after an added
    # token alike, even where it already starts with a space (" Hi" -> "▁▁Hi" -> "▁", "▁Hi").
    # transformers' Metaspace pre-tokenizer (prepend_scheme "first") adds none there.
    replace = normalizers.Replace(" ", SPACE)
    tok.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), replace])
                      if add_space_prefix else replace)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok
