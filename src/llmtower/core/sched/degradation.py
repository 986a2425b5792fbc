"""Graceful degradation: when KV blocks or host memory run short, step down in order instead
of thrashing, and step back up when the pressure passes.

  level 0 normal
  level 1 evict     cached-but-unused prefix blocks go first (the pool's LRU order already
                    reuses them before any request is preempted); evictions are counted
  level 2 compress  requests preempted by swap are stored in the swap space as int8 (the
                    per-token/head/32-channel scales of kv_quant.py): 3.5x as many fit in the
                    same host memory before preemption falls back to recompute. Each such
                    swap-out counts as ``compress``. Where it is not available (recompute
                    preemption, no swap space, an int8 KV cache) the level is passed through
                    and the transition counted as ``compress_skipped``
  level 3 shrink    the effective max_num_seqs (of the batch running when pressure began) and
                    token budget drop by ``shrink_step`` (10%) per step of pressure, down to
                    ``shrink_floor``, and rise by as much per ``grow_after`` calm steps
  level 4 refuse    new requests get QueueFullError (HTTP 429 + Retry-After) until calm

Pressure in a step: the scheduler preempted a request (KV blocks ran out), or the host's
available memory (cgroup limit, /proc/meminfo, RLIMIT_AS: the smallest) is under
``min_host_available_bytes``. The level rises by one per pressured step (at most one level
per ``up_interval`` steps) and falls by one after ``down_steps`` calm steps in a row; at level
3 it falls only once the limits are fully restored. The asymmetry is the hysteresis: a
sporadic preemption does not bounce the level.
"""
from __future__ import annotations

import logging
import math
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable

from llmtower.core.errors import QueueFullError

logger = logging.getLogger(__name__)

LEVEL_NAMES = ("normal", "evict", "compress", "shrink", "refuse")
ACTIONS = ("evict", "compress", "compress_skipped", "shrink", "grow", "refuse")


@dataclass
class DegradationConfig:
    """Owns the thresholds of the degradation controller (see the module docstring)."""

    enabled: bool = False
    up_interval: int = 4
    down_steps: int = 32
    grow_after: int = 8
    shrink_step: float = 0.10
    shrink_floor: float = 0.25
    min_host_available_bytes: int = 256 * 2**20
    host_check_interval_s: float = 1.0
    retry_after_s: int = 2
    # Level 2 needs swap preemption into a swap space with int8 slots (the scheduler says).
    compress_available: bool = False


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_available_bytes() -> int | None:
    """Memory this process may still take before the kernel refuses or kills: the smallest of
    the cgroup's room (v2, else v1), MemAvailable, and the address-space limit's room."""
    candidates: list[int] = []
    limit = _read_int("/sys/fs/cgroup/memory.max")
    usage = _read_int("/sys/fs/cgroup/memory.current")
    if limit is None:  # cgroup v1
        limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        usage = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    if limit is not None and usage is not None and limit < 2**60:
        candidates.append(max(0, limit - usage))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            vm = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            candidates.append(max(0, soft - vm))
        except (OSError, ValueError, IndexError):
            pass
    return min(candidates) if candidates else None


@dataclass
class DegradationController:
    """Owns the degradation level, the shrink factor of the batch limits, the calm/pressure
    step counts and the counters per action. The scheduler reports each step (``on_step``),
    asks for its limits (``max_num_seqs``, ``token_budget``) and lets it refuse new requests
    (``check_admission``)."""

    config: DegradationConfig = field(default_factory=DegradationConfig)
    clock: Callable[[], float] = time.monotonic
    host_memory: Callable[[], int | None] = host_available_bytes
    level: int = 0
    factor: float = 1.0  # of the token budget, and of base_seqs for max_num_seqs
    base_seqs: int = 0  # requests running when the shrinking began
    calm_steps: int = 0
    steps_since_change: int = 1 << 30
    actions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ACTIONS, 0))
    host_low: bool = False
    last_host_available: int | None = None
    _last_host_check: float = -1e30
    _last_evictions: int = 0

    # ------------------------------------------------------------------ limits
    def max_num_seqs(self, configured: int) -> int:
        if self.factor >= 1.0:
            return configured
        return min(configured, max(1, math.ceil(self.base_seqs * self.factor - 1e-9)))

    def token_budget(self, configured: int, chunked_prefill: bool) -> int:
        # Without chunked prefill a prompt needs the whole budget in one step: never cut it.
        if self.factor >= 1.0 or not chunked_prefill:
            return configured
        return max(1, int(configured * self.factor))

    def on_idle(self) -> None:
        """No request is left, so nothing can be under KV pressure: back to normal at once
        (an idle engine never steps, so calm steps alone would never bring it back)."""
        if self.level == 0 and self.factor >= 1.0:
            return
        old = self.level
        self.level, self.factor, self.calm_steps, self.base_seqs = 0, 1.0, 0, 0
        self.steps_since_change = 0
        logger.warning("KV memory recovered: degradation level %d (%s) -> 0 (normal): idle",
                       old, LEVEL_NAMES[old])

    def check_admission(self, request_id: str) -> None:
        if self.level >= 4:
            self.actions["refuse"] += 1
            raise QueueFullError(
                f"request {request_id!r} refused: the engine is short of KV memory and sheds "
                f"new work (degradation level 4) until preemptions stop; retry after "
                f"{self.config.retry_after_s} s")

    # ------------------------------------------------------------------ per step
    def on_step(self, num_preempted: int, num_evictions_total: int, num_running: int = 0) -> None:
        """Account one scheduling step: pressure raises the level, calm lowers it."""
        if not self.config.enabled:
            return
        cfg = self.config
        if self.level >= 1 and num_evictions_total > self._last_evictions:
            self.actions["evict"] += num_evictions_total - self._last_evictions
        self._last_evictions = num_evictions_total
        self._check_host()
        self.steps_since_change += 1
        if num_preempted or self.host_low:
            self.calm_steps = 0
            if self.level >= 3 and self.factor > cfg.shrink_floor:
                self.factor = max(cfg.shrink_floor, round(self.factor - cfg.shrink_step, 6))
                self.actions["shrink"] += 1
            elif self.level < 4 and self.steps_since_change >= cfg.up_interval:
                shrinks_next = self.level >= (1 if not cfg.compress_available else 2)
                if shrinks_next and self.base_seqs == 0:  # about to shrink: this batch
                    self.base_seqs = max(1, num_running + num_preempted)
                self._set_level(self.level + 1, "preemptions" if num_preempted else "host memory")
            return
        self.calm_steps += 1
        if self.level == 3 and self.factor < 1.0:  # (level 4 first stops refusing)
            if self.calm_steps >= cfg.grow_after:  # grow back slower than it shrank
                self.factor = min(1.0, round(self.factor + cfg.shrink_step, 6))
                self.actions["grow"] += 1
                self.calm_steps = 0  # the level falls only after down_steps at full limits
                if self.factor >= 1.0:
                    self.base_seqs = 0
            return
        if self.level > 0 and self.calm_steps >= cfg.down_steps:
            self.calm_steps = 0
            self._set_level(self.level - 1, "calm")

    def _set_level(self, level: int, why: str) -> None:
        old = self.level
        if level == 2 and not self.config.compress_available:  # pass through
            if old == 1:
                self.actions["compress_skipped"] += 1
                level = 3
            else:
                level = 1
        self.level = level
        self.steps_since_change = 0
        if level >= 3 and old < 3:
            self.factor = max(self.config.shrink_floor, round(self.factor - self.config.shrink_step, 6))
            self.actions["shrink"] += 1
        logger.warning("KV memory %s: degradation level %d (%s) -> %d (%s): %s",
                       "pressure" if level > old else "recovered", old, LEVEL_NAMES[old],
                       level, LEVEL_NAMES[level], why)

    def _check_host(self) -> None:
        now = self.clock()
        if now - self._last_host_check < self.config.host_check_interval_s:
            return
        self._last_host_check = now
        avail = self.host_memory()
        self.last_host_available = avail
        self.host_low = avail is not None and avail < self.config.min_host_available_bytes


def check_host_memory(kv_bytes: int, swap_bytes: int, margin: float = 0.9) -> None:
    """Refuse, before anything is allocated, a KV pool and swap space that the host cannot
    hold (the cgroup limit, MemAvailable or ``ulimit -v``): past that point the kernel's OOM
    killer, not an error message, would end the engine."""
    avail = host_available_bytes()
    if avail is None or kv_bytes + swap_bytes <= avail * margin:
        return
    gib = 2**30
    raise ValueError(
        f"the KV cache ({kv_bytes / gib:.2f} GiB) and CPU swap space ({swap_bytes / gib:.2f} GiB) "
        f"need {(kv_bytes + swap_bytes) / gib:.2f} GiB but this process may take only "
        f"{avail / gib:.2f} GiB more (the least of its cgroup limit, MemAvailable and ulimit -v; "
        f"{margin:.0%} of it is the most used): lower --kv-cache-memory / --num-gpu-blocks or "
        "--swap-space")
