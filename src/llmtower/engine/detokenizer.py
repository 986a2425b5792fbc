"""Incremental detokenization: turn the tokens of each step into new text without decoding
the whole sequence again.

Decoding token by token is wrong for two reasons: a byte-level BPE token may hold only part
of a multi-byte UTF-8 character (an emoji, a CJK character), and some decoders change a
token's text depending on its neighbours (SentencePiece drops the leading space of the first
token). So, like vLLM, we decode a short window twice, with and without the new tokens, and
emit the difference, holding the new tokens back while their text ends in an incomplete
character ("\\ufffd"). Each step costs two decodes of a few tokens, whatever the length.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# decode(token_ids, skip_special_tokens) -> text
DecodeFn = Callable[[Sequence[int], bool], str]

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded in front of the first output tokens, so that the output starts as it
# would inside the full sequence (e.g. keeps SentencePiece's leading space).
PROMPT_CONTEXT_TOKENS = 5


def make_decode_fn(tokenizer: Any) -> DecodeFn:
    """A plain decode function for a transformers tokenizer or a ``tokenizers.Tokenizer``.

    The Rust tokenizer is called directly when there is one: it is the same decode without
    transformers' Python layers, and without ``clean_up_tokenization_spaces``, which rewrites
    text depending on its neighbours (" ." -> ".") and so cannot be applied piece by piece.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and type(tokenizer).__module__.startswith("tokenizers"):
        backend = tokenizer
    if backend is not None:
        def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return decode

    def decode_slow(ids: Sequence[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)
    return decode_slow


class IncrementalDetokenizer:
    """Owns one sequence's token ids (a few prompt tokens for context, then the output) and
    the two offsets that say which of them have already been turned into text.

    ``ids[prefix_offset:read_offset]`` were emitted by the previous call and are decoded again
    as context; ``ids[read_offset:]`` are not emitted yet.
    """

    def __init__(self, decode: DecodeFn, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt that ends inside a character would be completed by the first output
        # tokens, changing the context's own text: decode the output without context then.
        if context and decode(context, skip_special_tokens).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ("" while a character is incomplete)."""
        self._ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text of the tokens still held back (at the end of the sequence): an incomplete
        character is then emitted as "\\ufffd", exactly as decoding the whole sequence does."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset], self._skip)
        new_text = self._decode(self._ids[self.prefix_offset:], self._skip)
        if not final:
            if new_text.endswith(REPLACEMENT_CHAR):
                return ""  # part of a character: wait for the rest
            if new_text == prefix_text:
                # Tokens without text (skipped special tokens): consume them, keep the window.
                self.read_offset = len(self._ids)
                return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        return new_text[len(prefix_text):]
