"""The K/V prefetch trial (kernels/kv_prefetch_choice.py): which setting it keeps for which
step times, what it ignores, and the environment setting that fixes it."""
from __future__ import annotations

import pytest

from llmtower.kernels.kv_prefetch_choice import ENV, KvPrefetchChoice


def _steps(choice: KvPrefetchChoice, rows: int, cost: dict[bool, float], n: int,
           spike: dict[int, float] | None = None) -> list[bool]:
    """n steps of ``rows`` rows, each taking cost[setting] (times spike[i] on step i)."""
    used = []
    for i in range(n):
        on = choice.setting(rows)
        used.append(on)
        choice.record(rows, cost[on] * (spike or {}).get(i, 1.0))
    return used


@pytest.mark.parametrize("faster", [True, False])
def test_the_faster_setting_is_kept(faster):
    choice = KvPrefetchChoice(pairs=6)
    cost = {faster: 0.100, not faster: 0.106}
    used = _steps(choice, 64, cost, 12)
    assert used.count(True) == used.count(False) == 6  # each pair ran both
    assert used[0] != used[2]  # the pairs' order alternates
    assert choice.decided is faster
    assert len(choice.ratios) == 6
    # decided: every later step takes it, of any size
    assert _steps(choice, 64, cost, 4) == [faster] * 4
    assert choice.setting(1) is faster


def test_a_preempted_step_does_not_decide_it():
    """One pair where the machine took the core away (a 5x step) among five that favour the
    stream: the median keeps the stream."""
    choice = KvPrefetchChoice(pairs=6)
    used = _steps(choice, 64, {True: 0.100, False: 0.104}, 12, spike={0: 5.0})
    assert used[0] is True  # the stream's first step was the slow one
    assert choice.decided is True


def test_ties_go_without_the_stream():
    choice = KvPrefetchChoice(pairs=4, margin=0.01)
    _steps(choice, 64, {True: 0.1000, False: 0.1005}, 8)
    assert choice.decided is False


def test_small_steps_and_broken_pairs_are_not_timed():
    choice = KvPrefetchChoice(pairs=2, min_rows=16)
    assert _steps(choice, 4, {True: 1.0, False: 0.1}, 10) == [False] * 10  # below min_rows
    assert choice.ratios == [] and choice.decided is None
    # a step of another row count between the two halves of a pair starts a new pair
    first = choice.setting(64)
    choice.record(64, 0.1)
    assert choice.setting(63) is first  # 63 rows: a new pair's first step, the same side
    choice.record(63, 0.3)
    assert choice.ratios == []
    assert _steps(choice, 63, {True: 9.0, False: 0.1}, 1) == [not first]  # its second step
    on_over_off = 0.3 / 0.1 if first else 0.1 / 0.3
    assert choice.ratios == [pytest.approx(on_over_off)]


@pytest.mark.parametrize("value, decided", [("1", True), ("on", True), ("0", False),
                                            ("off", False), ("auto", None), ("", None)])
def test_the_environment_fixes_it(monkeypatch, value, decided):
    monkeypatch.setenv(ENV, value)
    choice = KvPrefetchChoice.from_env()
    assert choice.decided is decided
    if decided is not None:
        assert _steps(choice, 64, {True: 0.2, False: 0.1}, 20) == [decided] * 20


def test_a_bad_environment_value_says_what_to_set(monkeypatch):
    monkeypatch.setenv(ENV, "yes please")
    with pytest.raises(ValueError, match=r"LLMTOWER_PREFETCH_KV='yes please': use 1 .*, 0 .* or auto"):
        KvPrefetchChoice.from_env()
