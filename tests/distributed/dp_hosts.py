"""Helpers for multi-host tests: free port ranges, a headless host in a child process with the
model-free engines, waiting on the head's view of its ranks."""
from __future__ import annotations

import asyncio
import multiprocessing
import random
import socket
import sys
import time

from llmtower.engine.headless import run_headless
from llmtower.engine.args import EngineArgs
from tests.engine.fake_engine_factory import make_slow_fake_engine


def free_port_range(count: int, host: str = "127.0.0.1") -> int:
    """A base port P such that P .. P+count-1 are free on ``host`` now."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - count)
        socks = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def _headless_main(args: EngineArgs) -> None:
    sys.exit(run_headless(args, make_slow_fake_engine))  # its exit code, as `llmtower serve`


def start_fake_headless(**kw) -> multiprocessing.process.BaseProcess:
    """A headless host (its own process, like another machine's) with fake engines."""
    args = EngineArgs(model="fake", headless=True, **kw)
    p = multiprocessing.get_context("spawn").Process(
        target=_headless_main, args=(args,), daemon=False)
    p.start()
    return p


async def wait_until(cond, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)
