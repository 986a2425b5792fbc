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
  leaves, the threads come back. The smoothing follows the clock (a time constant, not a
  number of samples), so the first step after an idle spell, or after one long collapsed
  step, acts on what it sees at once;
- ``resolve_cpu_bind``/``bind_threads``: ``--cpu-bind`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``)
  pins OpenMP thread i to the i-th CPU of a list, for hosts whose cores are the engine's alone.

libgomp's spin-wait is left as it is: under contention its waiters hold a CPU for up to ~10 ms
per barrier (that is the collapse), but ``OMP_WAIT_POLICY=passive`` halved one int4 stream on a
quiet core pair (174 -> 90 tok/s) and ``GOMP_SPINCOUNT=1000`` cost 5-15%, while the governor
removes the barriers whenever a neighbour is seen (docs/performance.md). Both variables are
still obeyed when set.
"""
from __future__ import annotations

import ctypes
import math
import os
import re
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


def affinity() -> list[int]:
    """The CPUs this process may run on (``sched_getaffinity``), in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def available_cpus() -> int:
    """CPUs this process may run on: its affinity, capped by the cgroup quota (rounded up)."""
    n = len(affinity())
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


_IDLE_LOOKS = 3  # looks at the first step after an idle spell (see before_step)


class ThreadGovernor:
    """Owns the torch thread count of a running engine, and the threads' CPUs when pinned:
    ``max_threads`` while the CPUs are free, fewer (at least one) while other tasks want them
    (``adaptive``; a fixed count otherwise). ``before_step`` is all the engine calls, from the
    thread that runs the forward pass; it costs one clock read except every ``interval_s``."""

    def __init__(self, max_threads: int, interval_s: float = 0.1, smoothing: float = 0.3,
                 adaptive: bool = True, bind: tuple[int, ...] = (),
                 time_constant_s: float = 0.3) -> None:
        self.max_threads = max(1, max_threads)
        if bind and len(bind) < self.max_threads:
            raise ValueError(f"{self.max_threads} threads cannot be pinned to {len(bind)} CPUs "
                             f"{list(bind)}")
        self.interval_s = interval_s
        self.smoothing = smoothing  # weight of one sample when no clock is given (tests)
        self.time_constant_s = time_constant_s
        self.adaptive = adaptive
        self.bind = bind
        if bind:
            _bind_library()  # at startup: without a C compiler --cpu-bind fails here, clearly
        self.threads = self.max_threads
        self.others = 0.0  # smoothed count of other runnable tasks on our CPUs
        self.num_changes = 0
        self._next = 0.0
        self._last_sample: float | None = None
        self._bound = 0  # team size the pinning was last applied to (0: not yet)
        # Tasks on CPUs we may not use are not our competition.
        self._outside = max(0, (os.cpu_count() or 1) - available_cpus())
        self.enabled = adaptive and _running_total() is not None

    def before_step(self) -> int:
        """Adjust the thread count if it is time to look; returns the count to use."""
        if self.bind and self._bound != self.threads:
            self._apply(self.threads)  # first step (the forward thread exists now)
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        if now < self._next:
            return self.threads
        self._next = now + self.interval_s
        dt = None if self._last_sample is None else now - self._last_sample
        # After an idle spell the one look decides alone: take the least of a few looks 0.5 ms
        # apart, so that the API process that just handed us the request (still runnable for
        # a moment) is not taken for a neighbour; a busy neighbour is runnable in all of them.
        looks = _IDLE_LOOKS if dt is None or dt > 5 * self.interval_s else 1
        seen = []
        for i in range(looks):
            if i:
                time.sleep(0.0005)
            total = _running_total()
            if total is None:
                return self.threads
            seen.append(max(0, total - _own_running() - self._outside))
        self._last_sample = now
        self.observe(min(seen), dt)
        return self.threads

    def observe(self, others: float, dt: float | None = None) -> None:
        """Take one sample of other runnable tasks, ``dt`` seconds after the previous one, and
        set the thread count from it. The longer since the last look, the more the new sample
        counts: after an idle spell (or one step that took a second) it decides alone."""
        alpha = self.smoothing if dt is None else 1.0 - math.exp(-dt / self.time_constant_s)
        self.others += alpha * (others - self.others)
        want = max(1, min(self.max_threads, round(self.max_threads - self.others)))
        if want != self.threads:
            self.threads = want
            self.num_changes += 1
            self._apply(want)

    def _apply(self, n: int) -> None:
        import torch  # here, so that front ends can size threads without loading torch

        torch.set_num_threads(n)
        if self.bind:
            bind_threads(self.bind[:n])
            self._bound = n


# ------------------------------------------------------------------ pinning (--cpu-bind)
BIND_ENV = "LLMTOWER_CPU_OMP_THREADS_BIND"


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6,8-9' -> [0, 1, 2, 3, 6, 8, 9] (the taskset/cpuset list syntax), in that order."""
    cpus: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise ValueError(f"--cpu-bind {text!r}: {part.strip()!r} is not a CPU number or "
                             "range; write e.g. 0-3 or 0,2,4")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"--cpu-bind {text!r}: the range {lo}-{hi} runs backwards")
        cpus.extend(range(lo, hi + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"--cpu-bind {text!r} names a CPU twice: one thread per CPU")
    return cpus


def resolve_cpu_bind(spec: str, num_threads: int, allowed: list[int] | None = None
                     ) -> tuple[int, ...]:
    """The CPUs to pin threads 0, 1, ... to, from ``--cpu-bind`` (``none``, ``auto`` or a CPU
    list; empty: ``$LLMTOWER_CPU_OMP_THREADS_BIND``, else none). ``num_threads`` 0 means the
    default count. Raises ValueError, saying what to change, for CPUs this process may not use
    or a thread count the list cannot hold."""
    spec = (spec or os.environ.get(BIND_ENV, "") or "none").strip()
    if spec in ("none", "nobind"):
        return ()
    allowed = affinity() if allowed is None else allowed
    if spec == "auto":  # one thread per CPU of the affinity, as many as the threads
        n = num_threads or available_cpus()
        if n > len(allowed):
            raise ValueError(f"--cpu-bind auto: {n} threads but this process may use only "
                             f"{len(allowed)} CPUs ({_ranges(allowed)}): lower --num-threads")
        return tuple(allowed[:n])
    cpus = parse_cpu_list(spec)
    outside = [c for c in cpus if c not in set(allowed)]
    if outside:
        raise ValueError(f"--cpu-bind {spec}: CPU(s) {_ranges(outside)} are outside this "
                         f"process's affinity ({_ranges(allowed)}, set by taskset or a cpuset): "
                         "choose among those, or 'auto'")
    if num_threads > len(cpus):
        raise ValueError(f"--cpu-bind {spec} holds {len(cpus)} CPUs but --num-threads is "
                         f"{num_threads}: one thread per CPU; name more CPUs or fewer threads")
    return tuple(cpus[:num_threads] if num_threads else cpus)


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and out[-1].split("-")[-1] == str(c - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def _bind_library() -> ctypes.CDLL:
    from llmtower.kernels.build import KernelUnavailable, library

    try:
        return library()
    except KernelUnavailable as e:
        raise KernelUnavailable(f"--cpu-bind needs the kernel library (kernels/cpu_bind.c) built: {e}") from e


def bind_threads(cpus: tuple[int, ...]) -> None:
    """Pin OpenMP thread i of a team of ``len(cpus)`` (torch's pool) to ``cpus[i]``."""
    lib = _bind_library()
    arr = (ctypes.c_int * len(cpus))(*cpus)
    failed = lib.llmtower_bind_threads(arr, len(cpus))
    if failed:
        raise OSError(f"could not pin {failed} of {len(cpus)} threads to CPUs {list(cpus)}")
