"""OutputBox: one request's outputs reach its generate() loop in order, a waiting consumer
wakes on the next put, and a wait that times out (--request-timeout) loses nothing."""
from __future__ import annotations

import asyncio

import pytest

from llmtower.engine.output_box import OutputBox


def test_items_come_out_in_the_order_they_went_in():
    async def run():
        box = OutputBox()
        for i in range(5):
            box.put_nowait(i)
        return [await box.get() for _ in range(5)]

    assert asyncio.run(run()) == [0, 1, 2, 3, 4]


def test_a_waiting_consumer_wakes_on_the_next_put():
    async def run():
        box = OutputBox()
        got = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        assert not got.done()
        box.put_nowait("a")
        box.put_nowait(ValueError("b"))  # an exception is an item like any other
        return await got, await box.get()

    first, second = asyncio.run(run())
    assert first == "a" and isinstance(second, ValueError)


def test_a_timed_out_wait_loses_nothing():
    async def run():
        box = OutputBox()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(box.get(), 0.01)
        box.put_nowait("late")
        assert box.qsize() == 1
        return await asyncio.wait_for(box.get(), 1)

    assert asyncio.run(run()) == "late"


def test_the_sink_is_offered_an_item_only_while_the_consumer_waits_on_an_empty_box():
    """The direct lane's hook: what the sink takes never reaches get(); what it declines, or
    what comes while the consumer is busy or items wait, is queued in order."""
    async def run():
        box = OutputBox()
        offered: list[str] = []

        def sink(item):
            offered.append(item)
            return item.startswith("take")

        box.sink = sink
        box.put_nowait("early")  # nobody waits yet: queued, not offered
        assert await box.get() == "early"
        got = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)  # the consumer now waits on an empty box
        box.put_nowait("take-1")  # taken by the sink: the consumer keeps waiting
        await asyncio.sleep(0)
        assert not got.done()
        box.put_nowait("keep-2")  # declined: wakes the consumer
        box.put_nowait("take-3")  # an item waits: not offered, queued behind it
        return offered, await got, await box.get()

    offered, first, second = asyncio.run(run())
    assert offered == ["take-1", "keep-2"]
    assert (first, second) == ("keep-2", "take-3")
