"""GGUF files with a SentencePiece (``tokenizer.ggml.model == "llama"``) vocabulary, written the
way llama.cpp's converter writes one from a tokenizer.json (tokens, placeholder scores, token
types; no merges): llmtower's tokenizer rebuilt from the file encodes and decodes like the
Hugging Face original (transformers' LlamaTokenizerFast over a SentencePiece BPE vocabulary
trained in-process), and the model served from the GGUF gives transformers' greedy tokens."""
from __future__ import annotations

import gguf
import pytest

from llmtower.models.gguf_loader import open_gguf
from llmtower.models.gguf_spm_tokenizer import BYTE, CONTROL, NORMAL, spm_merges
from llmtower.models.gguf_tokenizer import gguf_tokenizer
from llmtower.models.loader import load_tokenizer, resolve_model_path
from tests.executor.exactness_helpers import add_greedy, hf_greedy, make_engine, run_all
from tests.fixtures.spm_vocab import (SPM_VOCAB_SIZE, llama_hf_vocab, sentencepiece_encode,
                                      sentencepiece_scores, write_llama_hf_vocab,
                                      write_sentencepiece_vocab, write_spm_tokenizer)
from tests.fixtures.tiny_gguf import write_gguf_from_hf_dir
from tests.fixtures.tiny_models import make_tiny_model_dir

TEXTS = [
    "What is the capital of France? The capital of France is Paris.",
    " leading space", "  two leading spaces", "trailing spaces  ", "", " ", "\n",
    "spaces\tand\nnewlines\n\n  indented", "def forward(self, x):\n    return x + 1\n",
    "digits 0123456789 and 2024-05-17",
    "naïve café résumé",  # letters the corpus lacks: byte fallback
    "😀 日本語 ß∑ \x00\x7f",  # no piece at all: every byte a <0xNN> token
    "<s>hello</s> world",  # the special tokens, matched whole
    "hi<|eot|> <think>x</think>",  # added tokens past the base vocabulary
    "a<unk>b",
    "The scheduler decides which requests run, how many tokens each gets, and who waits.",
]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """(the Hugging Face original: a tiny Llama with the SentencePiece tokenizer, its GGUF, the
    directory llmtower serves the GGUF from)."""
    tok_dir = write_spm_tokenizer(tmp_path_factory.mktemp("spm_tokenizer"))
    hf_dir = make_tiny_model_dir(tmp_path_factory, "llama", tokenizer_dir=tok_dir,
                                 vocab_size=SPM_VOCAB_SIZE, initializer_range=0.2, seed=5)
    path = write_gguf_from_hf_dir(hf_dir, tmp_path_factory.mktemp("g") / "spm.gguf",
                                  vocab=write_llama_hf_vocab)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        yield hf_dir, path, resolve_model_path(str(path))


def test_encodes_and_decodes_like_the_original(spm_model):
    hf_dir, _, served = spm_model
    ours, theirs = load_tokenizer(served), load_tokenizer(hf_dir)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert "<0xF0>" in theirs.convert_ids_to_tokens(theirs.encode("😀"))  # the texts reach byte fallback
    assert ours.decode(theirs.encode(TEXTS[0])[1:]) == TEXTS[0]
    assert (ours.bos_token_id, ours.eos_token_id, ours.unk_token_id) == (1, 2, 0)
    assert ours.all_special_tokens == theirs.all_special_tokens
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)


def test_greedy_tokens_follow_transformers(spm_model):
    hf_dir, path, _ = spm_model
    tok = load_tokenizer(hf_dir)
    prompts = [tok.encode(t) for t in TEXTS[:1] + TEXTS[8:10] + TEXTS[11:13]]
    core = make_engine(path)
    add_greedy(core, prompts, 6)
    out = run_all(core)
    assert [out[str(i)] for i in range(len(prompts))] == hf_greedy(hf_dir, prompts, 6)


def test_sentencepiece_scores_tokenize_as_sentencepiece(spm_model, tmp_path):
    """The vocabulary as ``_set_vocab_sentencepiece`` writes a tokenizer.model's (its own
    scores, one early piece scored to merge last as Llama 2's "▁▁" is): encoded as
    SentencePiece's BPE does (leading and repeated spaces, byte fallback included)."""
    hf_dir = spm_model[0]
    path = write_gguf_from_hf_dir(hf_dir, tmp_path / "sp.gguf", vocab=write_sentencepiece_vocab)
    tok, _ = gguf_tokenizer(open_gguf(path))
    tokens, types = llama_hf_vocab(hf_dir)
    scores = sentencepiece_scores(tokens, types)
    for text in [t for t in TEXTS if "<" not in t]:
        want = sentencepiece_encode(tokens, scores, types, text)
        assert tok.encode(text, add_special_tokens=False).ids == want, text


def test_merges_follow_scores_then_vocabulary_order():
    tokens = ["<s>", "<0x41>", "a", "b", "c", "ab", "bc", "abc"]
    types = [CONTROL, BYTE, NORMAL, NORMAL, NORMAL, NORMAL, NORMAL, NORMAL]
    # Equal scores (the converter's placeholders): the order the pieces were created in.
    assert spm_merges(tokens, [-1000.0] * 8, types) == [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]
    # SentencePiece's own scores rank first: "bc" before "ab" here.
    scores = [0.0, 0.0, 0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    assert spm_merges(tokens, scores, types)[:2] == [("b", "c"), ("a", "b")]


def _vocab_gguf(tmp_path, kind: str, scores: list[float] | None = None, byte_tokens: bool = True):
    tokens = ["<unk>", "<s>", "</s>"] + ([f"<0x{b:02X}>" for b in range(256)] if byte_tokens else [])
    tokens += ["▁", "a", "b", "▁a", "ab"]
    types = [2, 3, 3] + [6] * (len(tokens) - 8) + [1] * 5
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores or [0.0] * len(tokens))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return open_gguf(path), len(tokens)


def test_a_tiny_vocab_from_its_types_alone(tmp_path):
    reader, _ = _vocab_gguf(tmp_path, "llama")
    tok, config = gguf_tokenizer(reader)
    assert config["add_bos_token"] is True and config["unk_token"] == "<unk>"  # llama.cpp's default
    # "▁a" (created before "ab") merges first; "z" is no piece: its byte, <0x7A>.
    enc = tok.encode("a ab z")
    assert enc.tokens == ["<s>", "▁a", "▁a", "b", "▁", "<0x7A>"]
    assert tok.decode(enc.ids) == "a ab z"


@pytest.mark.parametrize("kind, kw, match", [
    ("t5", {}, "tokenizer model 't5' is not supported"),
    ("bert", {}, "tokenizer model 'bert' is not supported"),
    ("llama", {"scores": [-3.25] * 264}, "fractional scores.*Unigram"),
    ("llama", {"byte_tokens": False}, "lacks the 256 <0xNN> byte tokens"),
])
def test_unsupported_vocabularies_are_refused_by_name(tmp_path, kind, kw, match):
    reader, _ = _vocab_gguf(tmp_path, kind, **kw)
    with pytest.raises(ValueError, match=match):
        gguf_tokenizer(reader)
