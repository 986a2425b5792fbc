"""EngineCoreProc: the EngineCore busy loop in its own process, talking ZMQ to its client.

Three threads, one job each:
  - the input thread receives from the input socket, decodes (msgspec) and puts messages on
    ``input_queue``;
  - the busy loop (main thread) takes messages off that queue, then steps the engine, and puts
    what it produced on ``output_queue`` — it never touches a socket or a byte string;
  - the output thread takes from ``output_queue``, encodes and sends.
When no request is unfinished the loop blocks on ``input_queue``: an idle engine costs nothing.

The process is started by ``EngineCoreClient`` with ``multiprocessing`` (spawn) and gets an
``engine_factory`` — any picklable ``(EngineArgs) -> EngineCore`` function — so tests can run
the whole process machinery with a model-free engine.
"""
from __future__ import annotations

import functools
import gc
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from llmtower.distributed.dp_group import DPGroup
from llmtower.engine.args import EngineArgs
from llmtower.engine.core_messages import (UTILITY_METHODS, EngineDead, EngineReady, InputTag,
                                           OutputTag, PingResult, RequestError, UtilityCall,
                                           UtilityResult)

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # the model's modules (torch) load in the engine process, not in the API's
    from llmtower.engine.core import EngineCore

EngineFactory = Callable[[EngineArgs], "EngineCore"]

# How often the input thread wakes up to check that the parent (API) process is still alive.
PARENT_POLL_MS = 1000
# The output thread sends a heartbeat after this long without sending anything: a head on
# another host has no process handle to watch, only this.
HEARTBEAT_S = 1.0
# An engine that has no work but takes part in a data-parallel wave polls its input this often.
DP_IDLE_POLL_S = 0.002
# How long the queue must stay empty before the drained snapshot goes out. Clients that send
# their next request right after the last one finished leave gaps of a few milliseconds; a
# snapshot in each gap would show the gauges at 0 most of the time on a busy server.
IDLE_SNAPSHOT_DELAY_S = 0.25
_STOP = object()  # tells the output thread to flush and exit
_DEFERRED = object()  # a utility answered later (a coordinated operation waiting for its step)


class _RUN_NOW:  # a marker: run this utility call now
    def __init__(self, call: UtilityCall) -> None:
        self.call = call


def default_engine_factory(engine_args: EngineArgs) -> EngineCore:
    """The real engine: model, executor and scheduler built from the engine arguments."""
    from llmtower.engine.factory import create_engine_core
    return create_engine_core(engine_args)


class EngineCoreProc:
    """Owns one EngineCore inside the engine process, the busy loop that steps it, and the
    two queues through which the socket threads feed it and drain it."""

    def __init__(self, engine_core: EngineCore, stats_interval_s: float = 0.5,
                 dp: DPGroup | None = None) -> None:
        self.engine_core = engine_core
        self.dp = dp  # this engine's place in the data-parallel group, if it has one
        self.engine_args: EngineArgs | None = None  # for the handshake of a returning head
        self.stats_interval_s = stats_interval_s
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self._shutdown = False
        # Per-step figures since the last stats snapshot (for the per-iteration histograms).
        self._step_num_tokens: list[int] = []
        self._step_seconds: list[float] = []
        self._step_schedule_seconds: list[float] = []  # schedule() alone, every step
        self._stats_dirty = False
        self._last_stats_time = 0.0

    # ------------------------------------------------------------------ process entry point
    @staticmethod
    def run_engine_core(engine_factory: EngineFactory, engine_args: EngineArgs,
                        input_address: str, output_address: str,
                        stats_interval_s: float = 0.5,
                        sigterm_grace_s: float | None = None) -> None:
        """Target of the engine process: build the engine, shake hands, run the busy loop.

        Exits 0 after a SHUTDOWN message (or when the parent process is gone) and 1 after a
        failure, which is first reported to the client as a DEAD message with the traceback.
        A SIGTERM exits 0 at once, or, with ``sigterm_grace_s``, only after that many seconds
        while the parent lives (see ``_defer_sigterm``).
        """
        # Ctrl-C reaches the whole process group; the API server decides when we stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _raise_system_exit if sigterm_grace_s is None
                      else functools.partial(_defer_sigterm, sigterm_grace_s))
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s [engine] %(message)s")
        ctx = zmq.Context()
        out_sock = ctx.socket(zmq.PUSH)
        out_sock.setsockopt(zmq.LINGER, 2000)
        out_sock.connect(output_address)
        in_sock = ctx.socket(zmq.PULL)
        in_sock.setsockopt(zmq.LINGER, 0)
        in_sock.connect(input_address)
        proc: EngineCoreProc | None = None
        out_thread: threading.Thread | None = None
        in_thread: threading.Thread | None = None
        exit_code = 0
        try:
            engine_core = engine_factory(engine_args)
            dp_config = engine_args.dp_group_config()
            proc = EngineCoreProc(engine_core, stats_interval_s,
                                  DPGroup(dp_config) if dp_config is not None else None)
            proc.engine_args = engine_args
            # The model and the imports live as long as the process: freeze them so the
            # collector's full passes, triggered by per-step garbage, stop walking them.
            gc.collect()
            gc.freeze()
            out_thread = threading.Thread(target=proc._output_thread, args=(out_sock,),
                                          name="engine-output", daemon=True)
            out_thread.start()
            in_thread = threading.Thread(target=proc._input_thread, args=(in_sock,),
                                         name="engine-input", daemon=True)
            in_thread.start()
            proc.output_queue.put((OutputTag.READY, _handshake(engine_core, engine_args)))
            proc.run_busy_loop()
        except SystemExit:
            pass
        except BaseException as e:  # report anything, even a KeyboardInterrupt, before dying
            exit_code = 1
            reason = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            logger.error("engine core failed: %s: %s", type(e).__name__, e)
            if out_thread is not None and proc is not None:
                proc.output_queue.put((OutputTag.DEAD, EngineDead(reason)))
            else:  # failed before the output thread existed: send from here
                out_sock.send_multipart([OutputTag.DEAD,
                                         msgspec.msgpack.encode(EngineDead(reason))])
        finally:
            if proc is not None:
                proc.output_queue.put(_STOP)
                if out_thread is not None:
                    out_thread.join(timeout=5)
                try:
                    proc.engine_core.shutdown()
                except Exception:
                    logger.exception("engine shutdown failed")
            if in_thread is None:
                in_sock.close()  # otherwise the input thread owns it and closes it on ETERM
            out_sock.close()  # waits up to LINGER for queued messages (the DEAD one) to leave
            ctx.term()
        os._exit(exit_code)  # daemon threads may still block in recv: do not wait for them

    # ------------------------------------------------------------------ the busy loop
    def run_busy_loop(self) -> None:
        """Take inputs, step, emit — until SHUTDOWN. Blocks on the input queue when idle."""
        engine_core = self.engine_core
        while not self._shutdown:
            self._process_input_queue()
            if self._shutdown:
                continue
            if not engine_core.has_unfinished_requests():
                if self.dp is not None and self.dp.idle_in_wave:
                    self._dp_idle_poll()
                continue
            t0 = time.perf_counter()
            outputs = engine_core.step()
            self._record_step(time.perf_counter() - t0)
            now = time.monotonic()
            # The counters a finished request moved (prefix-cache hits, accepted draft tokens,
            # ...) travel with its last output, so /metrics shows them as soon as the client
            # has its answer; otherwise a snapshot per stats interval. A finish does not put
            # the interval's snapshot off: taken just after a finish, a snapshot shows that
            # request gone, so an engine that always finished one request within the
            # interval would show 0 running requests however busy it was.
            if now - self._last_stats_time >= self.stats_interval_s:
                outputs.scheduler_stats = self._take_stats()
                self._last_stats_time = now
            elif any(o.finish_reason is not None for o in outputs.outputs):
                outputs.scheduler_stats = self._take_stats()
            if outputs.outputs or outputs.scheduler_stats is not None or outputs.request_errors:
                if not outputs.timestamp:
                    outputs.timestamp = now
                self.output_queue.put((OutputTag.OUTPUTS, outputs))
            if self.dp is not None:
                self._dp_tick(stepped=True)

    # ------------------------------------------------------------------ data parallelism
    def _dp_row(self) -> list[int]:
        sched = self.engine_core.scheduler
        return [int(self.engine_core.has_unfinished_requests()), len(sched.waiting),
                len(sched.running), sched.kv.pool.num_free_blocks, self._num_steps()]

    def _dp_tick(self, stepped: bool) -> None:
        assert self.dp is not None
        for event in self.dp.tick(self._dp_row(), stepped):
            self.output_queue.put((OutputTag.DP_EVENT, event))
        for call in self.dp.take_ready_ops():
            self._run_utility(call)  # type: ignore[arg-type]

    def _dp_idle_poll(self) -> None:
        """No work here, but the wave goes on elsewhere: take part in its collectives while
        waiting briefly for input (a request, an abort, the wave's end)."""
        try:
            self._handle(*self.input_queue.get(timeout=DP_IDLE_POLL_S))
        except queue.Empty:
            pass
        if not self._shutdown:
            self._dp_tick(stepped=False)

    def _dp_utility(self, call: UtilityCall) -> Any:
        method, args = call.method, call.args
        dp = self.dp
        if dp is None:
            raise ValueError("this engine is not part of a data-parallel group")
        if method == "dp_set_membership":
            epoch, members = args
            dp.set_membership(int(epoch), [int(r) for r in members])
            # Work that arrived while it was alone: start the group's first wave with it.
            self._dp_tick(stepped=False)
        elif method == "dp_coordinated":
            # args: op id, then the utility to run at the step boundary all engines share
            op_id, inner, inner_args = int(args[0]), str(args[1]), list(args[2])
            if inner not in UTILITY_METHODS or inner.startswith("dp_"):
                raise ValueError(f"{inner!r} cannot run as a coordinated operation")
            inner_call = UtilityCall(call.call_id, inner, inner_args)
            if dp.schedule_op(op_id, inner_call):
                return _RUN_NOW(inner_call)
            return _DEFERRED
        elif method == "dp_start_wave":
            dp.start_wave(int(args[0]))
        elif method == "dp_handshake":
            # A (re)started head: whatever this engine still runs belongs to the old one.
            sched = self.engine_core.scheduler
            self.engine_core.abort_requests(list(sched.requests))
            self._stats_dirty = True
            assert self.engine_args is not None
            return _handshake(self.engine_core, self.engine_args)
        return dp.status()

    def _process_input_queue(self) -> None:
        q = self.input_queue
        idle_in_wave = self.dp is not None and self.dp.idle_in_wave
        if not self.engine_core.has_unfinished_requests() and q.empty() and not idle_in_wave:
            # Going idle: one last snapshot so the client sees the drained state (KV usage 0),
            # unless the next request comes at once.
            item = None
            if self._stats_dirty:
                try:
                    item = q.get(timeout=IDLE_SNAPSHOT_DELAY_S)
                except queue.Empty:
                    self.output_queue.put((OutputTag.OUTPUTS, EngineCoreOutputs(
                        scheduler_stats=self._take_stats(),
                        timestamp=time.monotonic())))
            self._handle(*(item if item is not None else q.get()))
        while not q.empty() and not self._shutdown:
            self._handle(*q.get_nowait())

    def _handle(self, tag: bytes, msg: Any) -> None:
        if tag == InputTag.ADD:
            self._add_request(msg)
        elif tag == InputTag.ABORT:
            self.engine_core.abort_requests(msg)
            self._stats_dirty = True
        elif tag == InputTag.UTILITY:
            self._call_utility(msg)
        elif tag == InputTag.SHUTDOWN:
            self._shutdown = True
        elif tag == OutputTag.REQUEST_ERROR:  # a request the input thread could not decode
            self.output_queue.put((tag, msg))

    def _add_request(self, req: EngineCoreRequest) -> None:
        try:
            self.engine_core.add_request(req)
        except QueueFullError as e:
            self._reject(req.request_id, "queue_full", str(e))
        except AdmissionError as e:
            self._reject(req.request_id, "admission", str(e))
        except ValueError as e:
            self._reject(req.request_id, "invalid", str(e))

    def _reject(self, request_id: str, kind: str, message: str) -> None:
        self._stats_dirty = True
        self.output_queue.put((OutputTag.REQUEST_ERROR, RequestError(request_id, kind, message)))

    def _call_utility(self, call: UtilityCall) -> None:
        if call.method.startswith("dp_") and call.method in UTILITY_METHODS:
            try:
                result = self._dp_utility(call)
            except Exception as e:
                return self._answer(call, None, f"{type(e).__name__}: {e}")
            if result is _DEFERRED:  # answered when the operation runs
                return
            if isinstance(result, _RUN_NOW):
                return self._run_utility(result.call)
            return self._answer(call, result, None)
        self._run_utility(call)

    def _run_utility(self, call: UtilityCall) -> None:
        try:
            if call.method not in UTILITY_METHODS:
                raise ValueError(f"unknown utility method {call.method!r}; "
                                 f"known: {sorted(UTILITY_METHODS)}")
            if call.method == "ping":
                result: Any = PingResult(self._num_steps(), _num_unfinished(self.engine_core))
            elif call.method == "get_stats":
                result = self.engine_core.get_stats()
            else:
                result = getattr(self.engine_core, call.method)(*call.args)
        except Exception as e:
            return self._answer(call, None, f"{type(e).__name__}: {e}")
        self._answer(call, result, None)

    def _answer(self, call: UtilityCall, result: Any, error: str | None) -> None:
        # Encoded by the output thread, like everything else that leaves the loop.
        self.output_queue.put((OutputTag.UTILITY_RESULT, (call.call_id, result, error)))

    # ------------------------------------------------------------------ stats
    def _record_step(self, seconds: float) -> None:
        self._stats_dirty = True
        self._step_schedule_seconds.append(self.engine_core.last_schedule_seconds)
        num_tokens = _last_step_num_tokens(self.engine_core)
        if num_tokens:  # a step that scheduled nothing ran no forward pass
            self._step_seconds.append(seconds)
            self._step_num_tokens.append(num_tokens)

    def _take_stats(self) -> SchedulerStats:
        stats = self.engine_core.get_stats()
        stats.step_num_tokens, self._step_num_tokens = self._step_num_tokens, []
        stats.step_seconds, self._step_seconds = self._step_seconds, []
        stats.step_schedule_seconds, self._step_schedule_seconds = self._step_schedule_seconds, []
        # Requests (and other messages) received but not yet taken in by the busy loop.
        stats.input_queue_size = self.input_queue.qsize()
        self._stats_dirty = False
        return stats

    def _num_steps(self) -> int:
        return self.engine_core.get_stats().num_steps

    # ------------------------------------------------------------------ socket threads
    def _input_thread(self, sock: zmq.Socket) -> None:
        decoders: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
            InputTag.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
            InputTag.ABORT: msgspec.msgpack.Decoder(list[str]),
            InputTag.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
        }
        parent = multiprocessing.parent_process()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while True:
                if not poller.poll(PARENT_POLL_MS):
                    if parent is not None and not parent.is_alive():
                        logger.warning("the API process is gone; shutting the engine down")
                        self.input_queue.put((InputTag.SHUTDOWN, None))
                        return
                    continue
                tag_frame, payload = sock.recv_multipart(copy=False)
                tag = tag_frame.bytes
                if tag == InputTag.SHUTDOWN:
                    self.input_queue.put((tag, None))
                    return
                try:
                    msg = decoders[tag].decode(payload.buffer)
                except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as e:
                    self._report_undecodable(tag, payload.bytes, e)
                    continue
                self.input_queue.put((tag, msg))
        except zmq.ZMQError:
            pass  # the context is being terminated at shutdown
        finally:
            sock.close()

    def _report_undecodable(self, tag: bytes, payload: bytes, error: Exception) -> None:
        logger.error("cannot decode a %r message: %s", tag, error)
        if tag != InputTag.ADD:
            return
        try:  # EngineCoreRequest is array-like: its first field is the request id
            request_id = str(msgspec.msgpack.decode(payload)[0])
        except Exception:
            return
        self.input_queue.put((OutputTag.REQUEST_ERROR,
                              RequestError(request_id, "invalid", f"invalid request: {error}")))

    def _output_thread(self, sock: zmq.Socket) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            try:
                item = self.output_queue.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                sock.send_multipart([OutputTag.HEARTBEAT, b""])
                continue
            if item is _STOP:
                return
            tag, msg = item
            if tag == OutputTag.UTILITY_RESULT:
                call_id, result, error = msg
                msg = UtilityResult(call_id, error=error) if error is not None else \
                    UtilityResult(call_id, msgspec.Raw(encoder.encode(result)))
            sock.send_multipart([tag, encoder.encode(msg)], copy=False)


def _handshake(engine_core: EngineCore, engine_args: EngineArgs) -> EngineReady:
    sched = engine_core.scheduler
    info = engine_core.model_info  # None for engines without a real model (tests)
    return EngineReady(
        pid=os.getpid(),
        model_name=engine_args.served_model_names[0],
        model_path=str(info.model_path if info else engine_args.model),
        max_model_len=int(info.max_model_len if info else sched.config.max_model_len),
        num_gpu_blocks=sched.cache_config.num_blocks,
        block_size=sched.cache_config.block_size,
        max_num_seqs=sched.config.max_num_seqs,
        max_num_batched_tokens=sched.config.max_num_batched_tokens,
        eos_token_ids=[int(t) for t in info.eos_token_ids] if info else [],
        vocab_size=info.vocab_size if info else 0,
        max_model_len_reason=sched.config.max_model_len_reason)


def _last_step_num_tokens(engine_core: EngineCore) -> int:
    return engine_core.last_step_num_tokens


def _num_unfinished(engine_core: EngineCore) -> int:
    sched = engine_core.scheduler
    return sched.get_num_unfinished_requests()


def _raise_system_exit(_signum: int, _frame: object) -> None:
    raise SystemExit(0)


def _defer_sigterm(grace_s: float, _signum: int, _frame: object) -> None:
    """SIGTERM under an API server. systemd (KillMode=control-group), ``kill -- -PGID`` and
    ``timeout`` signal the API process and the engine at once: the API process then drains
    its requests for up to --shutdown-timeout and stops the engine with a SHUTDOWN message,
    so exiting here would fail the very requests it drains. The engine keeps stepping and
    exits on its own only if nothing stopped it ``grace_s`` seconds later (a SIGTERM sent to
    the engine alone); a parent that is gone ends it at once (the input thread notices too)."""
    parent = multiprocessing.parent_process()
    if parent is None or not parent.is_alive():
        raise SystemExit(0)
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return  # a second SIGTERM: the first one's deadline stands
    logger.info("SIGTERM: the API process (pid %s) stops the engine after draining; exiting "
                "on its own in %g s otherwise", parent.pid, grace_s)
    signal.signal(signal.SIGALRM, _raise_system_exit)
    signal.setitimer(signal.ITIMER_REAL, grace_s)
