"""How many torch threads the engine uses: the CPUs it may run on, fewer while others compete.

Every parallel region of a step (a GEMM, the attention kernel) ends in an OpenMP barrier that
waits for its slowest thread. When another process takes one of our cores, the thread the
kernel descheduled holds up every barrier of the step until it runs again, a scheduler time
slice later: on 2 cores with one busy-loop neighbour a served stream fell from 27 to 0.6 tok/s,
while one thread (no barriers) kept 18. So:

- ``available_cpus()``: the default thread count is what this process may use: its CPU
  affinity (``sched_getaffinity``, e.g. ``taskset`` or a cpuset), capped by the cgroup's CPU
  quota (containers' ``--cpus``), not the machine's core count;
- ``ThreadGovernor``: between steps (at most every ``interval_s``) it measures how much CPU
  other tasks used on our CPUs since its last look (``/proc/stat``'s busy time on the CPUs
  of our affinity less this process's own CPU time), smooths it, and sets the thread count
  to the CPUs left free, at least one: a neighbour gets its core, and we keep a fair share
  instead of collapsing. When the neighbour leaves, the threads come back. CPU *used*, not
  tasks *runnable*: the API process and a local client wake at every step's outputs, so a
  look at the step's start finds them runnable nearly every time, yet together they use a
  tenth of a core; counted as a neighbour they cost the served engine a thread (1.4x served
  tok/s on 2 cores, docs/performance.md). A neighbour that shares our cores takes at least
  its fair share of them (2/3 of a core beside our two threads on two cores). The smoothing
  follows the clock (a time constant, not a number of samples), so the first step after an
  idle spell, or after one long collapsed step, acts on what it saw over that time;
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


_BUSY_FIELDS = slice(0, 7)  # /proc/stat: user nice system idle iowait irq softirq (steal...)
_IDLE, _IOWAIT = 3, 4
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Others using this much of a core take it from us. A busy neighbour beside N threads on N
# cores gets N/(N+1) >= 2/3 of one; the API process and a local client, waking at every step,
# use about a tenth together.
_CORE_TAKEN = 0.4


def _busy_seconds(cpus: set[int]) -> float | None:
    """CPU time spent busy on ``cpus`` since boot, by any task (``/proc/stat``'s per-CPU
    user + nice + system + irq + softirq; steal is the hypervisor's, not a neighbour's)."""
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if int(name[3:]) in cpus:
                    v = [int(x) for x in fields[_BUSY_FIELDS]]
                    busy += sum(v) - v[_IDLE] - v[_IOWAIT]
    except (OSError, ValueError, IndexError):
        return None
    return busy / _CLOCK_TICKS


def _cpu_seconds(cpus: set[int]) -> tuple[float, float] | None:
    """(busy seconds on ``cpus`` by anyone, this process's own CPU seconds), both since boot
    or process start: two readings a while apart give what others used in between."""
    busy = _busy_seconds(cpus)
    return None if busy is None else (busy, time.process_time())


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
        self.others = 0.0  # smoothed cores that other tasks used on our CPUs
        self.num_changes = 0
        self._next = 0.0
        self._last_sample: float | None = None
        self._last_reading: tuple[float, float] | None = None
        self._bound = 0  # team size the pinning was last applied to (0: not yet)
        self._cpus = set(affinity())
        # Under a cgroup quota smaller than the affinity, others may keep the CPUs beyond the
        # quota busy without taking anything from us.
        self._outside = max(0, len(self._cpus) - available_cpus())
        self.enabled = adaptive and _cpu_seconds(self._cpus) is not None

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
        reading = _cpu_seconds(self._cpus)
        if reading is None:
            return self.threads
        if self._last_sample is not None and self._last_reading is not None:
            dt = now - self._last_sample
            busy = reading[0] - self._last_reading[0]
            own = reading[1] - self._last_reading[1]
            if dt > 0:  # cores the others used meanwhile
                self.observe(max(0.0, (busy - own) / dt - self._outside), dt)
        self._last_sample, self._last_reading = now, reading
        return self.threads

    def observe(self, others: float, dt: float | None = None) -> None:
        """Take one sample of the cores other tasks used, ``dt`` seconds after the previous
        one, and set the thread count from it. The longer since the last look, the more the new sample
        counts: after an idle spell (or one step that took a second) it decides alone."""
        alpha = self.smoothing if dt is None else 1.0 - math.exp(-dt / self.time_constant_s)
        self.others += alpha * (others - self.others)
        want = max(1, min(self.max_threads,
                          self.max_threads - math.floor(self.others + 1.0 - _CORE_TAKEN)))
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
