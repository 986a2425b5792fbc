"""The InputProcessor shared by the offline LLM and the server: chat templates, generation-config
defaults, the one length rule, truncation and logit_bias checks."""
from __future__ import annotations

import json
import re

import pytest

from llmtower.core.errors import AdmissionError
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.input_processor import (InputProcessor, load_generation_defaults,
                                             resolve_chat_template)

TEMPLATE = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}"


def test_chat_template_from_a_file_or_inline_and_a_clear_error_otherwise(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert resolve_chat_template(str(f)) == TEMPLATE
    assert resolve_chat_template(TEMPLATE) == TEMPLATE
    assert resolve_chat_template(None) is None
    with pytest.raises(FileNotFoundError, match="neither a file nor a Jinja template"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))


def test_operator_template_replaces_the_tokenizers(tokenizer):
    ip = InputProcessor(tokenizer, max_model_len=64, chat_template=TEMPLATE)
    text, ids = ip.render_chat([{"role": "user", "content": "hi"}])
    assert text == "[user:hi]" and ids == ip.encode("[user:hi]", add_special_tokens=False)
    # A template given for one call wins over the operator's.
    text, _ = ip.render_chat([{"role": "user", "content": "hi"}], chat_template="{{ 'x' }}")
    assert text == "x"


def test_a_model_without_template_says_how_to_give_one(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    ip = InputProcessor(tokenizer, max_model_len=64)
    with pytest.raises(ValueError, match="--chat-template"):
        ip.render_chat([{"role": "user", "content": "hi"}])


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 99,
         "repetition_penalty": 1.1, "eos_token_id": 2}))
    want = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 99,
            "repetition_penalty": 1.1}
    assert load_generation_defaults("auto", tmp_path) == want
    assert load_generation_defaults(str(tmp_path), None) == want
    assert load_generation_defaults("vllm", tmp_path) == {}
    assert load_generation_defaults("auto", tmp_path / "nothing") == {}
    with pytest.raises(FileNotFoundError, match="generation_config.json"):
        load_generation_defaults(str(tmp_path / "nothing"), None)
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 7}))
    with pytest.raises(ValueError, match="top_p"):  # a bad file fails at start-up
        load_generation_defaults("auto", tmp_path)


def test_one_length_rule_reject_only_the_prompt(tokenizer):
    ip = InputProcessor(tokenizer, max_model_len=32)
    with pytest.raises(AdmissionError, match=r"32 tokens.*max_model_len\) is 32"):
        ip.process_prompt(list(range(5, 37)), SamplingParams())
    # A prompt with room for one token passes, whatever max_tokens asks.
    assert ip.process_prompt(list(range(5, 36)), SamplingParams(max_tokens=1000)) \
        == list(range(5, 36))
    with pytest.raises(ValueError, match="empty"):
        ip.process_prompt([], SamplingParams())


def test_truncate_prompt_tokens_keeps_the_end(tokenizer):
    ip = InputProcessor(tokenizer, max_model_len=32)
    ids = list(range(5, 105))
    assert ip.process_prompt(ids, SamplingParams(truncate_prompt_tokens=10)) == ids[-10:]


def test_logit_bias_outside_the_vocabulary_is_refused(tokenizer):
    ip = InputProcessor(tokenizer, max_model_len=32, vocab_size=100)
    with pytest.raises(ValueError, match=r"logit_bias=.*\[100\]"):
        ip.process_prompt([5], SamplingParams(logit_bias={100: 1.0}))


def test_offline_llm_applies_truncation_and_clamps_max_tokens(tokenizer):
    from engine_helpers import make_fake_engine_core

    from llmtower.engine.llm import LLM
    llm = LLM.from_engine_core(make_fake_engine_core(len(tokenizer), max_model_len=32), tokenizer)
    (out,) = llm.generate([list(range(5, 105))], SamplingParams(
        truncate_prompt_tokens=20, max_tokens=100, ignore_eos=True, temperature=0),
        use_tqdm=False)
    assert len(out.prompt_token_ids) == 20
    assert len(out.outputs[0].token_ids) == 12 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids_outside_the_vocabulary_are_refused_offline_too(tokenizer):
    """The server refuses them with a 400; the offline LLM takes the same check here."""
    ip = InputProcessor(tokenizer, max_model_len=32, vocab_size=100)
    with pytest.raises(ValueError, match=r"stop_token_ids=.*\[100, 250\].*vocabulary of 100"):
        ip.process_prompt([5], SamplingParams(stop_token_ids=[3, 100, 250]))
    assert ip.process_prompt([5], SamplingParams(stop_token_ids=[99])) == [5]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_prompts_encode_to_the_ids_transformers_gives(tokenizer, add_special_tokens):
    """encode() goes to the tokenizers backend directly (no BatchEncoding around it): the ids
    must be transformers' own, special-token text and odd spacing included."""
    ip = InputProcessor(tokenizer, max_model_len=64)
    assert ip._backend is not None  # the fast path is the one under test
    special = tokenizer.all_special_tokens[0] if tokenizer.all_special_tokens else ""
    for text in ["hello world", "  two  spaces\n\nand lines", f"{special} after a special",
                 "ünïcödé and emoji 🙂", ""]:
        assert ip.encode(text, add_special_tokens) == tokenizer.encode(
            text, add_special_tokens=add_special_tokens), text


def test_a_backend_with_truncation_set_encodes_through_transformers(tokenizer):
    """transformers clears the backend's truncation for a plain encode; the fast path must not
    apply it behind its back."""
    ip = InputProcessor(tokenizer, max_model_len=64)
    text = "one two three four five six seven eight nine ten " * 3
    full = tokenizer.encode(text)
    tokenizer.backend_tokenizer.enable_truncation(max_length=4)
    try:
        assert ip.encode(text) == full and len(full) > 4
    finally:
        tokenizer.backend_tokenizer.no_truncation()


def test_token_ids_outside_the_vocabulary_are_named(tokenizer):
    ip = InputProcessor(tokenizer, max_model_len=64, vocab_size=100)
    ip.check_prompt([0, 5, 99])  # in range: nothing to say
    for bad, shown in (([1, 100, 2], "[100]"), ([-1, 3], "[-1]"), ([1, 2.5, 3], "[2.5]"),
                       ([1, "7"], "['7']"), ([1, 2**70], f"[{2**70}]")):
        with pytest.raises(ValueError, match=re.escape(shown)):
            ip.check_prompt(bad)
