"""DPEngineCoreClient's liveness and drain decisions with stand-in engines (no processes):
quiet engines get no new request, a lost engine's un-started requests are re-sent and its
started ones fail retriably, a late output from an engine a request left is dropped,
``mark_rank_lost`` / ``mark_rank_back``, drain refusals."""
from __future__ import annotations

import asyncio
import time

import pytest

from llmtower.core.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core_messages import RequestError
from llmtower.engine.dp_client import ENGINE_LOST, DPEngineCoreClient


class StandIn:
    """An engine client that records what it is sent and yields what the test feeds it."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.aborted: list[str] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.last_heard = time.monotonic()
        self.ready = object()

    async def add_request(self, request: EngineCoreRequest) -> None:
        self.sent.append(request.request_id)

    def abort_requests_nowait(self, ids: list[str]) -> None:
        self.aborted.extend(ids)

    async def get_output(self):
        return await self.queue.get()

    async def call_utility(self, *args, **kwargs):  # noqa: ARG002 - the real signature
        return None


def dp(n: int) -> tuple[DPEngineCoreClient, list[StandIn]]:
    c = DPEngineCoreClient(EngineArgs(model="fake", data_parallel_size=n))
    fakes = [StandIn() for _ in range(n)]
    c.clients = fakes  # type: ignore[assignment]
    return c, fakes


def req(rid: str) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4))


def out(rid: str, *tokens: int) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(rid, list(tokens))])


def test_a_quiet_engine_gets_no_new_request_unless_all_are_quiet():
    c, fakes = dp(3)
    fakes[1].last_heard -= 10  # silent for 10 s: more than 2.5 heartbeats
    assert {c._assign(f"r{i}") for i in range(6)} == {0, 2}
    for f in fakes:
        f.last_heard -= 10
    assert {c._assign(f"q{i}") for i in range(6)} == {0, 1, 2}  # better than refusing


def test_loss_resends_unstarted_fails_started_and_drops_late_outputs():
    async def main():
        c, fakes = dp(2)
        loop = asyncio.get_running_loop()
        c._forwarders = {i: loop.create_task(c._forward(i)) for i in range(2)}
        for rid in ("a", "b", "c"):  # in turn: a, c on engine 0; b on engine 1
            await c.add_request(req(rid))
        await asyncio.sleep(0)
        assert [c.engine_of(r) for r in "abc"] == [0, 1, 0] and fakes[0].sent == ["a", "c"]
        fakes[0].queue.put_nowait(out("a", 7))  # "a" has started streaming, "c" has not
        assert (await c.get_output()).outputs[0].request_id == "a"
        c.mark_rank_lost(0, "its host went away")
        c.mark_rank_lost(0, "again")  # a second report changes nothing
        err = await c.get_output()
        assert isinstance(err, RequestError) and err.request_id == "a"
        assert err.kind == ENGINE_LOST and "its host went away" in err.message
        await asyncio.sleep(0)
        assert c.engine_of("c") == 1 and fakes[1].sent == ["b", "c"] and c.num_retried == 1
        # "c" answered by its new engine; nothing more comes from the lost one's forwarder.
        fakes[1].queue.put_nowait(out("c", 5))
        got = await c.get_output()
        assert got.engine_index == 1 and [o.request_id for o in got.outputs] == ["c"]
        assert c.health()["lost_ranks"] == {"0": "its host went away"}
        assert c.mark_rank_back(0) and c.live_ranks == [0, 1] and not c.mark_rank_back(0)
        # A late output of a request that left engine 0 is dropped.
        fakes[0].queue.put_nowait(out("c", 9))
        fakes[1].queue.put_nowait(out("b", 4))
        got = await c.get_output()
        assert got.engine_index == 1 and [o.request_id for o in got.outputs] == ["b"]
        assert c._outputs.empty()
        c._closing = True
        for t in [*c._forwarders.values(), *c._background]:
            t.cancel()
    asyncio.run(main())


def test_drain_moves_unstarted_requests_and_refuses_the_last_engine():
    async def main():
        c, fakes = dp(2)
        for rid in ("a", "b", "c"):
            await c.add_request(req(rid))
        await asyncio.sleep(0)
        st = c.drain(0)
        await asyncio.sleep(0)
        assert st["moved"] == 2 and st["drained"] and fakes[0].aborted == ["a", "c"]
        assert [c.engine_of(r) for r in "abc"] == [1, 1, 1] and fakes[1].sent == ["b", "a", "c"]
        with pytest.raises(ValueError, match="cannot drain engine 1: no other engine"):
            c.drain(1)
        with pytest.raises(ValueError, match="engine_id=5 does not exist"):
            c.drain(5)
        assert c.health()["draining_ranks"] == [0]
        assert not c.undrain(0)["draining"] and c.health()["draining_ranks"] == []
        for t in c._background:
            t.cancel()
    asyncio.run(main())
