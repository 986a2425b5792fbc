"""The scheduler's side of speculative decoding: what it does with a request's drafts after a
step verified them, and the draft totals it reports (vLLM's ``spec_decode`` metrics).

The scheduler treats drafts as lookahead tokens: ``num_scheduled_tokens`` counts the last
token plus the drafts, KV slots are allocated for all of them, and ``num_computed_tokens``
advances by all of them. After the step, the rejected drafts are taken back:
``num_computed_tokens`` drops by their number (so their KV is never registered as a full
prefix-cache block: a block is cached only once every slot of it holds a computed, accepted
token) and whole blocks that held only rejected tokens go back to the pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llmtower.core.kv_cache.kv_cache_manager import KVCacheManager
from llmtower.core.request import Request


@dataclass
class SpecDecodingStats:
    """Owns the engine's cumulative draft counters."""

    num_drafts: int = 0  # verifications of one request with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1


def apply_verification(req: Request, drafts: list[int], sampled: list[int],
                       kv: KVCacheManager, stats: SpecDecodingStats) -> None:
    """``req`` ran its last token + ``drafts`` and got ``sampled`` (accepted drafts + one
    token): take back the rejected drafts' progress and KV blocks, and count."""
    num_accepted = max(0, len(sampled) - 1)
    rejected = len(drafts) - num_accepted
    req.num_computed_tokens -= rejected
    # The real tokens after this step: computed ones + the final sampled token.
    kv.free_blocks_beyond(req, req.num_computed_tokens + 1)
    req.spec_num_draft_tokens += len(drafts)
    req.spec_num_accepted_tokens += num_accepted
    stats.observe(len(drafts), num_accepted)


def next_drafts(req: Request, proposed: list[int]) -> list[int]:
    """The proposed drafts the request can use: no more than it may still output, less the
    token every step adds anyway (so drafts never pass max_tokens or max_model_len)."""
    room = req.max_tokens - req.num_output_tokens - 1
    if room <= 0 or not proposed:
        return []
    return proposed[:room]
