"""Prefix preload inside the engine: compute the KV of known prompts into the prefix cache
without anyone waiting for their tokens, and optionally pin those blocks.

Each prompt becomes an internal request (one greedy token, ignored) that the scheduler runs
like any other, interleaved with real traffic; its full blocks are cached as they fill, and
when it finishes its prefix can be pinned (``PinnedBlocks``). Its outputs never leave the
engine. A batch of prompts gets an id; ``status(batch_id)`` says how far it is.
"""
from __future__ import annotations

import itertools

import msgspec

from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.core.outputs import EngineCoreOutputs
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler

# Request ids of preloads: never produced by the API server or the offline LLM.
PRELOAD_PREFIX = "__preload__-"


class PreloadError(msgspec.Struct):
    """One prompt that could not be preloaded: its index in the batch and why."""

    index: int
    message: str


class PreloadStatus(msgspec.Struct, kw_only=True):
    """How far one preload batch is (an engine utility's answer)."""

    batch_id: int = 0
    engine_index: int = 0  # set by the API process
    num_prompts: int = 0
    num_pending: int = 0
    num_done: int = 0
    num_failed: int = 0
    num_cached_blocks: int = 0  # full blocks of the finished prompts, in the prefix cache
    num_pinned_blocks: int = 0  # blocks this batch pinned
    total_pinned_blocks: int = 0  # pinned in this engine, all batches
    max_pinned_blocks: int = 0
    errors: list[PreloadError] = []

    @property
    def finished(self) -> bool:
        return self.num_pending == 0


class PreloadTracker:
    """Owns the engine's preload batches: their internal requests in flight, whether each
    batch pins, and each batch's status until it is collected."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._ids = itertools.count()
        self._batches: dict[int, PreloadStatus] = {}
        self._pending: dict[str, tuple[int, Request, bool]] = {}  # rid -> (batch, req, pin)

    @property
    def active(self) -> bool:
        return bool(self._pending)

    def add(self, prompts: list[list[int]], pin: bool, cache_salt: str | None) -> PreloadStatus:
        batch = next(self._ids)
        st = PreloadStatus(batch_id=batch, num_prompts=len(prompts))
        self._batches[batch] = st
        for i, ids in enumerate(prompts):
            rid = f"{PRELOAD_PREFIX}{batch}-{i}"
            req = Request(rid, ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                          cache_salt=cache_salt)
            try:
                if not ids:
                    raise ValueError("the prompt is empty")
                self.scheduler.add_request(req)
            except (AdmissionError, QueueFullError, ValueError) as e:
                st.num_failed += 1
                st.errors.append(PreloadError(i, str(e)))
                continue
            self._pending[rid] = (batch, req, pin)
            st.num_pending += 1
        return self._with_pins(st)

    def filter_outputs(self, outputs: EngineCoreOutputs) -> None:
        """Take the preload requests' outputs out of ``outputs``; finish those that ended."""
        kept = []
        for o in outputs.outputs:
            entry = self._pending.get(o.request_id)
            if entry is None:
                kept.append(o)
                continue
            if o.finish_reason is not None:
                del self._pending[o.request_id]
                self._finish(*entry)
        outputs.outputs = kept

    def _finish(self, batch: int, req: Request, pin: bool) -> None:
        st = self._batches[batch]
        st.num_pending -= 1
        st.num_done += 1
        kv = self.scheduler.kv
        # The full blocks of the prompt (the last token is always recomputed, see
        # KVCacheManager.get_computed_blocks); they were freed just now and stay cached.
        hashes = req.block_hashes[:(req.num_prompt_tokens - 1) // kv.block_size]
        st.num_cached_blocks += sum(1 for h in hashes if h in kv.pool.cached)
        if pin:
            new, _ = kv.pinned.pin(hashes)
            st.num_pinned_blocks += new

    def status(self, batch_id: int) -> PreloadStatus:
        st = self._batches.get(batch_id)
        if st is None:
            raise ValueError(f"no preload batch {batch_id} (finished batches are reported once)")
        if st.finished:
            del self._batches[batch_id]
        return self._with_pins(st)

    def _with_pins(self, st: PreloadStatus) -> PreloadStatus:
        pinned = self.scheduler.kv.pinned
        st.total_pinned_blocks = len(pinned)
        st.max_pinned_blocks = pinned.max_blocks
        return st

    def abort_all(self) -> None:
        """Drop every preload in flight (engine shutdown or reset)."""
        self.scheduler.abort_requests(list(self._pending))
        self._pending.clear()
