"""Incremental detokenization gives the same text as decoding the whole sequence, and never
emits half a character."""
from __future__ import annotations

import random

import pytest

from llmtower.engine.detokenizer import (IncrementalDetokenizer, StreamDetokenizer,
                                         make_decode_fn, make_detokenizer_factory)


@pytest.fixture(params=["python", "decode_stream"], autouse=True)
def kind(request):
    """Every test runs on both detokenizers: the Python window and tokenizers' DecodeStream."""
    return request.param


def new(tokenizer, prompt_ids, skip_special_tokens=True, kind="python"):
    if kind == "python":
        return IncrementalDetokenizer(make_decode_fn(tokenizer), prompt_ids, skip_special_tokens)
    detok = make_detokenizer_factory(tokenizer)(prompt_ids, skip_special_tokens)
    assert isinstance(detok, StreamDetokenizer)
    return detok


def stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True, chunk=1, kind="python"):
    detok = new(tokenizer, prompt_ids, skip_special_tokens, kind)
    pieces = [detok.update(output_ids[i:i + chunk]) for i in range(0, len(output_ids), chunk)]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_streams_match_full_decode(tokenizer, skip, kind):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for trial in range(200):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        chunk = rng.choice([1, 1, 2, 3])
        text = "".join(stream(tokenizer, prompt, output, skip, chunk, kind))
        assert text == tokenizer.decode(output, skip_special_tokens=skip), (trial, prompt, output)


def test_real_text_with_emoji_cjk_and_specials(tokenizer, kind):
    text = "Hi 😀👍🏽 你好，世界 café<|im_end|> and 🚀!"
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("Say:")
    pieces = stream(tokenizer, prompt, ids, skip_special_tokens=False, kind=kind)
    assert "".join(pieces) == text
    # No piece ever carries half a character.
    assert all("\ufffd" not in p for p in pieces)
    skipped = "".join(stream(tokenizer, prompt, ids, skip_special_tokens=True, kind=kind))
    assert skipped == text.replace("<|im_end|>", "")


def test_multibyte_character_is_held_back_until_complete(tokenizer, kind):
    # An emoji split over several byte-level tokens: nothing is emitted until its last byte.
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1, "the tiny tokenizer should split this emoji"
    detok = new(tokenizer, tokenizer.encode("x"), kind=kind)
    assert [detok.update([t]) for t in ids] == [""] * (len(ids) - 1) + ["🎉"]


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tokenizer, kind):
    ids = tokenizer.encode("ok 🎉")[:-1]  # drop the emoji's last byte(s)
    detok = new(tokenizer, [], kind=kind)
    emitted = "".join(detok.update([t]) for t in ids)
    assert "\ufffd" not in emitted
    assert emitted + detok.flush() == tokenizer.decode(ids)


def test_prompt_context_is_not_part_of_the_output(tokenizer, kind):
    prompt = tokenizer.encode("The quick brown fox")
    out = tokenizer.encode(" jumps over")
    assert "".join(stream(tokenizer, prompt, out, kind=kind)) == " jumps over"


def test_raw_tokenizers_tokenizer_is_accepted(tokenizer, kind):
    raw = tokenizer.backend_tokenizer
    ids = tokenizer.encode("你好 world")
    assert "".join(stream(raw, [], ids, kind=kind)) == "你好 world"


def test_sentencepiece_style_leading_space_is_kept(kind):
    # Metaspace decoders drop the leading space of the first token they see; decoding the
    # output behind a few prompt tokens keeps the space between prompt and output.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["hello world, the world says hello"] * 5,
                            trainers.BpeTrainer(vocab_size=60, show_progress=False))
    full = tok.encode("hello world says hello").ids
    prompt, output = full[:1], full[1:]
    assert tok.decode(output).startswith("world")  # the pitfall
    assert "".join(stream(tok, prompt, output, kind=kind)) == " world says hello"
