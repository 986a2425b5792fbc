"""EngineCoreClient: the API process's end of the engine process (asyncio + zmq.asyncio).

It starts ``EngineCoreProc`` with multiprocessing (spawn), binds the two ipc:// sockets in a
private temporary directory, waits for the READY handshake, then sends requests, aborts and
utility calls and receives outputs. It watches the process sentinel on the event loop, so an
engine that dies — crash, OOM kill, ``kill -9`` — is noticed at once: waiting callers get
``EngineDeadError`` (HTTP 503) and the exit code or signal is logged.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import shutil
import signal
import tempfile
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest
from llmtower.distributed.dp_group import DPEvent
from llmtower.engine.args import EngineArgs
from llmtower.engine.core_messages import (EngineDead, EngineReady, InputTag, OutputTag,
                                           RequestError, UtilityCall, UtilityResult)
from llmtower.engine.core_proc import EngineCoreProc, EngineFactory, default_engine_factory
from llmtower.executor.memory_bounds import bound_native_caches

logger = logging.getLogger(__name__)

# Typed decoders: msgspec validates each message against its struct while decoding.
_DECODE_OUTPUTS = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
_DECODE_ERROR = msgspec.msgpack.Decoder(RequestError).decode
_DECODE_UTILITY = msgspec.msgpack.Decoder(UtilityResult).decode
_DECODE_READY = msgspec.msgpack.Decoder(EngineReady).decode
_DECODE_DEAD = msgspec.msgpack.Decoder(EngineDead).decode
_DECODE_DP_EVENT = msgspec.msgpack.Decoder(DPEvent).decode


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing can be served until the server restarts (HTTP 503)."""


class EngineLostError(EngineDeadError):
    """One data-parallel engine was lost while serving the request; the others still serve,
    so the client may retry (HTTP 503 with Retry-After)."""


class EngineStartupError(RuntimeError):
    """The engine process failed to start (its own error is in the message)."""


def describe_exit(exitcode: int | None) -> str:
    """'exit code 1', 'killed by signal SIGKILL', ... for a multiprocessing exit code."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class EngineCoreClient:
    """Owns the engine process, the two sockets to it, the futures of pending utility calls,
    and the knowledge of whether the engine is alive."""

    def __init__(self, engine_args: EngineArgs,
                 engine_factory: EngineFactory = default_engine_factory,
                 stats_interval_s: float = 0.5, sigterm_grace_s: float | None = None) -> None:
        self.engine_args = engine_args
        self.engine_factory = engine_factory
        self.stats_interval_s = stats_interval_s
        self.sigterm_grace_s = sigterm_grace_s  # EngineCoreProc.run_engine_core's
        self.ready: EngineReady | None = None
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.dead_reason: str | None = None  # set once the engine is known to be dead
        self._engine_error: str | None = None  # the DEAD message's reason, if one came
        self._ipc_dir: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._in_sock: zmq.asyncio.Socket | None = None
        self._out_sock: zmq.asyncio.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue = asyncio.Queue()
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._ready_future: asyncio.Future[EngineReady] | None = None
        self._recv_task: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._closing = False
        self._finished = False
        self._pending_sends: set[asyncio.Task] = set()
        self.last_heard = time.monotonic()  # the engine's last message (heartbeats included)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # ------------------------------------------------------------------ start
    async def start(self, timeout_s: float | None = None) -> EngineReady:
        """Start the engine process and wait for its handshake (model loaded, KV cache sized).
        Raises EngineStartupError with the engine's own error if it fails to start."""
        self._loop = asyncio.get_running_loop()
        self._ipc_dir = tempfile.mkdtemp(prefix="llmtower-ipc-")
        input_address = f"ipc://{self._ipc_dir}/input.sock"
        output_address = f"ipc://{self._ipc_dir}/output.sock"
        self._open_sockets(input_address, output_address)
        # Before the engine process exists, so that it inherits the caps (memory_bounds.py).
        bound_native_caches()
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(
            target=EngineCoreProc.run_engine_core, name="EngineCore",
            args=(self.engine_factory, self.engine_args, input_address, output_address,
                  self.stats_interval_s, self.sigterm_grace_s), daemon=True)
        self.proc.start()
        logger.info("engine core process started (pid %d)", self.proc.pid)
        self._loop.add_reader(self.proc.sentinel, self._on_process_exit)
        assert self._ready_future is not None  # made by _open_sockets
        try:
            ready = await asyncio.wait_for(asyncio.shield(self._ready_future), timeout_s)
        except EngineDeadError as e:
            self.shutdown()
            raise EngineStartupError(f"the engine failed to start: {e}") from None
        except asyncio.TimeoutError:
            self.shutdown()
            raise EngineStartupError(f"the engine did not start within {timeout_s} s") from None
        self.ready = ready
        return ready

    def _open_sockets(self, input_address: str, output_address: str) -> None:
        """Bind both sockets (the engine connects) and start receiving."""
        assert self._loop is not None
        self._ctx = zmq.asyncio.Context()
        self._in_sock = self._ctx.socket(zmq.PUSH)
        self._in_sock.setsockopt(zmq.LINGER, 0)
        self._in_sock.bind(input_address)
        self._out_sock = self._ctx.socket(zmq.PULL)
        self._out_sock.setsockopt(zmq.LINGER, 0)
        self._out_sock.bind(output_address)
        self._ready_future = self._loop.create_future()
        self._recv_task = self._loop.create_task(self._recv_loop())

    # ------------------------------------------------------------------ send
    async def add_request(self, request: EngineCoreRequest) -> None:
        await self._send(InputTag.ADD, request)

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.is_dead:
            await self._send(InputTag.ABORT, list(request_ids))

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """Abort without awaiting, for cleanup paths that cannot await (a cancelled task, a
        closing generator). A PUSH socket below its high-water mark sends at once."""
        if not request_ids or self.is_dead or self._closing or self._in_sock is None:
            return
        # zmq.asyncio reports a NOBLOCK failure (queue full) in the returned future
        # (ensure_future returns that very future; pyzmq's stubs only promise an Awaitable).
        fut = asyncio.ensure_future(self._in_sock.send_multipart(
            [InputTag.ABORT, self._encoder.encode(list(request_ids))], flags=zmq.NOBLOCK))
        if not fut.done() or fut.exception() is not None:
            fut.cancel()
            assert self._loop is not None  # send when the queue drains
            task = self._loop.create_task(self.abort_requests(list(request_ids)))
            self._pending_sends.add(task)
            task.add_done_callback(self._pending_sends.discard)

    async def call_utility(self, method: str, *args: Any, result_type: Any = Any,
                           timeout_s: float | None = None) -> Any:
        """Run ``method(*args)`` in the engine between two steps and return its result,
        decoded as ``result_type``. Raises EngineDeadError, TimeoutError or RuntimeError
        (the engine-side error)."""
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut = self._loop.create_future()
        self._utility_futures[call_id] = fut
        try:
            await self._send(InputTag.UTILITY, UtilityCall(call_id, method, list(args)))
            result: UtilityResult = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._utility_futures.pop(call_id, None)
        if result.error is not None:
            raise RuntimeError(f"engine utility {method!r} failed: {result.error}")
        return msgspec.msgpack.decode(result.result, type=result_type)

    async def _send(self, tag: bytes, msg: Any) -> None:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        assert self._in_sock is not None
        await self._in_sock.send_multipart([tag, self._encoder.encode(msg)], copy=False)

    # ------------------------------------------------------------------ receive
    async def get_output(self) -> EngineCoreOutputs | RequestError | DPEvent:
        """The next step's outputs (or a request refused at admission), in engine order.
        Raises EngineDeadError once the engine is gone."""
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put_nowait(item)  # every later caller fails the same way
            raise item
        return item

    async def _recv_loop(self) -> None:
        assert self._out_sock is not None
        while True:
            try:
                tag, payload = await self._out_sock.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self.last_heard = time.monotonic()
            try:
                self._dispatch(tag, payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                # A message we cannot read is a bug on one side; losing it silently would
                # leave a caller waiting forever, so the engine is treated as broken.
                logger.error("undecodable %r message from the engine: %s", tag, e)
                self._mark_dead(f"the engine sent an undecodable {tag!r} message: {e}")

    def _dispatch(self, tag: bytes, payload: bytes) -> None:
        if tag == OutputTag.OUTPUTS:
            self._outputs.put_nowait(_DECODE_OUTPUTS(payload))
        elif tag == OutputTag.REQUEST_ERROR:
            self._outputs.put_nowait(_DECODE_ERROR(payload))
        elif tag == OutputTag.UTILITY_RESULT:
            res = _DECODE_UTILITY(payload)
            fut = self._utility_futures.get(res.call_id)
            if fut is not None and not fut.done():
                fut.set_result(res)
        elif tag == OutputTag.READY:
            ready = _DECODE_READY(payload)
            if self._ready_future is not None and not self._ready_future.done():
                self._ready_future.set_result(ready)
        elif tag == OutputTag.DP_EVENT:  # for the data-parallel client, in stream order
            self._outputs.put_nowait(_DECODE_DP_EVENT(payload))
        elif tag == OutputTag.DEAD:
            self._engine_error = _DECODE_DEAD(payload).reason
            logger.error("the engine reported a fatal error:\n%s", self._engine_error)

    # ------------------------------------------------------------------ death and shutdown
    def _on_process_exit(self) -> None:
        assert self._loop is not None and self.proc is not None
        self._loop.remove_reader(self.proc.sentinel)
        self.proc.join(timeout=1)
        if self._closing:
            return
        cause = describe_exit(self.proc.exitcode)
        reason = f"the engine process (pid {self.proc.pid}) died: {cause}"
        if self._engine_error:
            reason += f"; engine error: {self._engine_error.splitlines()[0]}"
        self._mark_dead(reason)

    async def call_utility_on(self, engine_index: int, method: str, *args: Any,
                              result_type: Any = Any, timeout_s: float | None = None) -> Any:
        """EngineClient.call_utility_on: there is one engine, index 0."""
        if engine_index != 0:
            raise ValueError(f"engine_id={engine_index} does not exist: this server runs "
                             "1 engine(s), 0..0")
        return await self.call_utility(method, *args, result_type=result_type,
                                       timeout_s=timeout_s)

    def engine_of(self, request_id: str) -> int | None:  # noqa: ARG002 - EngineClient's signature
        """EngineClient.engine_of: one engine serves everything (rank 0)."""
        return 0

    def health(self) -> dict[str, Any] | None:
        """EngineClient.health: one engine, nothing to add to "alive"."""
        return None

    async def data_parallel_view(self, timeout_s: float | None = None  # noqa: ARG002
                                 ) -> dict[str, Any] | None:
        """EngineClient.data_parallel_view: one engine is not data parallel."""
        return None

    def set_draining(self, engine_index: int, draining: bool  # noqa: ARG002
                     ) -> dict[str, Any] | None:
        """EngineClient.set_draining: one engine has no other to drain to."""
        return None

    def mark_dead(self, reason: str) -> None:
        """EngineClient.mark_dead: the front end declares the engine unusable."""
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if self.is_dead:
            return
        self.dead_reason = reason
        logger.error("%s", reason)
        err = EngineDeadError(reason)
        for fut in self._utility_futures.values():
            if not fut.done():
                fut.set_exception(err)
        if self._ready_future is not None and not self._ready_future.done():
            self._ready_future.set_exception(err)
        self._outputs.put_nowait(err)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine (politely, then by force), close the sockets, remove the ipc dir.
        Safe to call more than once and from a finally block."""
        self.begin_shutdown()
        self.finish_shutdown(timeout_s)

    def begin_shutdown(self) -> None:
        """Ask the engine to stop, without waiting (DP: every engine is asked first)."""
        if self._closing:
            return
        self._closing = True
        proc = self.proc
        if proc is None:
            return
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(proc.sentinel)
            except (ValueError, OSError, RuntimeError):
                pass
        if proc.is_alive() and self._in_sock is not None and not self._in_sock.closed:
            # A plain (blocking-API) send on the same socket: zmq.asyncio would report a full
            # queue (zmq.Again) in a future nobody reads, printed as a traceback at exit.
            try:
                zmq.Socket.shadow(self._in_sock.underlying).send_multipart(
                    [InputTag.SHUTDOWN, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # queue full or socket gone: the engine is terminated below instead

    def finish_shutdown(self, timeout_s: float = 5.0) -> None:
        """Wait for the engine to exit (else terminate, then kill it); close the sockets."""
        if not self._closing:
            self.begin_shutdown()
        if self._finished:
            return
        self._finished = True
        proc = self.proc
        if proc is not None and proc.pid is not None:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        if self._recv_task is not None:
            self._recv_task.cancel()
        for task in list(self._pending_sends):
            task.cancel()
        for sock in (self._in_sock, self._out_sock):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if not self.is_dead:
            self.dead_reason = "the engine was shut down"
