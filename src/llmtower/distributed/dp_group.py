"""The engines' process group (torch.distributed, gloo) and the periodic sync that runs on it.

Every engine keeps its own scheduler; what they share is one small collective every
``sync_interval`` steps. Each engine writes its row, the all-reduce (a sum) gives every engine
every row:

    row of rank r:  [ has unfinished work | waiting | running | free KV blocks | steps | op ]

Waves. Engines step only while the cluster has work. An engine that leaves idleness (a request
came) starts a *wave*: it tells the head, which tells every other engine to join (an idle
engine joins without stepping: it only takes part in the collectives). At every sync the
engines see whether anyone still has work; when nobody has, the wave ends on every engine at
the same collective and all of them block on their input queues together, costing nothing.

    wave w:   engine 0  |step ... step|S|step ... step|S|   (S: the collective, async)
              engine 1  |  (idle, waits on input)     |S|    |S| -> all idle: wave w ends

Coordinated operations (reset the prefix cache, defragment, ...) run on every engine at the
same collective: the head numbers each one and sends it to all engines; each writes the
highest number it holds in its ``op`` column, and an operation runs once the collective shows
that every member holds it. Outside a wave there are no steps to line up with: it runs at once.

The collective is posted asynchronously and collected when done: the busy loop never waits for
it. A peer that is behind only delays the next sync (it is not posted while one is out), never
this engine's steps. A collective out for longer than ``timeout_s`` (a peer died, hung or was
cut off) breaks the group (``group_broken``): this engine keeps serving alone, and the head
forms a new group of the survivors (a new *epoch*: a fresh gloo group under its own store
prefix).
"""
from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads in the engine that joins a group, not in the API process
    import torch

logger = logging.getLogger(__name__)

# Columns of the sync tensor.
HAS_WORK, WAITING, RUNNING, FREE_BLOCKS, STEPS, OP = range(6)
NUM_COLUMNS = 6


@dataclass
class DPGroupConfig:
    """What an engine process needs to join the data-parallel group."""

    rank: int
    size: int
    store_host: str
    store_port: int
    own_ip: str  # the address this engine's gloo transport listens on
    sync_interval: int = 32
    timeout_s: float = 30.0


@dataclass
class DPSyncResult:
    """One collective's outcome: every member's row, in group order."""

    ranks: list[int]
    rows: list[list[int]]
    seconds: float  # from posting to collecting (the slowest member's lag included)

    @property
    def any_work(self) -> bool:
        return any(row[HAS_WORK] for row in self.rows)


@dataclass
class DPEvent:
    """Something the head must hear about: ``wave_started`` (with the wave number) or
    ``group_broken`` (with the error)."""

    kind: str
    wave: int = 0
    epoch: int = 0
    detail: str = ""


@dataclass
class DPStatus:
    """What ``dp_status`` answers: the group this engine is in and its sync counters."""

    rank: int
    epoch: int
    members: list[int]
    active: bool
    wave: int
    in_wave: bool
    num_syncs: int
    sync_wait_seconds_total: float
    last_op_at_sync: int  # num_syncs when the last coordinated operation ran (-1: none yet)


@dataclass
class _Pending:
    work: object
    tensor: torch.Tensor
    posted: float


@dataclass
class DPGroup:
    """Owns this engine's membership in the engines' process group: the gloo group of the
    current epoch, the wave state, the collective in flight and the sync counters."""

    config: DPGroupConfig
    epoch: int = -1
    members: list[int] = field(default_factory=list)
    wave: int = 0  # waves completed in this epoch
    in_wave: bool = False
    num_syncs: int = 0
    # Time the busy loop itself spent posting and waiting for collectives: the sync's cost.
    sync_wait_seconds_total: float = 0.0
    last_result: DPSyncResult | None = None
    _pg: Any = None  # torch.distributed.ProcessGroupGloo of the current epoch
    _store: Any = None  # torch.distributed.TCPStore client of the head's store
    _pending: _Pending | None = None
    _steps_in_wave: int = 0
    _last_post_step: int = 0
    # Coordinated operations received and not yet run: op id -> what the engine must do.
    _ops: dict[int, object] = field(default_factory=dict)
    _max_op: int = 0
    _ready_ops: list[object] = field(default_factory=list)
    last_op_at_sync: int = -1

    # ------------------------------------------------------------------ membership
    @property
    def active(self) -> bool:
        return self._pg is not None

    def set_membership(self, epoch: int, members: list[int]) -> None:
        """Form the gloo group of ``epoch`` with ``members`` (global ranks). Blocks until every
        member has joined, at most ``timeout_s``; on failure the engine stays alone."""
        import torch.distributed as dist
        if epoch <= self.epoch:
            return  # stale: a newer membership arrived first
        self._drop_group()
        self.epoch, self.members = epoch, list(members)
        self.wave, self.in_wave, self._steps_in_wave = 0, False, 0
        if self.config.rank not in members or len(members) < 2:
            return  # alone: nothing to sync with
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        if self._store is None:
            self._store = dist.TCPStore(self.config.store_host, self.config.store_port, None,
                                        False, timeout=timeout, wait_for_workers=False)
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.config.own_ip)]
        t0 = time.perf_counter()
        try:
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore(f"dp-epoch-{epoch}", self._store),
                                             members.index(self.config.rank), len(members), opts)
        except RuntimeError as e:
            logger.error("could not form the data-parallel group of epoch %d with ranks %s: %s",
                         epoch, members, e)
            self._pg = None
            return
        logger.info("data-parallel group epoch %d: ranks %s (formed in %.2f s)", epoch,
                    members, time.perf_counter() - t0)

    def _drop_group(self) -> None:
        self._pending = None
        self._pg = None

    # ------------------------------------------------------------------ the loop's hook
    def start_wave(self, wave: int) -> bool:
        """The head relays another engine's wave start. Returns whether this engine joined
        (a stale start, for a wave that already ended here, is ignored)."""
        if not self.active or self.in_wave or wave < self.wave:
            return False
        self.in_wave, self._steps_in_wave, self._last_post_step = True, 0, 0
        return True

    def tick(self, row: list[int], stepped: bool) -> list[DPEvent]:
        """Called by the busy loop after each step (``stepped``) or each idle poll while in a
        wave. Starts a wave when work appears, posts the collective at each interval and
        collects the one in flight. Returns the events the head must hear."""
        if not self.active:
            return []
        events: list[DPEvent] = []
        has_work = bool(row[HAS_WORK])
        if not self.in_wave:
            if not has_work:
                return []
            self.in_wave, self._steps_in_wave, self._last_post_step = True, 0, 0
            events.append(DPEvent("wave_started", self.wave, self.epoch))
        if stepped:
            self._steps_in_wave += 1
        try:
            self._collect()
            # A busy engine syncs every interval; an idle one as soon as it can (it has no
            # steps to count and must not hold the others back). Nobody ever waits: while
            # the last collective is still out (a peer is behind), the next one is not posted.
            due = (not has_work) or \
                self._steps_in_wave - self._last_post_step >= self.config.sync_interval
            if due and self.in_wave and self._pending is None:
                self._post(row)
        except RuntimeError as e:
            events.append(self._broken(e))
        return events

    def status(self) -> DPStatus:
        return DPStatus(self.config.rank, self.epoch, list(self.members), self.active,
                        self.wave, self.in_wave, self.num_syncs, self.sync_wait_seconds_total,
                        self.last_op_at_sync)

    @property
    def idle_in_wave(self) -> bool:
        """True while this engine has no work of its own but must keep taking part."""
        return self.active and self.in_wave

    # ------------------------------------------------------------------ coordinated operations
    def schedule_op(self, op_id: int, payload: object) -> bool:
        """Hold ``payload`` until every member holds ``op_id``; True when it may run now
        (no wave, so no step boundary to line up with, or no group at all)."""
        if not self.active or not self.in_wave:
            self.last_op_at_sync = self.num_syncs
            return True
        self._ops[op_id] = payload
        self._max_op = max(self._max_op, op_id)
        return False

    def take_ready_ops(self) -> list[object]:
        """Operations the last collective released (or all of them if the group broke or
        the wave ended), in the order the head numbered them."""
        if not self.active or not self.in_wave:
            self._ready_ops += [self._ops.pop(k) for k in sorted(self._ops)]
        ready, self._ready_ops = self._ready_ops, []
        if ready:
            self.last_op_at_sync = self.num_syncs
        return ready

    # ------------------------------------------------------------------ collectives
    def _post(self, row: list[int]) -> None:
        row = [*row[:OP], self._max_op]
        import torch
        t0 = time.perf_counter()
        t = torch.zeros(len(self.members), NUM_COLUMNS, dtype=torch.int64)
        t[self.members.index(self.config.rank)] = torch.tensor(row, dtype=torch.int64)
        work = self._pg.allreduce([t])
        self._pending = _Pending(work, t, t0)
        self._last_post_step = self._steps_in_wave
        self.sync_wait_seconds_total += time.perf_counter() - t0

    def _collect(self) -> None:
        p = self._pending
        if p is None:
            return
        if not p.work.is_completed():  # type: ignore[attr-defined]
            waited = time.perf_counter() - p.posted
            if waited > self.config.timeout_s:
                raise RuntimeError(f"a sync has not completed in {waited:.0f} s: a peer is "
                                   "gone or cut off")
            return
        t0 = time.perf_counter()
        try:
            p.work.wait()  # type: ignore[attr-defined]  # raises on a dead peer or the timeout
        finally:
            self.sync_wait_seconds_total += time.perf_counter() - t0
        self._pending = None
        self.num_syncs += 1
        self.last_result = DPSyncResult(list(self.members), p.tensor.tolist(),
                                        time.perf_counter() - p.posted)
        agreed = min(row[OP] for row in self.last_result.rows)
        for op_id in sorted(k for k in self._ops if k <= agreed):
            self._ready_ops.append(self._ops.pop(op_id))
        if not self.last_result.any_work:
            # Every member saw the same rows: all of them end the wave at this collective.
            self.in_wave, self._steps_in_wave = False, 0
            self.wave += 1

    def _broken(self, error: Exception) -> DPEvent:
        logger.error("the data-parallel group of epoch %d broke (%s); serving alone until "
                     "the head forms a new one", self.epoch, str(error).splitlines()[0][:200])
        self._drop_group()
        self.in_wave = False
        return DPEvent("group_broken", self.wave, self.epoch, str(error)[:500])
