"""Incremental detokenization: turn the tokens of each step into new text without decoding
the whole sequence again.

Decoding token by token is wrong for two reasons: a byte-level BPE token may hold only part
of a multi-byte UTF-8 character (an emoji, a CJK character), and some decoders change a
token's text depending on its neighbours (SentencePiece drops the leading space of the first
token). So, like vLLM, we decode a short window twice, with and without the new tokens, and
emit the difference, holding the new tokens back while their text ends in an incomplete
character ("\\ufffd"). Each step costs two decodes of a few tokens, whatever the length.

Where the tokenizer is a Rust ``tokenizers`` one and the library has ``DecodeStream`` (0.21+),
``StreamDetokenizer`` does the same inside Rust in one call per step (a third of the CPU per
token of the Python window, which matters in the API process at saturation).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

# decode(token_ids, skip_special_tokens) -> text
DecodeFn = Callable[[Sequence[int], bool], str]


class Detokenizer(Protocol):
    """One sequence's incremental detokenizer."""

    def update(self, new_token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


# make_detokenizer(prompt_token_ids, skip_special_tokens) -> a new sequence's detokenizer
DetokenizerFactory = Callable[[Sequence[int], bool], Detokenizer]

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
    backend = _rust_tokenizer(tokenizer)
    if backend is not None:
        def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
            return backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return decode

    def decode_slow(ids: Sequence[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)
    return decode_slow


def _rust_tokenizer(tokenizer: Any) -> Any:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and type(tokenizer).__module__.startswith("tokenizers"):
        backend = tokenizer
    return backend


def make_detokenizer_factory(tokenizer: Any, decode: DecodeFn | None = None
                             ) -> DetokenizerFactory:
    """New sequences' detokenizers for ``tokenizer``: ``StreamDetokenizer`` where it has a Rust
    tokenizer and ``tokenizers`` has DecodeStream, else the Python ``IncrementalDetokenizer``."""
    decode = decode or make_decode_fn(tokenizer)
    backend = _rust_tokenizer(tokenizer)
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401
    except ImportError:
        backend = None
    if backend is None:
        return lambda prompt_ids, skip: IncrementalDetokenizer(decode, prompt_ids, skip)
    return lambda prompt_ids, skip: StreamDetokenizer(backend, decode, prompt_ids, skip)


def _prompt_context(decode: DecodeFn, prompt_token_ids: Sequence[int],
                    skip_special_tokens: bool) -> list[int]:
    """The last few prompt tokens to decode the output behind; none where the prompt ends
    inside a character (the first output tokens would complete it, changing its text)."""
    context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
    if context and decode(context, skip_special_tokens).endswith(REPLACEMENT_CHAR):
        return []
    return context


class StreamDetokenizer:
    """Owns one sequence's ``tokenizers.DecodeStream`` (primed with a few prompt tokens) and
    the ids it holds back, unemitted, while their text ends inside a character."""

    def __init__(self, backend: Any, decode: DecodeFn, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._decode = decode
        self._skip = skip_special_tokens
        self._stream = DecodeStream(_prompt_context(decode, prompt_token_ids,
                                                    skip_special_tokens),
                                    skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ("" while a character is incomplete)."""
        if not new_token_ids:
            return ""
        ids = new_token_ids[0] if len(new_token_ids) == 1 else list(new_token_ids)
        text = self._stream.step(self._backend, ids)
        if text is None:  # an incomplete character, or tokens without text
            self._held.extend(new_token_ids)
            return ""
        self._held.clear()  # a chunk covers every token fed so far
        return text

    def flush(self) -> str:
        """The text of the tokens still held back: an incomplete character as "\\ufffd",
        exactly as decoding the whole sequence does."""
        if not self._held:
            return ""
        text = self._decode(self._held, self._skip)
        self._held = []
        return text


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
        context = _prompt_context(decode, prompt_token_ids, skip_special_tokens)
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
