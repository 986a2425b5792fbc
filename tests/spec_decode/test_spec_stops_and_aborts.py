"""A stop token, EOS, max_tokens or a stop string that falls inside a step's accepted draft
tokens ends the request at exactly that token, as without speculation; aborting requests
whose drafts are in flight frees every KV block and runner row."""
from __future__ import annotations

import pytest

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from spec_helpers import (ContinuationProposer, add_requests, assert_nothing_held, copy_prompts,
                          make_engine, run_all, spec_json)

SPEC = spec_json("ngram", 5, prompt_lookup_min=1)
PROMPTS = copy_prompts(3, 0)


def _chunks(core, prompts, max_tokens, **sp_kw):
    """Every request's outputs step by step (list of token lists)."""
    add_requests(core, prompts, max_tokens, **sp_kw)
    chunks: dict[str, list[list[int]]] = {}
    finish: dict[str, tuple] = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            chunks.setdefault(o.request_id, []).append(o.new_token_ids)
            if o.finished:
                finish[o.request_id] = (o.finish_reason, o.stop_reason)
    return chunks, finish


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Outputs without speculation, and the multi-token steps of a speculative run whose
    drafts are the known continuation (all accepted, K + 1 tokens a step)."""
    plain = run_all(_engine(tiny_llama_dir, None, PROMPTS))
    spec_chunks, _ = _chunks(_oracle_engine(tiny_llama_dir, plain), PROMPTS, 40)
    return plain, spec_chunks


def _oracle_engine(model_dir, plain):
    core = make_engine(model_dir, SPEC)
    core.executor.runner.spec_decode.proposer = ContinuationProposer(
        PROMPTS, [plain[str(i)] for i in range(len(PROMPTS))])
    return core


def _engine(model_dir, spec, prompts, max_tokens=40, **sp_kw):
    core = make_engine(model_dir, spec)
    add_requests(core, prompts, max_tokens, **sp_kw)
    return core


def _token_inside_a_draft(plain, spec_chunks, ok=None):
    """(request, token, its output index): a token first emitted in the middle of a step that
    emitted several, and not earlier in that request's output."""
    for rid, chunks in spec_chunks.items():
        pos = 0
        for c in chunks:
            for j in range(len(c) - 1):  # not the last token of its step
                tok = c[j]
                if tok not in plain[rid][:pos + j] and (ok is None or ok(rid, tok, pos + j)):
                    return rid, tok, pos + j
            pos += len(c)
    raise AssertionError("no step emitted several tokens: the test would be vacuous")


@pytest.mark.parametrize("how", ["stop_token_ids", "eos"])
def test_stop_token_inside_accepted_draft(tiny_llama_dir, reference, how):
    plain, spec_chunks = reference
    rid, tok, index = _token_inside_a_draft(plain, spec_chunks)
    prompt = PROMPTS[int(rid)]
    core = _oracle_engine(tiny_llama_dir, plain)
    if how == "eos":
        sp = SamplingParams(temperature=0.0, max_tokens=40)
        core.add_request(EngineCoreRequest("r", prompt, sp, eos_token_id=tok))
    else:
        sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[tok])
        core.add_request(EngineCoreRequest("r", prompt, sp, eos_token_id=2))
    chunks, finish = _chunks(core, [], 0)
    got = [t for c in chunks["r"] for t in c]
    assert got == plain[rid][:index + 1]
    assert finish["r"] == ("stop", None if how == "eos" else tok)
    assert core.scheduler.spec_stats.num_accepted_tokens > 0
    assert_nothing_held(core)


def test_max_tokens_inside_accepted_draft(tiny_llama_dir, reference):
    plain, spec_chunks = reference
    rid, _, index = _token_inside_a_draft(plain, spec_chunks)
    core = _oracle_engine(tiny_llama_dir, plain)
    chunks, finish = _chunks(core, [PROMPTS[int(rid)]], index + 1)
    assert [t for c in chunks["0"] for t in c] == plain[rid][:index + 1]
    assert finish["0"] == ("length", None)
    assert_nothing_held(core)


def test_stop_string_inside_accepted_draft(tiny_llama_dir, tiny_tokenizer_dir, reference):
    from llmtower.engine.llm import LLM
    from llmtower.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    plain, spec_chunks = reference

    def first_completed_here(rid, tok, index):
        stop = tokenizer.decode([tok])
        before = tokenizer.decode(plain[rid][:index])
        return (stop.strip() and "\ufffd" not in stop and stop not in before
                and stop in tokenizer.decode(plain[rid][:index + 1]))

    rid, tok, index = _token_inside_a_draft(plain, spec_chunks, first_completed_here)
    stop = tokenizer.decode([tok])
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    outs = {}
    for name, core in (("plain", make_engine(tiny_llama_dir, None)),
                       ("spec", _oracle_engine(tiny_llama_dir, plain))):
        llm = LLM.from_engine_core(core, tokenizer, [2])
        (o,) = llm.generate([PROMPTS[int(rid)]], sp, use_tqdm=False)
        outs[name] = o.outputs[0]
        assert_nothing_held(llm.engine_core)
    assert outs["spec"].text == outs["plain"].text
    assert outs["spec"].token_ids == outs["plain"].token_ids
    assert (outs["spec"].finish_reason, outs["spec"].stop_reason) == ("stop", stop)
    assert len(outs["spec"].token_ids) == index + 1


def test_abort_with_drafts_in_flight_frees_everything(tiny_llama_dir):
    core = make_engine(tiny_llama_dir, SPEC)
    add_requests(core, copy_prompts(6, 3), 60)
    aborted = False
    for _ in range(200):
        core.step()
        sched = core.scheduler
        in_flight = [r.request_id for r in sched.running if r.spec_token_ids]
        if len(in_flight) >= 2:
            core.abort_requests(in_flight[:2])
            aborted = True
            break
    assert aborted, "no request ever had drafts: the test would be vacuous"
    gone = in_flight[:2]
    assert all(rid not in core.scheduler.kv.req_to_blocks for rid in gone)
    run_all(core)  # the others finish; the steps tell the runner who is gone
    assert_nothing_held(core)
    runner = core.executor.runner
    assert not set(gone) & set(runner.batch.req_id_to_row)
    assert not set(gone) & set(runner.spec_decode.adaptive._states)
