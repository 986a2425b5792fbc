"""EngineCoreProc + EngineCoreClient: the engine in its own process, over ZMQ, with the
model-free fake executor (tests/engine/fake_engine_factory.py)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from fake_engine_factory import (make_failing_engine, make_fake_engine, make_slow_fake_engine)
from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core_client import EngineCoreClient, EngineDeadError, EngineStartupError
from llmtower.engine.core_messages import PingResult, RequestError

# A guard against hangs only: every wait below ends as soon as its event happens.
GUARD_S = 120  # against hangs only: a loaded CI machine takes tens of seconds to spawn an engine


def _req(rid: str, prompt: list[int], max_tokens: int = 8) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                         temperature=0.0))


async def _collect(client: EngineCoreClient, num_requests: int):
    """Outputs until ``num_requests`` requests finished or were refused."""
    tokens: dict[str, list[int]] = {}
    errors: dict[str, RequestError] = {}
    finished = 0
    while finished < num_requests:
        item = await asyncio.wait_for(client.get_output(), GUARD_S)
        if isinstance(item, RequestError):
            errors[item.request_id] = item
            finished += 1
            continue
        for out in item.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            finished += out.finished
    return tokens, errors


def _run(coro_fn, args: EngineArgs, factory=make_fake_engine, sigterm_grace_s=None):
    async def main():
        client = EngineCoreClient(args, factory, stats_interval_s=0.05,
                                  sigterm_grace_s=sigterm_grace_s)
        try:
            await asyncio.wait_for(client.start(), GUARD_S)
            return await coro_fn(client)
        finally:
            client.shutdown()
    return asyncio.run(main())


def test_outputs_match_the_in_process_engine():
    args = EngineArgs(model="fake", max_num_seqs=4)
    prompts = {f"r{i}": list(range(1, 5 + 3 * i)) for i in range(6)}

    async def body(client):
        assert client.ready.max_model_len == 128 and client.ready.num_gpu_blocks == 64
        for rid, p in prompts.items():
            await client.add_request(_req(rid, p, max_tokens=6 + (int(rid[1:]) % 3)))
        return await _collect(client, len(prompts))

    tokens, errors = _run(body, args)
    assert not errors
    local = make_fake_engine(args)
    for rid, p in prompts.items():
        local.add_request(_req(rid, p, max_tokens=6 + (int(rid[1:]) % 3)))
    expected: dict[str, list[int]] = {}
    while local.has_unfinished_requests():
        for out in local.step().outputs:
            expected.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens == expected


def test_admission_errors_come_back_per_request():
    args = EngineArgs(model="fake", max_num_seqs=1, max_num_queued_reqs=1)

    async def body(client):
        await client.add_request(_req("long", [1, 2, 3], max_tokens=100))
        first = await asyncio.wait_for(client.get_output(), GUARD_S)  # "long" is running
        assert isinstance(first, EngineCoreOutputs)
        await client.add_request(_req("too-long", list(range(1, 200))))
        await client.add_request(_req("queued", [4, 5, 6]))  # waits behind "long"
        await client.add_request(_req("overflow", [7, 8, 9]))  # the queue holds one: refused
        _, errors = await _collect(client, 4)
        return errors

    errors = _run(body, args, make_slow_fake_engine)
    assert set(errors) == {"too-long", "overflow"}
    assert errors["too-long"].kind == "admission"
    assert "max_model_len" in errors["too-long"].message
    assert errors["overflow"].kind == "queue_full"


def test_abort_frees_blocks_and_utilities_answer():
    async def body(client):
        await client.add_request(_req("a", list(range(1, 30)), max_tokens=100))
        await asyncio.wait_for(client.get_output(), GUARD_S)
        busy = await client.call_utility("get_stats", result_type=SchedulerStats)
        await client.abort_requests(["a"])
        # Inputs are handled in order, so this call runs after the abort.
        after = await client.call_utility("get_stats", result_type=SchedulerStats)
        ping = await client.call_utility("ping", result_type=PingResult)
        await client.call_utility("reset_prefix_cache")
        with pytest.raises(RuntimeError, match="unknown utility method 'shutdown'"):
            await client.call_utility("shutdown")
        return busy, after, ping

    busy, after, ping = _run(body, EngineArgs(model="fake"), make_slow_fake_engine)
    assert busy.num_running_reqs == 1 and busy.kv_cache_usage > 0
    assert after.num_running_reqs == 0 and after.kv_cache_usage == 0
    assert ping.num_unfinished_requests == 0 and ping.num_steps >= 1


def test_stats_snapshots_reach_the_client_and_show_the_drained_cache():
    async def body(client):
        for i in range(3):
            await client.add_request(_req(f"s{i}", [1, 2, 3, 4, 5], max_tokens=20))
        snapshots = []
        done = 0
        while done < 3 or snapshots[-1].num_running_reqs:
            item = await asyncio.wait_for(client.get_output(), GUARD_S)
            done += sum(o.finished for o in item.outputs)
            if item.scheduler_stats is not None:
                snapshots.append(item.scheduler_stats)
        return snapshots

    snapshots = _run(body, EngineArgs(model="fake"), make_slow_fake_engine)
    assert any(s.kv_cache_usage > 0 for s in snapshots)
    assert snapshots[-1].kv_cache_usage == 0 and snapshots[-1].num_running_reqs == 0
    assert sum(len(s.step_num_tokens) for s in snapshots) >= 20  # one entry per step
    assert all(n > 0 for s in snapshots for n in s.step_num_tokens)


def test_an_engine_busy_with_one_short_request_after_another_shows_it_running():
    # Each request (8 steps of 10 ms) finishes well within the stats interval (0.3 s), and the
    # next one comes right after: the snapshot that travels with each finish shows 0 running,
    # so the interval's snapshots must keep coming, and they find the next request running.
    async def body(client):
        snapshots = []
        deadline = time.monotonic() + 2.0
        i = 0
        while time.monotonic() < deadline:
            await client.add_request(_req(f"q{i}", [1, 2, 3], max_tokens=8))
            i += 1
            finished = False
            while not finished:
                item = await asyncio.wait_for(client.get_output(), GUARD_S)
                finished = any(o.finished for o in item.outputs)
                if item.scheduler_stats is not None and i > 1:  # the first found it idle
                    snapshots.append(item.scheduler_stats.num_running_reqs)
        return i, snapshots

    async def main():
        client = EngineCoreClient(EngineArgs(model="fake"), make_slow_fake_engine,
                                  stats_interval_s=0.3)
        try:
            await asyncio.wait_for(client.start(), GUARD_S)
            return await body(client)
        finally:
            client.shutdown()

    num_requests, snapshots = asyncio.run(main())
    assert num_requests >= 5  # several requests, each far shorter than the interval
    assert 0 in snapshots  # the finishes' snapshots
    assert max(snapshots) == 1  # ... and the interval's, with a request running


def test_idle_engine_does_not_spin():
    async def body(client):
        await client.add_request(_req("x", [1, 2, 3]))
        await _collect(client, 1)
        await asyncio.sleep(0.2)
        before = _cpu_seconds(client.pid)
        await asyncio.sleep(1.0)
        return _cpu_seconds(client.pid) - before

    # A busy-spinning loop would burn a whole second of CPU here.
    assert _run(body, EngineArgs(model="fake")) < 0.2


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_killed_engine_fails_waiting_callers_and_names_the_signal():
    async def body(client):
        await client.add_request(_req("k", [1, 2, 3], max_tokens=100))
        await asyncio.wait_for(client.get_output(), GUARD_S)
        os.kill(client.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            while True:
                await asyncio.wait_for(client.get_output(), GUARD_S)
        waited = time.monotonic() - t0
        with pytest.raises(EngineDeadError):
            await client.add_request(_req("late", [1]))
        with pytest.raises(EngineDeadError):
            await client.call_utility("ping")
        return waited

    _run(body, EngineArgs(model="fake"), make_slow_fake_engine)


def test_a_sigterm_under_a_grace_lets_the_request_finish_and_the_parent_stop_the_engine():
    """A signal to the whole process group: the engine keeps serving and the API process,
    which got it too, stops it when its drain ends."""
    async def body(client):
        await client.add_request(_req("t", [1, 2, 3], max_tokens=30))
        first = await asyncio.wait_for(client.get_output(), GUARD_S)
        os.kill(client.pid, signal.SIGTERM)
        tokens, errors = await _collect(client, 1)
        return first, tokens, errors, client.is_dead, client.proc

    first, tokens, errors, dead, proc = _run(body, EngineArgs(model="fake"),
                                             make_slow_fake_engine, sigterm_grace_s=60.0)
    got = sum(len(o.new_token_ids) for o in first.outputs) + len(tokens.get("t", []))
    assert not errors and not dead and got == 30
    assert proc.exitcode == 0  # shutdown() stopped it, well before the 60 s grace


def test_a_sigterm_to_the_engine_alone_ends_it_after_the_grace():
    async def body(client):
        await client.add_request(_req("t", [1, 2, 3], max_tokens=10_000))
        await asyncio.wait_for(client.get_output(), GUARD_S)
        os.kill(client.pid, signal.SIGTERM)
        t0 = time.monotonic()
        steps_after = 0
        with pytest.raises(EngineDeadError, match="exit code 0"):
            while True:
                item = await asyncio.wait_for(client.get_output(), GUARD_S)
                steps_after += len(item.outputs)
        return steps_after, time.monotonic() - t0

    steps_after, waited = _run(body, EngineArgs(model="fake"), make_slow_fake_engine,
                               sigterm_grace_s=1.0)
    assert steps_after > 0  # it went on stepping within the grace
    assert waited >= 0.9  # and did not exit before it


def test_engine_that_fails_to_start_reports_its_error():
    async def body(client):  # pragma: no cover - start() raises first
        raise AssertionError("the engine should not have started")

    with pytest.raises(EngineStartupError, match="weights not found"):
        _run(body, EngineArgs(model="fake"), make_failing_engine)
