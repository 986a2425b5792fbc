"""The scheduler's lookahead for draft tokens: drafts count in num_scheduled_tokens and in the
token budget, max_num_seqs holds, KV slots are allocated for drafts and released when they are
rejected, and rejected tokens are never registered in the prefix cache."""
from __future__ import annotations

from llmtower.core.kv_cache.kv_cache_manager import cdiv
from spec_helpers import add_requests, assert_nothing_held, copy_prompts, make_engine, run_all, spec_json


class WrongProposer:
    """Drafts K tokens that the target (almost) never picks: every step rejects drafts."""

    def propose(self, req_ids, histories, num_drafts, num_prompts=None):  # noqa: ARG002
        return [[(int(h[-1]) * 7 + j + 1) % 500 + 3 for j in range(k)]
                for h, k in zip(histories, num_drafts)]

    def remove(self, req_id):
        pass


def _engine(model_dir, proposer=None, **kw):
    core = make_engine(model_dir, spec_json("ngram", 6, prompt_lookup_min=1, adaptive=False), **kw)
    if proposer is not None:
        core.executor.runner.spec_decode.proposer = proposer
    return core


def test_drafts_fit_the_token_budget_and_max_num_seqs(tiny_llama_dir):
    core = _engine(tiny_llama_dir, WrongProposer(), max_num_batched_tokens=16, max_num_seqs=3)
    add_requests(core, copy_prompts(6, 0), 25)
    sched = core.scheduler
    seen_drafts = cut = 0
    while core.has_unfinished_requests():
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= 16
        assert sum(so.num_scheduled_tokens.values()) == so.total_num_scheduled_tokens
        assert len(so.num_scheduled_tokens) <= 3 and len(sched.running) <= 3
        for rid, drafts in so.scheduled_spec_decode_tokens.items():
            assert so.num_scheduled_tokens[rid] == 1 + len(drafts)  # last token + drafts
            seen_drafts += 1
            cut += len(drafts) < 6
        out = core.executor.execute_model(so)
        sched.update_from_output(so, out)
    assert seen_drafts > 20
    assert cut > 0  # the budget cut some drafts short
    assert_nothing_held(core)


def test_rejected_drafts_release_their_blocks_and_are_never_cached(tiny_llama_dir):
    bs = 4
    core = _engine(tiny_llama_dir, WrongProposer(), block_size=bs)
    add_requests(core, copy_prompts(3, 1), 40)
    sched, kv = core.scheduler, core.scheduler.kv
    released = 0
    while core.has_unfinished_requests():
        so = sched.schedule()
        held_before = {rid: kv.num_blocks_of(rid) for rid in so.scheduled_spec_decode_tokens}
        out = core.executor.execute_model(so)
        sched.update_from_output(so, out)
        for rid in so.scheduled_spec_decode_tokens:
            req = sched.requests.get(rid)
            if req is None:
                continue  # finished: everything was freed
            # Only the real tokens keep blocks; the rest went back to the pool.
            assert kv.num_blocks_of(rid) == cdiv(req.num_tokens, bs)
            assert req.num_computed_tokens == req.num_tokens - 1
            released += held_before[rid] - kv.num_blocks_of(rid)
            # Cached blocks hold computed tokens only, and their hashes are those of the
            # request's real tokens (a rejected token's KV never became a full cached block).
            num_cached = kv.num_cached_blocks.get(rid, 0)
            assert num_cached * bs <= req.num_computed_tokens
            blocks = kv.req_to_blocks[rid]
            for i in range(num_cached):
                assert blocks[i].block_hash == req.block_hashes[i]
        # The runner's block tables agree with the scheduler's.
        runner = core.executor.runner
        for rid in so.scheduled_spec_decode_tokens:
            if rid in sched.requests:
                row = runner.batch.req_id_to_row[rid]
                n = int(runner.batch.num_blocks[row])
                assert list(runner.batch.block_table[row, :n]) == kv.get_block_ids(rid)
    assert released > 0
    assert sched.spec_stats.num_draft_tokens > 100
    assert sched.spec_stats.num_accepted_tokens < sched.spec_stats.num_draft_tokens // 10
    assert_nothing_held(core)


def test_drafts_never_preempt_anyone(tiny_llama_dir):
    """With the KV cache nearly full, a request whose drafts do not fit decodes without them
    rather than preempting another request; outputs stay those of plain decoding."""
    prompts = copy_prompts(4, 5)
    plain_core = make_engine(tiny_llama_dir, num_gpu_blocks=40)
    add_requests(plain_core, prompts, 30)
    plain = run_all(plain_core)
    core = _engine(tiny_llama_dir, WrongProposer(), num_gpu_blocks=40)
    add_requests(core, prompts, 30)
    assert run_all(core) == plain
    assert core.scheduler.num_preemptions <= plain_core.scheduler.num_preemptions
    assert_nothing_held(core)
