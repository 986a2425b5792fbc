"""Thread defaults follow the CPUs this process may use; the governor sheds threads while other
tasks compete for them and takes them back when they leave."""
from __future__ import annotations

import pytest
import torch

from llmtower.engine.args import EngineArgs
from llmtower.executor import cpu_threads
from llmtower.executor.cpu_threads import ThreadGovernor, available_cpus, cgroup_cpu_limit


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


def test_before_step_samples_other_runnable_tasks(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_running_total", lambda: 5)
    monkeypatch.setattr(cpu_threads, "_own_running", lambda: 2)  # 3 others
    g = ThreadGovernor(max_threads=2, interval_s=0.0)
    g._outside = 0
    g.enabled = True
    for _ in range(5):
        g.before_step()
    assert g.threads == 1
    assert g.others > 2
