"""The OutputProcessor: what clients see of the engine's token outputs (text, stop strings,
n > 1 fan-out, streaming deltas, logprobs, metrics)."""
from __future__ import annotations

import pytest

from llmtower.core.outputs import EngineCoreOutput, EngineCoreOutputs, RequestMetrics
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.output_processor import OutputProcessor
from llmtower.engine.request_output import RequestOutputKind

CUMULATIVE, DELTA, FINAL_ONLY = (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                 RequestOutputKind.FINAL_ONLY)


def run(processor, scripts, finish_reason="length", metrics=None):
    """Play the engine: each step, every unfinished script sends its next token.
    Returns every RequestOutput and every id the processor asked to abort."""
    outputs, aborted = [], []
    pos = {rid: 0 for rid in scripts}
    while any(rid not in aborted and pos[rid] < len(toks) for rid, toks in scripts.items()):
        step = []
        for rid, toks in scripts.items():
            if rid in aborted or pos[rid] >= len(toks):
                continue
            pos[rid] += 1
            last = pos[rid] == len(toks)
            step.append(EngineCoreOutput(rid, [toks[pos[rid] - 1]],
                                         finish_reason=finish_reason if last else None,
                                         num_cached_tokens=4,
                                         metrics=(metrics or RequestMetrics()) if last else None))
        processed = processor.process_outputs(EngineCoreOutputs(outputs=step))
        outputs += processed.request_outputs
        aborted += processed.reqs_to_abort
    return outputs, aborted


def add(processor, rid, tokenizer, kind, prompt="Q:", **sp):
    ids = tokenizer.encode(prompt)
    return processor.add_request(rid, prompt, ids, SamplingParams(**sp), output_kind=kind)


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_text_matches_full_decode_in_every_output_kind(tokenizer, kind):
    proc = OutputProcessor(tokenizer)
    target = "Hello 😀 你好，世界 and 🚀 café"
    toks = tokenizer.encode(target)
    add(proc, "r", tokenizer, kind)
    outs, aborted = run(proc, {"r": toks})
    assert not aborted and not proc.has_unfinished_requests()
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    completions = [o.outputs[0] for o in outs]
    if kind is FINAL_ONLY:
        assert len(outs) == 1
    if kind is DELTA:
        assert "".join(c.text for c in completions) == target
        assert sum((c.token_ids for c in completions), []) == toks
    else:
        assert completions[-1].text == target and completions[-1].token_ids == toks
        # Each cumulative output extends the previous one.
        for a, b in zip(completions, completions[1:]):
            assert b.text.startswith(a.text)
    assert all("\ufffd" not in c.text for c in completions)
    assert completions[-1].finish_reason == "length" and completions[-1].stop_reason is None


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_stop_string_across_tokens_is_cut_and_aborted(tokenizer, kind):
    proc = OutputProcessor(tokenizer)
    toks = tokenizer.encode("The end is near; stop the engine. More text follows here.")
    # Check the stop string really is split across tokens of this tokenizer.
    pieces = [tokenizer.decode([t]) for t in toks]
    assert "; stop" not in pieces
    add(proc, "r", tokenizer, kind, stop=["; stop"])
    outs, aborted = run(proc, {"r": toks})
    assert aborted == ["r"]
    final = outs[-1].outputs[0]
    text = "".join(o.outputs[0].text for o in outs) if kind is DELTA else final.text
    assert text == "The end is near"
    assert (final.finish_reason, final.stop_reason) == ("stop", "; stop")
    assert outs[-1].finished and not proc.has_unfinished_requests()
    # Nothing after the stop string was consumed and no output ever showed part of it.
    assert len(final.token_ids if kind is not DELTA else
               sum((o.outputs[0].token_ids for o in outs), [])) < len(toks)
    assert all(";" not in o.outputs[0].text for o in outs)
    # Late outputs of the aborted request (engine still stepping) are ignored.
    late = proc.process_outputs(EngineCoreOutputs(outputs=[EngineCoreOutput("r", [5])]))
    assert late.request_outputs == [] and late.reqs_to_abort == []


def test_include_stop_str_in_output_and_several_stop_strings(tokenizer):
    proc = OutputProcessor(tokenizer)
    toks = tokenizer.encode("Numbers 0123456789 and punctuation: (a, b)")
    add(proc, "r", tokenizer, FINAL_ONLY, stop=["punctuation", "789 an"],
        include_stop_str_in_output=True)
    outs, aborted = run(proc, {"r": toks})
    final = outs[-1].outputs[0]
    assert final.text == "Numbers 0123456789 an" and final.stop_reason == "789 an"
    assert aborted == ["r"]


def test_stop_string_at_the_last_token_needs_no_abort(tokenizer):
    proc = OutputProcessor(tokenizer)
    toks = tokenizer.encode("Hello world!")
    add(proc, "r", tokenizer, FINAL_ONLY, stop=["world!"])
    outs, aborted = run(proc, {"r": toks})
    assert aborted == []  # the engine finished it anyway
    assert outs[-1].outputs[0].text == "Hello " and outs[-1].outputs[0].finish_reason == "stop"


def test_stop_strings_wait_for_min_tokens(tokenizer):
    proc = OutputProcessor(tokenizer)
    toks = tokenizer.encode("stop stop stop stop stop stop")
    # The first "stop" is complete at the 4th token, before min_tokens: it does not count.
    assert len(tokenizer.encode("stop")) == 4
    add(proc, "r", tokenizer, FINAL_ONLY, stop=["stop"], min_tokens=5, max_tokens=50)
    outs, _ = run(proc, {"r": toks})
    assert outs[-1].outputs[0].text == "stop "


def test_n_fans_out_with_seeds_and_gathers_in_index_order(tokenizer):
    proc = OutputProcessor(tokenizer)
    reqs = add(proc, "p", tokenizer, CUMULATIVE, n=3, seed=7, temperature=0.8, max_tokens=9)
    assert [r.request_id for r in reqs] == ["p-0", "p-1", "p-2"]
    assert [r.sampling_params.seed for r in reqs] == [7, 8, 9]
    assert all(r.sampling_params.n == 1 and r.sampling_params.max_tokens == 9 for r in reqs)
    texts = {"p-0": "one two", "p-1": "three", "p-2": "four five six seven"}
    outs, _ = run(proc, {rid: tokenizer.encode(t) for rid, t in texts.items()})
    # One RequestOutput per step for the parent, finished only when every child is.
    assert all(o.request_id == "p" for o in outs)
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    final = outs[-1]
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.text for c in final.outputs] == list(texts.values())
    assert final.metrics is not None and final.num_cached_tokens == 4


def test_n_without_seed_gives_children_no_seed(tokenizer):
    proc = OutputProcessor(tokenizer)
    reqs = add(proc, "p", tokenizer, FINAL_ONLY, n=2)
    assert [r.sampling_params.seed for r in reqs] == [None, None]


def test_metrics_are_passed_through(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer, FINAL_ONLY)
    m = RequestMetrics(queue_time=0.5, ttft=0.75, num_preemptions=2, num_cached_tokens=16)
    outs, _ = run(proc, {"r": tokenizer.encode("ok")}, metrics=m)
    assert outs[-1].metrics == m and outs[-1].num_cached_tokens == 4


def test_stop_string_finish_still_reports_metrics(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer, FINAL_ONLY, stop=["world"])
    outs, _ = run(proc, {"r": tokenizer.encode("Hello world and more")})
    m = outs[-1].metrics
    assert m is not None and m.num_generation_tokens >= 1 and m.e2e_latency >= m.ttft


def test_stop_string_metrics_carry_the_engines_queue_time_and_preemptions(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer, FINAL_ONLY, stop=["world"])
    hello, world = tokenizer.encode("Hello world")[:2]
    steps = [EngineCoreOutput("r", [hello], queue_time=0.25),
             EngineCoreOutput("r", [world], num_preemptions=2)]
    outs = [o for s in steps for o in proc.process_outputs(EngineCoreOutputs([s])).request_outputs]
    m = outs[-1].metrics
    assert outs[-1].outputs[0].finish_reason == "stop"
    assert m.queue_time == 0.25 and m.num_preemptions == 2


def test_logprobs_become_per_token_dicts(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer, FINAL_ONLY, logprobs=2)
    a, b = tokenizer.encode("Hello world")[:2]
    steps = [EngineCoreOutput("r", [a], new_logprobs=[(a, -0.5, 1, [(a, -0.5), (b, -1.5)])]),
             EngineCoreOutput("r", [b], new_logprobs=[(b, -2.0, 3, [(a, -0.1), (7, -1.0)])],
                              finish_reason="length")]
    outs = [o for s in steps for o in proc.process_outputs(EngineCoreOutputs([s])).request_outputs]
    c = outs[-1].outputs[0]
    assert c.cumulative_logprob == pytest.approx(-2.5)
    assert len(c.logprobs) == 2
    assert set(c.logprobs[0]) == {a, b} and c.logprobs[0][b].rank == 2
    assert c.logprobs[1][b].logprob == -2.0 and c.logprobs[1][b].rank == 3
    assert c.logprobs[1][b].decoded_token == tokenizer.decode([b])
    assert set(c.logprobs[1]) == {a, b, 7}


def test_no_logprobs_when_not_asked(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer, FINAL_ONLY)
    outs, _ = run(proc, {"r": tokenizer.encode("Hi")})
    assert outs[-1].outputs[0].logprobs is None
    assert outs[-1].outputs[0].cumulative_logprob is None


def test_outputs_of_interleaved_requests_stay_apart(tokenizer):
    proc = OutputProcessor(tokenizer)
    scripts = {f"r{i}": tokenizer.encode(t) for i, t in
               enumerate(["short", "a much longer answer 你好", "mid 😀 x"])}
    for rid in scripts:
        add(proc, rid, tokenizer, FINAL_ONLY)
    outs, _ = run(proc, scripts)
    # Finished in order of length, not of arrival; each has its own text.
    assert [o.request_id for o in outs] == ["r0", "r2", "r1"]
    for o in outs:
        assert o.outputs[0].text == tokenizer.decode(scripts[o.request_id])


def test_client_abort_returns_engine_ids(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "a", tokenizer, DELTA, n=2)
    add(proc, "b", tokenizer, DELTA)
    assert proc.abort_requests(["a", "unknown"]) == ["a-0", "a-1"]
    assert proc.get_num_unfinished_requests() == 1
    processed = proc.process_outputs(EngineCoreOutputs([EngineCoreOutput("a-0", [3])]))
    assert processed.request_outputs == []


def test_duplicate_request_id_is_rejected(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "x", tokenizer, FINAL_ONLY)
    with pytest.raises(ValueError, match="already in use"):
        add(proc, "x", tokenizer, FINAL_ONLY)
    add(proc, "y", tokenizer, FINAL_ONLY, n=2)
    with pytest.raises(ValueError, match="'y-1' is already in use"):
        add(proc, "y-1", tokenizer, FINAL_ONLY)


def test_stream_interval_sends_the_first_token_then_every_n_and_the_end(tokenizer):
    proc = OutputProcessor(tokenizer, stream_interval=3)
    target = "one two three four five six seven eight nine ten eleven"
    toks = tokenizer.encode(target)
    assert len(toks) >= 8
    add(proc, "r", tokenizer, DELTA)
    add(proc, "s", tokenizer, DELTA, n=2)
    outs, held, steps = [], [], 0
    for i, tok in enumerate(toks):
        last = i == len(toks) - 1
        step = [EngineCoreOutput(rid, [tok], finish_reason="length" if last else None)
                for rid in ("r", "s-0", "s-1")]
        processed = proc.process_outputs(EngineCoreOutputs(outputs=step))
        outs += [(ro.request_id, ro, k) for ro, k in zip(processed.request_outputs,
                                                          processed.step_tokens)]
        held += processed.held_tokens
        steps += 1
    r = [ro for rid, ro, _ in outs if rid == "r"]
    # tokens 1, 4, 7, ... and the last: each delta carries what was held back
    assert [len(ro.outputs[0].token_ids) for ro in r[:-1]] == [1] + [3] * (len(r) - 2)
    assert r[-1].finished and "".join(ro.outputs[0].text for ro in r) == target
    assert sum((ro.outputs[0].token_ids for ro in r), []) == toks
    s = [ro for rid, ro, _ in outs if rid == "s"]
    for index in (0, 1):
        assert "".join(c.text for ro in s for c in ro.outputs if c.index == index) == target
    # every token is reported in the step that made it, held or sent
    assert sum(k for _, _, k in outs) + sum(held) == 3 * len(toks)
    assert not proc.has_unfinished_requests()
