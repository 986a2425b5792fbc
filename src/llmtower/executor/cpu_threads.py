"""How many torch threads the engine uses: the CPUs it may run on, fewer while others compete.

Every parallel region of a step (a GEMM, the attention kernel) ends in an OpenMP barrier that
waits for its slowest thread. When another process takes one of our cores, the thread the
kernel descheduled holds up every barrier of the step until it runs again, a scheduler time
slice later: on 2 cores with one busy-loop neighbour a served stream fell from 27 to 0.6 tok/s,
while one thread (no barriers) kept 18. So:

- ``available_cpus()``: the default thread count is what this process may use: its CPU
  affinity (``sched_getaffinity``, e.g. ``taskset`` or a cpuset), capped by the cgroup's CPU
  quota (containers' ``--cpus``), not the machine's core count;
- ``ThreadGovernor``: between steps (at most every ``interval_s``) it samples how many other
  tasks are runnable (``/proc/loadavg``'s running count less this process's own running
  threads), smooths it, and sets the thread count to the CPUs left free, at least one: a
  neighbour gets its core, and we keep a fair share instead of collapsing. When the neighbour
  leaves, the threads come back.
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cgroup_cpu_limit() -> float | None:
    """The cgroup's CPU quota in CPUs (e.g. 1.5), or None when unlimited or unknown."""
    try:
        if _CGROUP_V2.is_file():
            quota, period = _CGROUP_V2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        q, p = (int(f.read_text()) for f in _CGROUP_V1)
        return q / p if q > 0 and p > 0 else None
    except (OSError, ValueError):
        return None


def available_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by the cgroup quota (rounded up)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return max(1, n)


def _running_total() -> int | None:
    """Runnable tasks on the machine right now (the 4th field of /proc/loadavg: R/T)."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def _own_running() -> int:
    """This process's threads that are runnable now (OpenMP workers still spinning count)."""
    n = 0
    try:
        for task in os.scandir("/proc/self/task"):
            try:
                with open(f"{task.path}/stat", "rb") as f:
                    # The state follows the parenthesised command name.
                    if f.read().rsplit(b")", 1)[1][1:2] == b"R":
                        n += 1
            except (OSError, IndexError):
                continue
    except OSError:
        return 0
    return n


class ThreadGovernor:
    """Owns the torch thread count of a running engine: ``max_threads`` while the CPUs are
    free, fewer (at least one) while other tasks want them; ``before_step`` is all the engine
    calls, and it costs one clock read except every ``interval_s``."""

    def __init__(self, max_threads: int, interval_s: float = 0.1, smoothing: float = 0.3) -> None:
        self.max_threads = max(1, max_threads)
        self.interval_s = interval_s
        self.smoothing = smoothing
        self.threads = self.max_threads
        self.others = 0.0  # smoothed count of other runnable tasks on our CPUs
        self.num_changes = 0
        self._next = 0.0
        # Tasks on CPUs we may not use are not our competition.
        self._outside = max(0, (os.cpu_count() or 1) - available_cpus())
        self.enabled = _running_total() is not None

    def before_step(self) -> int:
        """Adjust the thread count if it is time to look; returns the count to use."""
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        if now < self._next:
            return self.threads
        self._next = now + self.interval_s
        total = _running_total()
        if total is None:
            return self.threads
        others = max(0, total - _own_running() - self._outside)
        self.observe(others)
        return self.threads

    def observe(self, others: float) -> None:
        """Take one sample of other runnable tasks and set the thread count from it."""
        self.others += self.smoothing * (others - self.others)
        want = max(1, min(self.max_threads, round(self.max_threads - self.others)))
        if want != self.threads:
            self.threads = want
            self.num_changes += 1
            import torch  # here, so that front ends can size threads without loading torch

            torch.set_num_threads(want)
