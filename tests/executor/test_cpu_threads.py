"""Thread defaults follow the CPUs this process may use; the governor sheds threads while other
tasks compete for them and takes them back when they leave."""
from __future__ import annotations

import os

import pytest
import torch

from llmtower.engine.args import EngineArgs
from llmtower.executor import cpu_threads
from llmtower.executor.cpu_threads import ThreadGovernor, available_cpus, cgroup_cpu_limit
from llmtower.kernels.build import KernelUnavailable


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_available_cpus_follow_affinity_and_cgroup_quota(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 2, 5}, raising=False)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: None)
    assert available_cpus() == 3
    assert EngineArgs(model="fake").threads == 3
    assert EngineArgs(model="fake", num_threads=5).threads == 5  # as the user asked
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: 1.5)
    assert available_cpus() == 2  # a quota of 1.5 CPUs: 2 threads, each gets 3/4 of a core
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: 0.25)
    assert available_cpus() == 1


@pytest.mark.parametrize("text, want", [("150000 100000\n", 1.5), ("max 100000\n", None),
                                        ("garbage", None)])
def test_cgroup_v2_quota(tmp_path, monkeypatch, text, want):
    f = tmp_path / "cpu.max"
    f.write_text(text)
    monkeypatch.setattr(cpu_threads, "_CGROUP_V2", f)
    assert cgroup_cpu_limit() == want


def test_governor_sheds_a_thread_for_a_busy_neighbour_and_takes_it_back():
    g = ThreadGovernor(max_threads=2)
    torch.set_num_threads(2)
    for _ in range(6):  # one other task keeps running
        g.observe(1)
    assert g.threads == 1 and torch.get_num_threads() == 1
    for _ in range(10):  # it left
        g.observe(0)
    assert g.threads == 2 and torch.get_num_threads() == 2
    assert g.num_changes == 2


def test_governor_never_goes_below_one_thread_nor_above_its_maximum():
    g = ThreadGovernor(max_threads=4)
    for _ in range(20):
        g.observe(30)  # a machine far over-subscribed
    assert g.threads == 1
    for _ in range(40):
        g.observe(0)
    assert g.threads == 4


def test_one_brief_task_does_not_flip_the_count():
    g = ThreadGovernor(max_threads=2)
    g.observe(1)  # one sample: smoothed to 0.3 of a task
    assert g.threads == 2


class Machine:
    """A simulated machine for the governor: a clock, this process's CPU time (one second per
    thread per second) and what other tasks use, as ``_cpu_seconds`` would read them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, governor: ThreadGovernor) -> None:
        self.now, self.busy, self.own = 100.0, 0.0, 0.0
        self.g = governor
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(cpu_threads, "_cpu_seconds", lambda _cpus: (self.busy, self.own))
        governor._outside = 0
        governor.enabled = True

    def run(self, seconds: float, others, step_s: float = 0.02) -> list[int]:
        """Steps for ``seconds``; ``others(threads)`` is the cores other tasks use meanwhile."""
        seen = []
        end = self.now + seconds
        while self.now < end:
            n = self.g.before_step()
            seen.append(n)
            self.now += step_s
            self.own += n * step_s
            self.busy += (n + others(n)) * step_s
        return seen


def test_before_step_measures_the_cpu_others_used(monkeypatch):
    g = ThreadGovernor(max_threads=2, interval_s=0.0)
    m = Machine(monkeypatch, g)
    m.run(2.0, lambda _n: 3.0, step_s=1.0)  # a step a second; others used 3 cores meanwhile
    assert g.threads == 1
    assert g.others > 2


# ------------------------------------------------------------------ reaction time
def test_first_look_after_an_idle_spell_decides_alone():
    # A server idle for two seconds gets a request while a neighbour spins: the first step
    # already runs on one thread (no collapsed steps while a smoothed average catches up).
    g = ThreadGovernor(max_threads=2)
    g.observe(0, dt=None)
    g.observe(1, dt=2.0)
    assert g.threads == 1 and torch.get_num_threads() == 1


def test_samples_close_together_are_smoothed():
    g = ThreadGovernor(max_threads=2)
    g.observe(1, dt=0.01)  # one runnable task seen for a moment: not a neighbour yet
    assert g.threads == 2
    for _ in range(30):  # ...but one that stays is one, within a fraction of a second
        g.observe(1, dt=0.01)
    assert g.threads == 1


def test_governor_follows_a_neighbour_over_time(monkeypatch):
    """The engine's two threads run on two cores; a busy neighbour comes and goes. Beside our
    two threads it gets its fair share, 2/3 of a core; beside one, a core of its own."""
    neighbour = [False]
    g = ThreadGovernor(max_threads=2, interval_s=0.1)
    m = Machine(monkeypatch, g)

    def others(threads: int) -> float:
        return (2 / (threads + 1) if threads == 2 else 1.0) if neighbour[0] else 0.0

    assert set(m.run(1.0, others)) == {2}
    neighbour[0] = True
    shed = m.run(1.0, others)
    assert shed[-1] == 1 and shed.index(1) <= 25  # shed within half a second
    assert set(shed[shed.index(1):]) == {1}  # and it stays shed while the neighbour runs
    neighbour[0] = False
    back = m.run(2.0, others)
    assert back[-1] == 2 and back.index(2) <= 50
    assert g.num_changes == 2


def test_a_process_that_wakes_at_every_step_but_uses_little_cpu_is_not_a_neighbour(monkeypatch):
    # The API process and a local client wake at every step's outputs, so they are runnable
    # at nearly every step's start; together they use a tenth of a core or so. The served
    # engine keeps both threads (it lost 30% of its throughput when they were counted).
    g = ThreadGovernor(max_threads=2, interval_s=0.1)
    m = Machine(monkeypatch, g)
    ticks = iter([0.0, 0.3, 0.0, 0.1, 0.0, 0.2] * 200)  # coarse /proc/stat ticks, 0.1 mean
    assert set(m.run(5.0, lambda _n: next(ticks))) == {2}


def test_the_reading_sees_the_cpu_another_process_used():
    """Against the real /proc/stat: a child that spins on our CPUs shows up as others' CPU."""
    import multiprocessing as mp

    g = ThreadGovernor(max_threads=2)
    before = cpu_threads._cpu_seconds(g._cpus)
    assert before is not None
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_spin_and_report, args=(q, 0.4))
    child.start()
    used = q.get(timeout=60)
    child.join(timeout=60)
    after = cpu_threads._cpu_seconds(g._cpus)
    assert after is not None
    others = (after[0] - before[0]) - (after[1] - before[1])
    # the child's CPU time is in it; other tasks of the machine can only add to it, and the
    # per-CPU counters tick every 1/CLK_TCK s
    assert used > 0.1 and others >= used - 0.05


def _spin_and_report(q, seconds: float) -> None:
    import time as t

    end = t.process_time() + seconds
    while t.process_time() < end:
        pass
    q.put(t.process_time())


# ------------------------------------------------------------------ --cpu-bind
def test_parse_cpu_list():
    assert cpu_threads.parse_cpu_list("0-3,6, 8-9") == [0, 1, 2, 3, 6, 8, 9]
    with pytest.raises(ValueError, match="runs backwards"):
        cpu_threads.parse_cpu_list("3-1")
    with pytest.raises(ValueError, match="not a CPU number"):
        cpu_threads.parse_cpu_list("0,x")
    with pytest.raises(ValueError, match="twice"):
        cpu_threads.parse_cpu_list("0-2,1")


def test_resolve_cpu_bind(monkeypatch):
    monkeypatch.delenv(cpu_threads.BIND_ENV, raising=False)
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_limit", lambda: None)
    allowed = [2, 3, 4, 5]
    resolve = cpu_threads.resolve_cpu_bind
    assert resolve("", 0, allowed) == () and resolve("none", 0, allowed) == ()
    assert resolve("3,5", 0, allowed) == (3, 5)
    assert resolve("2-5", 2, allowed) == (2, 3)  # fewer threads: the first CPUs
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(allowed), raising=False)
    assert resolve("auto", 0, allowed) == (2, 3, 4, 5)
    assert resolve("auto", 3, allowed) == (2, 3, 4)
    with pytest.raises(ValueError, match=r"CPU\(s\) 0-1,7 are outside this process's "
                                         r"affinity \(2-5"):
        resolve("0-1,4,7", 0, allowed)
    with pytest.raises(ValueError, match="holds 2 CPUs but --num-threads is 3"):
        resolve("2,3", 3, allowed)
    with pytest.raises(ValueError, match="auto: 6 threads"):
        resolve("auto", 6, allowed)
    monkeypatch.setenv(cpu_threads.BIND_ENV, "4")
    assert resolve("", 0, allowed) == (4,)  # the environment variable, as vLLM's
    assert resolve("none", 0, allowed) == ()  # the flag wins


def test_engine_args_refuse_cpus_outside_the_affinity(monkeypatch):
    monkeypatch.delenv(cpu_threads.BIND_ENV, raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    with pytest.raises(ValueError, match=r"--cpu-bind 0-3: CPU\(s\) 2-3 are outside"):
        EngineArgs(model="fake", cpu_bind="0-3")
    args = EngineArgs(model="fake", cpu_bind="1")
    assert args.threads == 1 and args.cpu_bind_cpus() == (1,)
    assert EngineArgs(model="fake", cpu_bind="auto", num_threads=1).cpu_bind_cpus() == (0,)
    with pytest.raises(ValueError, match="data-parallel"):
        EngineArgs(model="fake", cpu_bind="auto", data_parallel_size=2)


def test_governor_pins_on_its_first_step_and_repins_when_it_sheds(monkeypatch):
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(cpu_threads, "bind_threads", calls.append)
    monkeypatch.setattr(cpu_threads, "_bind_library", lambda: None)
    monkeypatch.setattr(cpu_threads, "_cpu_seconds", lambda _cpus: (5.0, 5.0))  # nobody else
    g = ThreadGovernor(max_threads=2, bind=(1, 0), interval_s=1e9)
    g._outside = 0
    g.before_step()
    g.before_step()
    assert calls == [(1, 0)]  # once, not every step
    for _ in range(6):
        g.observe(1)
    assert calls == [(1, 0), (1,)]
    fixed = ThreadGovernor(max_threads=2, adaptive=False, bind=(0, 1))
    fixed.before_step()
    assert calls[-1] == (0, 1) and not fixed.enabled


def _reset_affinity(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass


def test_bind_threads_pins_the_openmp_pool():
    allowed = sorted(os.sched_getaffinity(0))
    cpus = tuple(reversed(allowed[:2]))
    torch.set_num_threads(len(cpus))
    try:
        cpu_threads.bind_threads(cpus)
    except KernelUnavailable as e:
        pytest.skip(f"no C compiler: {e}")
    try:
        assert os.sched_getaffinity(0) == {cpus[0]}  # the calling thread is thread 0
        pinned = [os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")]
        for c in cpus:
            assert {c} in pinned
        # torch's own parallel regions still run, on the pinned team
        a = torch.randn(256, 256)
        torch.testing.assert_close(a @ a, (a.double() @ a.double()).float(), rtol=1e-4, atol=1e-3)
    finally:
        _reset_affinity(set(allowed))


def test_an_engine_with_cpu_bind_runs_its_steps_on_the_listed_cpu(tiny_llama_dir, monkeypatch):
    from llmtower.core.outputs import EngineCoreRequest
    from llmtower.core.sampling_params import SamplingParams
    from llmtower.engine.factory import create_engine_core

    monkeypatch.delenv(cpu_threads.BIND_ENV, raising=False)
    allowed = set(os.sched_getaffinity(0))
    cpu = max(allowed)
    try:
        core = create_engine_core(EngineArgs(model=str(tiny_llama_dir), cpu_bind=str(cpu),
                                             kv_cache_memory="1MiB", max_model_len=64))
    except KernelUnavailable as e:
        pytest.skip(f"no C compiler: {e}")
    try:
        assert core.model_info.num_threads == 1  # the list sets the count
        core.add_request(EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=2)))
        while core.has_unfinished_requests():
            core.step()
        assert os.sched_getaffinity(0) == {cpu}  # the thread that ran the forward pass
    finally:
        _reset_affinity(allowed)
        core.shutdown()
