"""``llmtower serve --headless``: a host that runs only its data-parallel engines.

It starts one engine process per local rank (``--data-parallel-start-rank R`` ..
``R + --data-parallel-size-local - 1``); each connects to the head's sockets for its rank
(``distributed/topology.py``) and to the process group's store there. The head may start before or after
this host. The host exits when its engines exit: when the head shuts them down, on SIGTERM /
Ctrl-C (it stops them first), or when one fails (the others are stopped too, so that a
supervisor restarts the whole host and it rejoins as one).
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import time
from typing import Any

from llmtower.engine.args import EngineArgs
from llmtower.engine.core_proc import EngineCoreProc, EngineFactory, default_engine_factory

logger = logging.getLogger(__name__)


def run_headless(engine_args: EngineArgs,
                 engine_factory: EngineFactory = default_engine_factory) -> int:
    """Run this host's engines until they stop; 0 when all of them exited cleanly."""
    topo = engine_args.topology()
    if not engine_args.headless:
        raise ValueError("run_headless needs headless=True")
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s [headless] %(message)s")
    threads = engine_args.num_threads or max(
        1, len(_cpus()) // topo.size_local)
    mp = multiprocessing.get_context("spawn")
    procs: dict[int, Any] = {}
    for rank in topo.local_ranks:
        args = dataclasses.replace(engine_args, data_parallel_rank=rank, num_threads=threads)
        p = mp.Process(target=EngineCoreProc.run_engine_core, name=f"EngineCore-{rank}",
                       args=(engine_factory, args, topo.input_address(rank),
                             topo.output_address(rank)))
        p.start()
        procs[rank] = p
    logger.info("ranks %s of %d started (pids %s), connecting to the head at %s:%d",
                list(topo.local_ranks), topo.size, [p.pid for p in procs.values()],
                topo.address, topo.rpc_port)
    stopping = False

    def _stop(_signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        while procs:
            if stopping:
                break
            for rank, p in list(procs.items()):
                if p.exitcode is None:
                    continue
                del procs[rank]
                if p.exitcode != 0:
                    logger.error("rank %d exited with code %s; stopping this host's other "
                                 "ranks", rank, p.exitcode)
                    code = 1
                    stopping = True
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()  # the engine takes SIGTERM as a clean stop
        for p in procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(2)
        for s, h in old.items():
            signal.signal(s, h)
    logger.info("headless host stopped")
    return code


def _cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return {0}
