"""The offline LLM API over an in-process EngineCore driven by the fake executor (no model):
ordering, stop strings, errors at admission, chat templates, streaming."""
from __future__ import annotations

import pytest

from engine_helpers import make_fake_engine_core
from llmtower.core.errors import AdmissionError
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.llm import LLM


def greedy(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def assert_idle(llm):
    assert not llm.engine_core.has_unfinished_requests()
    assert not llm.output_processor.has_unfinished_requests()


def test_outputs_come_back_in_input_order(fake_llm, tokenizer):
    prompts = ["The quick brown fox", "Hello", "你好，世界", "Stop here."]
    # The first prompt gets the most tokens, so it finishes last.
    params = [greedy(max_tokens=m) for m in (20, 3, 9, 1)]
    outs = fake_llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [20, 3, 9, 1]
    for o, p in zip(outs, prompts):
        assert o.finished and o.prompt_token_ids == tokenizer.encode(p)
        c = o.outputs[0]
        assert c.text == tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason == "length"
        assert o.metrics is not None and o.metrics.num_prompt_tokens == len(o.prompt_token_ids)
        assert o.metrics.num_generation_tokens == len(c.token_ids)
    assert_idle(fake_llm)


def test_token_id_prompts_and_a_single_string(fake_llm, tokenizer):
    ids = tokenizer.encode("Hello world")
    (by_ids,) = fake_llm.generate([ids], greedy(), use_tqdm=False)
    (by_text,) = fake_llm.generate("Hello world", greedy(), use_tqdm=False)
    assert by_ids.prompt is None and by_text.prompt == "Hello world"
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids


def test_stop_string_ends_the_request_and_frees_the_engine(fake_llm, tokenizer):
    (free,) = fake_llm.generate("The quick brown fox", greedy(max_tokens=40), use_tqdm=False)
    text = free.outputs[0].text
    # A stop string made of the end of one token's text and the start of the next.
    pieces = [tokenizer.decode([t]) for t in free.outputs[0].token_ids]
    k = next(i for i in range(3, len(pieces) - 1) if pieces[i].strip() and pieces[i + 1].strip()
             and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[k][-1] + pieces[k + 1][:1]
    cut = text.index(stop)
    (out,) = fake_llm.generate("The quick brown fox", greedy(max_tokens=40, stop=[stop]),
                               use_tqdm=False)
    c = out.outputs[0]
    assert c.text == text[:cut] and stop not in c.text
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert len(c.token_ids) < 40
    assert_idle(fake_llm)
    (kept,) = fake_llm.generate("The quick brown fox",
                                greedy(max_tokens=40, stop=[stop], include_stop_str_in_output=True),
                                use_tqdm=False)
    assert kept.outputs[0].text == text[:cut + len(stop)]


def test_n_gives_n_outputs(fake_llm):
    (out,) = fake_llm.generate("Hello", greedy(n=2, seed=3), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert out.request_id and out.finished


def test_prompt_too_long_is_a_clear_error_and_nothing_stays_queued(tokenizer):
    llm = LLM.from_engine_core(make_fake_engine_core(len(tokenizer), max_model_len=32), tokenizer)
    long_prompt = list(range(1, 41))
    with pytest.raises(AdmissionError, match=r"prompt 1 has 40 tokens.*\(max_model_len\) is 32"):
        llm.generate(["ok", long_prompt], greedy(), use_tqdm=False)
    assert_idle(llm)
    # The LLM is still usable afterwards.
    assert len(llm.generate("ok", greedy(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_priority_without_priority_policy_is_rejected(fake_llm):
    with pytest.raises(AdmissionError, match="--policy priority"):
        fake_llm.generate(["a", "b"], greedy(), use_tqdm=False, priority=[0, 1])
    assert_idle(fake_llm)


def test_priority_with_priority_policy(tokenizer):
    llm = LLM.from_engine_core(
        make_fake_engine_core(len(tokenizer), policy="priority", max_num_seqs=1), tokenizer)
    outs = llm.generate(["a", "b", "c"], greedy(max_tokens=2), use_tqdm=False,
                        priority=[2, 0, 1])
    assert [o.prompt for o in outs] == ["a", "b", "c"]
    # Run one at a time: the lowest priority value was scheduled first.
    ttfts = [o.metrics.ttft for o in outs]
    assert ttfts[1] <= ttfts[2] <= ttfts[0]


@pytest.mark.parametrize("bad, message", [
    ([1, 2, 3], "wrap one tokenized prompt"),
    ([], "non-empty list"),
    ([[1, 99999]], "outside the vocabulary"),
    ([""], "prompt 0 is empty"),
    ([3.5], "must be a string or a list of token ids"),
])
def test_bad_prompts_are_clear_errors(fake_llm, bad, message):
    with pytest.raises(ValueError, match=message):
        fake_llm.generate(bad, use_tqdm=False)
    assert_idle(fake_llm)


def test_bad_sampling_params_are_clear_errors(fake_llm):
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        fake_llm.generate(["a", "b", "c"], [greedy(), greedy()], use_tqdm=False)
    with pytest.raises(ValueError, match="must be SamplingParams"):
        fake_llm.generate(["a"], {"max_tokens": 3}, use_tqdm=False)


def test_unknown_engine_argument_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown engine argument.*max_num_seq\\b"):
        LLM(model="x", max_num_seq=4)


def test_chat_applies_the_chat_template(fake_llm, tokenizer):
    conv = [{"role": "user", "content": "Hello 😀"}]
    outs = fake_llm.chat([conv, conv + [{"role": "assistant", "content": "Hi"},
                                        {"role": "user", "content": "again"}]],
                         greedy(max_tokens=3), use_tqdm=False)
    assert len(outs) == 2
    rendered = "<|im_start|>user\nHello 😀<|im_end|>\n<|im_start|>assistant\n"
    assert outs[0].prompt == rendered
    assert outs[0].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert outs[1].prompt.count("<|im_start|>") == 4
    (single,) = fake_llm.chat(conv, greedy(max_tokens=3), use_tqdm=False)
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chat_errors(fake_llm, tokenizer):
    with pytest.raises(ValueError, match="list of messages like"):
        fake_llm.chat([{"content": "no role"}], use_tqdm=False)
    import copy
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    llm = LLM.from_engine_core(make_fake_engine_core(len(plain)), plain)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


def test_stream_yields_deltas_that_add_up(fake_llm):
    (full,) = fake_llm.generate("Hello", greedy(max_tokens=15), use_tqdm=False)
    deltas = list(fake_llm.stream("Hello", greedy(max_tokens=15)))
    assert len(deltas) > 1 and deltas[-1].finished
    assert "".join(d.outputs[0].text for d in deltas) == full.outputs[0].text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == full.outputs[0].token_ids
    assert_idle(fake_llm)


def test_closing_a_stream_early_aborts_it(fake_llm):
    it = fake_llm.stream("Hello", greedy(max_tokens=30))
    next(it)
    with pytest.raises(RuntimeError, match="still running a stream"):
        fake_llm.generate("x", use_tqdm=False)
    it.close()
    assert_idle(fake_llm)
    assert fake_llm.generate("x", greedy(max_tokens=2), use_tqdm=False)[0].finished


def test_extra_eos_ids_stop_generation(tokenizer):
    # Find the token the fake model produces third and declare it an extra EOS id.
    base = LLM.from_engine_core(make_fake_engine_core(len(tokenizer)), tokenizer)
    toks = base.generate("Hello", greedy(max_tokens=10), use_tqdm=False)[0].outputs[0].token_ids
    extra = toks[2]
    llm = LLM.from_engine_core(make_fake_engine_core(len(tokenizer)), tokenizer,
                               eos_token_ids=[tokenizer.eos_token_id, extra])
    sp = SamplingParams(max_tokens=10, temperature=0.0)
    c = llm.generate("Hello", sp, use_tqdm=False)[0].outputs[0]
    assert c.token_ids[-1] == extra and len(c.token_ids) == toks.index(extra) + 1
    assert c.finish_reason == "stop"


def test_a_stream_never_started_leaves_nothing_behind(fake_llm):
    it = fake_llm.stream("Hello", greedy())
    del it
    assert_idle(fake_llm)
    assert fake_llm.generate("x", greedy(max_tokens=2), use_tqdm=False)[0].finished


def test_stream_admission_errors_surface_at_first_next(tokenizer):
    llm = LLM.from_engine_core(make_fake_engine_core(len(tokenizer), max_model_len=16), tokenizer)
    it = llm.stream(list(range(3, 40)), greedy())
    with pytest.raises(AdmissionError, match="max_model_len"):
        next(it)
    assert_idle(llm)
