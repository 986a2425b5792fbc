"""The head's end of an engine that runs on another host (``llmtower serve --headless``).

It is an ``EngineCoreClient`` without a process: it binds the rank's two TCP sockets (see
``distributed/topology.py``) and waits for that engine to connect and say READY. With no process
sentinel to watch, liveness comes from the engine's messages: every engine sends at least a
heartbeat a second, and one silent for ``dp_timeout`` seconds is dead for the head (its
requests fail with a retriable 503; the data-parallel client routes around it and waits for
the rank to come back). Sooner than silence, the TCP connection itself tells: a socket monitor
on the rank's output socket sees the engine's connection close (its process died, its host's
kernel reset it) and reports it at once (``on_disconnect``), so that the data-parallel client
stops routing to it and moves its un-started requests within milliseconds; a connection that
comes back (the same engine reconnecting) makes it eligible again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from llmtower.distributed.topology import DPTopology
from llmtower.engine.args import EngineArgs
from llmtower.engine.core_client import EngineCoreClient, EngineStartupError
from llmtower.engine.core_messages import EngineReady, InputTag

logger = logging.getLogger(__name__)

# How often the head re-asks a silent engine to shake hands while waiting for it: an engine
# that was already running (the head restarted) sends no READY of its own.
HANDSHAKE_RETRY_S = 1.0


class RemoteEngineClient(EngineCoreClient):
    """Owns the head's sockets for one remote rank and the watch on that engine's
    heartbeats."""

    def __init__(self, engine_args: EngineArgs, topology: DPTopology, rank: int) -> None:
        super().__init__(engine_args)
        self.topology = topology
        self.rank = rank
        self.silence_limit_s = engine_args.dp_timeout
        self._watchdog: asyncio.Task | None = None
        # The engine's TCP connections to the output socket (the monitor counts them), and
        # whom to tell when the last one closes after the handshake.
        self.num_connections = 0
        self.on_disconnect: Callable[[int], None] | None = None
        self._monitor: asyncio.Task | None = None
        self._monitor_sock: zmq.asyncio.Socket | None = None

    @property
    def disconnected(self) -> bool:
        """The engine had joined and its connection is gone (not back yet)."""
        return self.ready is not None and self._monitor is not None and self.num_connections <= 0

    @property
    def pid(self) -> int | None:
        return self.ready.pid if self.ready is not None else None

    async def start(self, timeout_s: float | None = None) -> EngineReady:
        """Bind the rank's sockets and wait for its engine (None: wait for ever)."""
        self._loop = asyncio.get_running_loop()
        try:
            self._open_sockets(self.topology.input_address(self.rank),
                               self.topology.output_address(self.rank))
        except zmq.ZMQError as e:
            self.shutdown()
            raise EngineStartupError(
                f"cannot listen for data-parallel rank {self.rank} on "
                f"{self.topology.input_address(self.rank)}: {e}; check "
                "--data-parallel-address (an address of this host) and --data-parallel-rpc-port"
            ) from None
        assert self._ready_future is not None
        self._watch_connection()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._ready_future.done():
            left = HANDSHAKE_RETRY_S if deadline is None else min(
                HANDSHAKE_RETRY_S, deadline - time.monotonic())
            if left <= 0:
                self.shutdown()
                raise EngineStartupError(
                    f"data-parallel rank {self.rank} did not arrive within {timeout_s:g} s: "
                    f"start `llmtower serve --headless --data-parallel-start-rank ...` on the "
                    f"host that runs it, pointing at --data-parallel-address "
                    f"{self.topology.address} --data-parallel-rpc-port {self.topology.rpc_port}")
            try:
                await asyncio.wait_for(asyncio.shield(self._ready_future), left)
            except asyncio.TimeoutError:
                self._ask_handshake()
        self.ready = self._ready_future.result()
        self.last_heard = time.monotonic()
        self._watchdog = self._loop.create_task(self._watch())
        logger.info("data-parallel rank %d joined from pid %d", self.rank, self.ready.pid)
        return self.ready

    def _ask_handshake(self) -> None:
        """An engine that is already up (the head restarted) answers this with READY data."""
        assert self._loop is not None
        task = self._loop.create_task(self._handshake_call())
        self._pending_sends.add(task)
        task.add_done_callback(self._pending_sends.discard)

    async def _handshake_call(self) -> None:
        try:
            ready = await self.call_utility("dp_handshake", result_type=EngineReady,
                                            timeout_s=HANDSHAKE_RETRY_S * 5)
        except Exception:
            return  # nobody there yet; the next round asks again
        if self._ready_future is not None and not self._ready_future.done():
            self._ready_future.set_result(ready)

    def _watch_connection(self) -> None:
        """Count the engine's connections to the output socket from its monitor's events."""
        assert self._out_sock is not None and self._loop is not None
        try:
            self._monitor_sock = self._out_sock.get_monitor_socket(
                zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        except zmq.ZMQError as e:  # heartbeats alone then
            logger.warning("no connection monitor for data-parallel rank %d: %s", self.rank, e)
            return
        self._monitor = self._loop.create_task(self._connection_events(self._monitor_sock))

    async def _connection_events(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while not self._closing:
                event = parse_monitor_message(await sock.recv_multipart())["event"]
                if event == zmq.EVENT_ACCEPTED:
                    self.num_connections += 1
                elif event == zmq.EVENT_DISCONNECTED:
                    self.num_connections -= 1
                    if self.disconnected and not self._closing and self.on_disconnect:
                        self.on_disconnect(self.rank)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass

    async def _watch(self) -> None:
        while not self.is_dead and not self._closing:
            await asyncio.sleep(min(1.0, self.silence_limit_s / 4))
            silent = time.monotonic() - self.last_heard
            if silent > self.silence_limit_s and not self._closing:
                self._mark_dead(f"data-parallel rank {self.rank} (pid {self.pid} on a remote "
                                f"host) has been silent for {silent:.1f} s")

    def begin_shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._stop_monitor()
        sock = self._in_sock
        if self.ready is not None and not self.is_dead and sock is not None and not sock.closed:
            try:  # the remote engine exits; its headless host exits when all of its do
                zmq.Socket.shadow(sock.underlying).send_multipart([InputTag.SHUTDOWN, b""],
                                                                  flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        if self._monitor_sock is not None:
            if self._out_sock is not None and not self._out_sock.closed:
                try:
                    self._out_sock.disable_monitor()
                except zmq.ZMQError:
                    pass
            self._monitor_sock.close(linger=0)
            self._monitor_sock = None

    def finish_shutdown(self, timeout_s: float = 5.0) -> None:
        if not self._closing:
            self.begin_shutdown()
        if self._in_sock is not None and not self._in_sock.closed:
            self._in_sock.close(linger=500)  # let the SHUTDOWN leave
        super().finish_shutdown(timeout_s)
