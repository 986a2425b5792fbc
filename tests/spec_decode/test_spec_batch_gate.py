"""The batch gate: a lock-step batch whose drafts do not pay stops drafting after a bounded
number of steps and probes again later; a copy-heavy batch, or a copy-heavy request in a batch
of others, keeps drafting; one stream and batches with requests waiting are not gated."""
from __future__ import annotations

import random

import numpy as np

from llmtower.spec_decode.batch_gate import MAX_WAIT, MIN_OBSERVED, MIN_WAIT, BatchDraftGate
from llmtower.spec_decode.suffix_proposer import SuffixProposer
from spec_helpers import add_requests, copy_prompts, make_engine, run_all, spec_json

FIXED_ROWS = 22.0  # SmolLM2 float32 on one core: a step's fixed cost is ~22 rows' worth
HOST_ROWS = 0.5


def _run(gate: BatchDraftGate, outcome, steps: int, req_ids: list[str],
         num_waiting: int = 0) -> list[bool]:
    """Drive the gate as the runner does: each step the requests allowed to draft are observed
    with ``outcome(rid) -> (drafted, accepted)``; returns whether each step's batch drafted."""
    allowed = {rid: True for rid in req_ids}
    history = []
    for _ in range(steps):
        for rid in req_ids:
            if allowed[rid]:
                gate.observe(rid, *outcome(rid))
        is_open = gate.step(req_ids, FIXED_ROWS, HOST_ROWS, num_waiting)
        for rid in req_ids:
            allowed[rid] = is_open or gate.solo(rid)
        history.append(is_open)
    return history


def test_zero_acceptance_batch_stops_drafting_then_probes_with_back_off():
    gate = BatchDraftGate()
    reqs = [f"r{i}" for i in range(8)]
    hist = _run(gate, lambda _r: (2, 0), 400, reqs)
    first_closed = hist.index(False)
    assert first_closed <= MIN_OBSERVED  # judged as soon as the requests have a few steps
    # closed for MIN_WAIT steps, then a probe that reopens the gate
    closed_run = hist[first_closed:].index(True)
    assert closed_run == MIN_WAIT
    # each failed probe doubles the wait, up to MAX_WAIT: drafting stays rare
    waits, run = [], 0
    for h in hist[first_closed:]:
        if h:
            if run:
                waits.append(run)
            run = 0
        else:
            run += 1
    assert waits[:4] == [MIN_WAIT, 2 * MIN_WAIT, 4 * MIN_WAIT, 8 * MIN_WAIT]
    assert max(waits) <= MAX_WAIT
    assert sum(hist) < 0.1 * len(hist)
    assert not any(gate.solo(r) for r in reqs)


def test_a_probe_that_finds_copying_keeps_the_gate_open():
    gate = BatchDraftGate()
    reqs = [f"r{i}" for i in range(8)]
    copying = [False]
    hist = _run(gate, lambda _r: (8, 6) if copying[0] else (2, 0), 30, reqs)
    assert not hist[-1]
    copying[0] = True  # the batch reaches a passage to copy
    hist = _run(gate, lambda _r: (8, 6), 200, reqs)
    assert hist[-100:] == [True] * 100
    assert gate.backoff == MIN_WAIT  # the back-off starts over


def test_copy_heavy_batch_keeps_drafting():
    gate = BatchDraftGate()
    reqs = [f"r{i}" for i in range(8)]
    rng = random.Random(0)
    # each request accepts 5 of 8 drafts on average, with the ups and downs of real copying
    hist = _run(gate, lambda _r: (8, rng.choice([8, 7, 6, 5, 4, 2])), 300, reqs)
    assert all(hist)


def test_a_copy_heavy_request_in_a_batch_of_others_still_drafts():
    gate = BatchDraftGate()
    reqs = [f"fresh{i}" for i in range(7)] + ["copy"]
    drafted: dict[str, int] = {r: 0 for r in reqs}

    def outcome(rid):
        d, a = ((8, 7) if rid == "copy" else (2, 0))
        drafted[rid] += d
        return d, a

    hist = _run(gate, outcome, 200, reqs)
    assert sum(hist) < 0.2 * len(hist)  # the batch as a whole does not draft
    assert gate.solo("copy")
    assert not any(gate.solo(r) for r in reqs[:-1])
    assert drafted["copy"] == 8 * 200  # it drafted every step
    assert max(drafted[r] for r in reqs[:-1]) < 2 * 0.2 * 200


def test_one_stream_and_waiting_requests_are_not_gated():
    gate = BatchDraftGate()
    assert all(_run(gate, lambda _r: (2, 0), 50, ["solo"]))
    gate = BatchDraftGate()
    reqs = [f"r{i}" for i in range(8)]
    # with requests waiting, an early finish admits the next one: the per-request rule holds
    assert all(_run(gate, lambda _r: (2, 0), 50, reqs, num_waiting=3))
    assert all(_run(BatchDraftGate(enabled=False), lambda _r: (2, 0), 50, reqs))


def test_a_new_request_opens_a_probe_and_finished_ones_are_forgotten():
    gate = BatchDraftGate()
    reqs = [f"r{i}" for i in range(8)]
    hist = _run(gate, lambda _r: (2, 0), MIN_OBSERVED + 1 + MIN_WAIT // 2, reqs)
    assert not hist[-1]  # closed, halfway through its wait
    gate.remove("r0")
    reqs = reqs[1:] + ["new"]
    assert gate.step(reqs, FIXED_ROWS, HOST_ROWS)  # "new" has not been judged: a probe
    assert gate.is_open
    assert "r0" not in gate._rates


# ------------------------------------------------------------------ the proposers' side
def test_suffix_track_keeps_a_non_drafting_request_in_the_global_tree():
    p = SuffixProposer(max_depth=8)
    prompt = [5, 6, 7]
    out = [11, 12, 13, 14, 15, 16]
    p.propose(["a"], [np.array(prompt + out[:1])], [4], [3])
    # the gate closed: no lookups, no indexing, but every new token is recorded
    p.track(["a"], [np.array(prompt + out)], [3])
    assert p._reqs["a"].indexed == 4
    p.remove("a")
    assert p.propose(["b"], [np.array([1, 2, 11, 12, 13])], [3], [2]) == [[14, 15, 16]]


def test_own_tree_match_from_active_nodes_equals_the_binary_search():
    rng = random.Random(3)
    for _ in range(30):
        p = SuffixProposer(max_depth=rng.choice([4, 8, 24]), max_cached_requests=0)
        toks = [rng.randrange(4) for _ in range(rng.randint(2, 80))]
        st = p._update("r", np.array(toks), 1, index=True)
        k = rng.randint(1, 8)
        max_len = min(max(1, p.max_depth - k), p.max_depth - 1)
        ref = st.tree.longest_continued_match(toks[-(p.max_depth - 1):], max_len)
        got = p._propose_one(st, k)
        node, m = ref
        if node is None:
            assert got == []
        else:
            limit = min(k, int(p.max_spec_factor * m))
            assert got == st.tree.speculate(node, limit, p.min_token_prob)[0]


# ------------------------------------------------------------------ in the engine
def test_greedy_outputs_identical_with_the_gate_in_a_lock_step_batch(tiny_llama_dir):
    prompts = copy_prompts(6, 4)
    base = make_engine(tiny_llama_dir)
    add_requests(base, prompts, 48)
    expected = run_all(base)
    for method in ("ngram", "suffix"):
        core = make_engine(tiny_llama_dir, spec_json(method, 4, batch_gate=True))
        add_requests(core, prompts, 48)
        assert run_all(core) == expected
        assert core.scheduler.spec_stats.num_draft_tokens > 0


def test_scheduler_reports_waiting_requests_to_the_gate(tiny_llama_dir):
    """With requests waiting for a slot the gate steps aside: the scheduler must say so."""
    core = make_engine(tiny_llama_dir, spec_json("ngram", 4, batch_gate=True), max_num_seqs=2)
    add_requests(core, copy_prompts(5, 1), 8)
    so = core.scheduler.schedule()
    assert len(so.num_scheduled_tokens) == 2
    assert so.num_waiting_reqs == 3
