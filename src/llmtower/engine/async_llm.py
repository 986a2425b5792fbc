"""AsyncLLM: the serving front end in the API process.

It tokenizes and validates prompts, sends ``EngineCoreRequest``s to the engine process through
``EngineCoreClient``, and runs one output-handler task that takes every step's outputs off the
socket, turns them into text with the shared ``OutputProcessor`` (incremental detokenization,
stop strings, fan-in of ``n > 1``) and routes each ``RequestOutput`` to the queue of its
request. ``generate()`` is an async generator over that queue: closing it early (a client that
went away) or a queue timeout aborts the request in the engine at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

from llmtower.lora.registry import LoRARegistry
from llmtower.lora.request import LoRARequest
from llmtower.lora.serving import load_lora_modules
from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.core.kv_cache.snapshot import KVCacheSnapshot
from llmtower.core.outputs import EngineCoreOutputs, SchedulerStats
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.client_interface import EngineClient
from llmtower.engine.core_client import EngineCoreClient, EngineDeadError, EngineLostError
from llmtower.engine.core_messages import EngineReady, PingResult, RequestError
from llmtower.engine.core_proc import EngineFactory, default_engine_factory
from llmtower.engine.dp_client import ENGINE_LOST, DPEngineCoreClient, merge_stats
from llmtower.engine.input_processor import InputProcessor, load_generation_defaults
from llmtower.engine.off_loop import OffLoopExecutor
from llmtower.engine.output_box import OutputBox
from llmtower.engine.output_processor import OutputProcessor
from llmtower.engine.request_output import RequestOutput, RequestOutputKind
from llmtower.metrics.prometheus import RequestParams, ServingMetrics
from llmtower.metrics.stats_logger import LoggingStatLogger
from llmtower.utils import describe_dtype

logger = logging.getLogger(__name__)
# Prompts up to this long (~256 tokens) are encoded on the event loop: 0.1-0.3 ms there,
# less than the hop to a worker thread and back costs at saturation. Longer ones go to a
# worker (off_loop.py), so that a large prompt never stalls the other clients.
INLINE_ENCODE_CHARS = 1024


class RequestTimeoutError(TimeoutError):
    """The request waited in the queue past --request-timeout without a token (HTTP 408)."""


class ServerShuttingDownError(RuntimeError):
    """The server is shutting down: the request was refused or aborted (HTTP 503)."""


class _Tracked:
    """What AsyncLLM keeps with each request in flight: its output queue and metrics state.
    It lives in the OutputProcessor's registry as the request's ``client_state``."""

    __slots__ = ("queue", "engine_ids", "num_prompt_tokens", "last_output_time", "params",
                 "sample_tokens")

    def __init__(self, engine_ids: list[str], num_prompt_tokens: int,
                 params: RequestParams | None = None) -> None:
        self.queue = OutputBox()
        self.engine_ids = engine_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.last_output_time = 0.0
        self.params = params or RequestParams()
        self.sample_tokens: dict[int, int] = {}  # tokens per sample index (longest: metrics)


class AsyncLLM:
    """Owns the API process's side of serving: the tokenizer, the ``OutputProcessor``, the
    ``EngineCoreClient``, one output queue per request in flight, and the serving metrics."""

    def __init__(self, engine_args: EngineArgs, *, tokenizer: Any = None,
                 engine_factory: EngineFactory = default_engine_factory,
                 request_timeout_s: float | None = None, stats_interval_s: float = 0.5,
                 chat_template: str | None = None, log_stats: bool = True,
                 engine_sigterm_grace_s: float | None = None) -> None:
        if engine_args.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={engine_args.data_parallel_size} is invalid: "
                             "use 1 (one engine) or more")
        if request_timeout_s is not None and request_timeout_s <= 0:
            raise ValueError(f"request_timeout={request_timeout_s} is invalid: give a number of "
                             "seconds > 0, or leave it out for no timeout")
        self.engine_args = engine_args
        self.tokenizer = tokenizer
        self.request_timeout_s = request_timeout_s
        self.client: EngineClient = (
            DPEngineCoreClient(engine_args, engine_factory, stats_interval_s,
                               engine_sigterm_grace_s)
            if engine_args.data_parallel_size > 1
            else EngineCoreClient(engine_args, engine_factory, stats_interval_s,
                                  engine_sigterm_grace_s))
        self.served_model_names = engine_args.served_model_names
        self.model_name = self.served_model_names[0]
        self.chat_template = chat_template
        self.metrics = ServingMetrics(self.model_name,
                                      num_engines=engine_args.data_parallel_size)
        self._engine_stats: dict[int, SchedulerStats] = {}  # latest snapshot per engine
        self.stat_logger = LoggingStatLogger(enabled=log_stats)
        self.ready: EngineReady | None = None
        self.output_processor: OutputProcessor | None = None
        self.input_processor: InputProcessor | None = None
        self._handler: asyncio.Task | None = None
        # Long prompts are tokenized and chats rendered here, never on the event loop (issue 11).
        self.off_loop = OffLoopExecutor()
        self._refusing: str | None = None  # set by abort_all(): why new requests are refused
        self.loras = LoRARegistry()  # --enable-lora: the adapters served by name

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def create(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        llm = cls(engine_args, **kwargs)
        await llm.start()
        return llm

    async def start(self) -> None:
        """Start the engine process and, while it loads the model, the tokenizer here."""
        path = None
        if self.tokenizer is None:
            from llmtower.models.loader import resolve_model_path
            # Resolve (and, for a .gguf, convert) here first, so that the engine process
            # finds the converted model in the cache instead of converting it concurrently.
            path = await asyncio.to_thread(resolve_model_path, self.engine_args.model)
        tokenizer_task = asyncio.create_task(self._load_tokenizer(path))
        try:
            self.ready = await self.client.start()
        finally:
            tokenizer = await tokenizer_task
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer, self.engine_args.stream_interval)
        defaults = load_generation_defaults(self.engine_args.generation_config,
                                            Path(self.ready.model_path),
                                            self.engine_args.generation_overrides())
        self.input_processor = InputProcessor(
            tokenizer, max_model_len=self.ready.max_model_len, vocab_size=self.ready.vocab_size,
            eos_token_ids=self.ready.eos_token_ids, chat_template=self.chat_template,
            default_sampling=defaults, max_model_len_reason=self.ready.max_model_len_reason,
            max_logprobs=self.engine_args.max_logprobs)
        self._handler = asyncio.create_task(self._output_handler())
        args = self.engine_args
        if args.enable_lora:
            await load_lora_modules(self, self.loras, args.lora_modules)
        self.metrics.record_cache_config({
            "block_size": self.ready.block_size,
            "num_gpu_blocks": self.ready.num_gpu_blocks // args.data_parallel_size,
            "enable_prefix_caching": args.enable_prefix_caching,
            "swap_space": args.swap_space, "cache_dtype": args.resolved_dtype()})
        logger.info("serving %s in %s: max_model_len=%d, %d KV blocks of %d tokens",
                    self.model_name, describe_dtype(args.dtype), self.max_model_len,
                    self.ready.num_gpu_blocks, self.ready.block_size)

    async def _load_tokenizer(self, path: Any) -> Any:
        if self.tokenizer is not None:
            return self.tokenizer
        from llmtower.models.loader import load_tokenizer, resolve_model_path
        name = self.engine_args.tokenizer
        if name:
            # A tokenizer-only directory is enough; anything else is resolved like a model.
            path = Path(name).expanduser()
            if not path.is_dir():
                path = await asyncio.to_thread(resolve_model_path, name)
        return await asyncio.to_thread(load_tokenizer, path)

    def shutdown(self) -> None:
        if self._handler is not None:
            self._handler.cancel()
        self.off_loop.shutdown()
        self.client.shutdown()

    @property
    def max_model_len(self) -> int:
        assert self.ready is not None, "start() the AsyncLLM first"
        return self.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self.input_processor is not None, "start() the AsyncLLM first"
        return self.input_processor.vocab_size

    @property
    def default_sampling(self) -> dict[str, Any]:
        """generation_config.json's sampling defaults (--generation-config), by field name."""
        return self.input_processor.default_sampling if self.input_processor else {}

    @property
    def num_requests_in_flight(self) -> int:
        """Client requests sent and not yet finished (GET /load)."""
        return self.output_processor.get_num_unfinished_requests() if self.output_processor else 0

    @property
    def is_dead(self) -> bool:
        return self.client.is_dead

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    # ------------------------------------------------------------------ prompts
    # Tokenizing, rendering and checking are the InputProcessor's, shared with the offline LLM.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert self.input_processor is not None, "start() the AsyncLLM first"
        return self.input_processor.encode(text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        assert self.input_processor is not None, "start() the AsyncLLM first"
        return self.input_processor.decode(token_ids, skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> tuple[str, list[int]]:
        """The conversation through the chat template (``chat_template=`` in the kwargs, else
        --chat-template, else the tokenizer's): its text and token ids. The render is bounded
        in time (template_limits)."""
        assert self.input_processor is not None, "start() the AsyncLLM first"
        return self.input_processor.render_chat(messages, add_generation_prompt,
                                                **template_kwargs)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode`` on a worker thread: a long prompt does not stall the event loop. A short
        one is encoded here: the hop to a thread and back costs more than encoding it."""
        if len(text) <= INLINE_ENCODE_CHARS:
            return self.encode(text, add_special_tokens)
        return await self.off_loop.run(self.encode, text, add_special_tokens)

    async def render_chat_async(self, messages: list[dict[str, Any]],
                                add_generation_prompt: bool = True,
                                **template_kwargs: Any) -> tuple[str, list[int]]:
        """``render_chat`` (template and tokenizer) on a worker thread."""
        return await self.off_loop.run(self.render_chat, messages, add_generation_prompt,
                                       **template_kwargs)

    def check_prompt(self, prompt_token_ids: list[int],
                     sampling_params: SamplingParams | None = None) -> list[int]:
        """The prompt the engine will run (truncated if ``truncate_prompt_tokens`` asks);
        raises ValueError / AdmissionError (HTTP 400) for one it could not run. Only the
        prompt is judged: a long max_tokens is clamped by the scheduler, not refused (one rule
        with the offline LLM, see InputProcessor)."""
        assert self.input_processor is not None, "start() the AsyncLLM first"
        return self.input_processor.process_prompt(prompt_token_ids,
                                                   sampling_params or SamplingParams())

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt: str | None, prompt_token_ids: list[int],
                       sampling_params: SamplingParams, request_id: str, *, priority: int = 0,
                       cache_salt: str | None = None, tenant: str = "",
                       lora_request: LoRARequest | None = None,
                       sink: Callable[[Any], bool] | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the ``RequestOutput`` deltas of one request (all ``n`` samples), the last
        one with ``finished`` set; outputs that ``sink`` (OutputBox.sink) takes are not
        yielded. Raises EngineDeadError (503), QueueFullError (429), AdmissionError /
        ValueError (400) or RequestTimeoutError (408, no token within ``request_timeout_s``).
        Leaving the loop early aborts the request in the engine."""
        if self.client.is_dead:
            raise EngineDeadError(self.client.dead_reason)
        if self._refusing is not None:
            raise ServerShuttingDownError(self._refusing)
        assert self.output_processor is not None, "start() the AsyncLLM first"
        prompt_token_ids = self.check_prompt(prompt_token_ids, sampling_params)
        arrival = time.monotonic()
        assert self.input_processor is not None
        params = self.input_processor.with_extra_eos(sampling_params)
        tracked = _Tracked([], len(prompt_token_ids),
                           RequestParams(n=sampling_params.n,
                                         max_tokens=sampling_params.max_tokens))
        tracked.queue.sink = sink
        engine_reqs = self.output_processor.add_request(
            request_id, prompt, list(prompt_token_ids), params,
            output_kind=RequestOutputKind.DELTA, eos_token_id=self.input_processor.eos_token_id,
            arrival_time=arrival, priority=priority, cache_salt=cache_salt, tenant=tenant,
            client_state=tracked, lora_request=lora_request)
        tracked.engine_ids = [r.request_id for r in engine_reqs]
        finished = False
        try:
            for req in engine_reqs:
                await self.client.add_request(req)
            deadline = None if self.request_timeout_s is None else arrival + self.request_timeout_s
            while True:
                if deadline is not None:  # only until the first token
                    try:
                        item = await asyncio.wait_for(tracked.queue.get(),
                                                      max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        self.metrics.record_rejection("timeout")
                        raise RequestTimeoutError(
                            f"the request waited {self.request_timeout_s:g} s in the queue "
                            "without being served (--request-timeout); retry later") from None
                    deadline = None
                else:
                    item = await tracked.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine refused it or is gone: nothing to abort
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort(request_id)

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight (in the engine too) and refuse new ones: each
        waiting ``generate()`` raises ServerShuttingDownError(reason). Returns how many
        requests were aborted."""
        self._refusing = reason
        assert self.output_processor is not None
        parents = list(self.output_processor.parents.values())
        for parent in parents:
            self._abort(parent.request_id)
            parent.client_state.queue.put_nowait(ServerShuttingDownError(reason))
        return len(parents)

    def _abort(self, request_id: str, count: bool = True) -> None:
        """Forget a request here and free its KV blocks in the engine, without awaiting."""
        assert self.output_processor is not None
        engine_ids = self.output_processor.abort_requests([request_id])
        if engine_ids:
            if count:
                engine = self._engine_of(engine_ids[0])
                for _ in engine_ids:  # per sample, like "stop" and "length"
                    self.metrics.record_finished("abort", engine)
            self.client.abort_requests_nowait(engine_ids)

    def _in_flight(self) -> list[_Tracked]:
        """The state of every request in flight (from the OutputProcessor's registry)."""
        if self.output_processor is None:
            return []
        return [p.client_state for p in self.output_processor.parents.values()]

    def _engine_of(self, engine_request_id: str) -> int:
        """The data-parallel engine serving a request (0 with one engine)."""
        return self.client.engine_of(engine_request_id) or 0

    # ------------------------------------------------------------------ the output handler
    async def _output_handler(self) -> None:
        try:
            while True:
                item = await self.client.get_output()
                if isinstance(item, RequestError):
                    self._on_request_error(item)
                else:
                    self._on_outputs(item)
        except EngineDeadError as e:
            for tracked in self._in_flight():
                tracked.queue.put_nowait(EngineDeadError(str(e)))
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here would hang every client: fail them loudly instead
            logger.exception("the output handler failed")
            err = EngineDeadError("the server's output handler failed; see the server log")
            self.client.mark_dead(str(err))
            for tracked in self._in_flight():
                tracked.queue.put_nowait(err)

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        assert self.output_processor is not None
        metrics = self.metrics
        for rid, why in outputs.request_errors:  # failed after admission (a grammar): a 400
            self._on_request_error(RequestError(rid, "invalid", why))
        engine = outputs.engine_index
        if outputs.scheduler_stats is not None:
            # Each engine's own snapshot feeds its engine="i" series; the log line sums them.
            stats = outputs.scheduler_stats
            metrics.record_scheduler_stats(stats, engine)
            self._engine_stats[engine] = stats
            self.stat_logger.maybe_log(stats if len(self._engine_stats) == 1 else
                                       merge_stats(list(self._engine_stats.values()), stats))
        if not outputs.outputs:
            return
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:  # stop strings: the engine must stop them now
            self.client.abort_requests_nowait(processed.reqs_to_abort)
        now = time.monotonic()
        # Counters once per step (summed), histograms per request; the inter-token latencies
        # by previous output time: streams that went out in one step share it (and the value).
        num_generated = sum(processed.step_tokens) + sum(processed.held_tokens)
        num_prompt = 0
        previous: dict[float, int] = {}
        for tracked in processed.held_states:
            # Held back by --stream-interval: the metrics still move with this step.
            last = tracked.last_output_time
            if last:
                previous[last] = previous.get(last, 0) + 1
            tracked.last_output_time = now
        for ro, tracked in zip(processed.request_outputs, processed.client_states):
            sample_tokens = tracked.sample_tokens
            for c in ro.outputs:
                sample_tokens[c.index] = sample_tokens.get(c.index, 0) + len(c.token_ids)
                if c.finish_reason is not None:
                    metrics.record_finished(c.finish_reason, engine)
            last = tracked.last_output_time
            if last:
                previous[last] = previous.get(last, 0) + 1
            else:
                num_prompt += tracked.num_prompt_tokens
            tracked.last_output_time = now
            if ro.finished and ro.metrics is not None:
                tracked.params.max_num_generation_tokens = max(sample_tokens.values(),
                                                               default=0)
                metrics.record_request_timings(ro.metrics, engine, tracked.params)
            tracked.queue.put_nowait(ro)
        if previous:
            metrics.record_inter_token_latencies(
                [(now - last, count) for last, count in previous.items()], engine)
        if num_prompt:
            metrics.record_prompt_tokens(num_prompt, engine)
        if num_generated:
            metrics.record_generation_tokens(num_generated, engine)
        self.stat_logger.record_tokens(num_prompt, num_generated)

    def _on_request_error(self, err: RequestError) -> None:
        assert self.output_processor is not None
        parent = self.output_processor.parent_of(err.request_id)
        self.metrics.record_rejection(err.kind)
        if parent is None:
            return
        exc: Exception
        if err.kind == "queue_full":
            exc = QueueFullError(err.message)
        elif err.kind == ENGINE_LOST:
            exc = EngineLostError(err.message)
        elif err.kind == "admission":
            exc = AdmissionError(err.message)
        else:
            exc = ValueError(err.message)
        parent.client_state.queue.put_nowait(exc)
        self._abort(parent.request_id, count=False)  # the other samples of an n > 1 request

    # ------------------------------------------------------------------ engine utilities
    async def ping(self, timeout_s: float = 5.0) -> PingResult:
        return await self.client.call_utility("ping", result_type=PingResult,
                                              timeout_s=timeout_s)

    async def get_stats(self, timeout_s: float = 5.0) -> SchedulerStats:
        return await self.client.call_utility("get_stats", result_type=SchedulerStats,
                                              timeout_s=timeout_s)

    async def set_priority(self, request_id: str, priority: int, timeout_s: float = 5.0) -> int:
        """Change the priority of a request in flight (all its samples), between two engine
        steps. Raises KeyError for an unknown or finished request, ValueError when the
        engine's policy is not ``priority``. Returns how many samples were changed."""
        if self.engine_args.policy != "priority":
            raise ValueError(f"cannot set a priority: the server runs --policy "
                             f"{self.engine_args.policy}; priorities need --policy priority")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, not {priority!r}")
        # The API's id; a completion with several prompts runs them as f"{id}-{i}".
        assert self.output_processor is not None
        found = [p.client_state for rid, p in self.output_processor.parents.items()
                 if rid == request_id or rid.startswith(request_id + "-")]
        if not found:
            raise KeyError(request_id)
        n = 0
        for tracked in found:
            n += await self.client.call_utility_on(
                self._engine_of(tracked.engine_ids[0]), "update_priority", tracked.engine_ids,
                priority, result_type=int, timeout_s=timeout_s)
        if not n:
            raise KeyError(request_id)  # it finished while the call was on its way
        return n

    async def reset_prefix_cache(self, timeout_s: float = 5.0) -> bool:
        """False when an engine refused because requests still hold KV blocks."""
        ok = await self.client.call_utility("reset_prefix_cache", timeout_s=timeout_s)
        if isinstance(ok, list):  # data parallel: one answer per engine
            return all(x is not False for x in ok)
        return ok is not False

    @property
    def num_engines(self) -> int:
        return self.engine_args.data_parallel_size

    def engine_indices(self, engine_id: int | None) -> list[int]:
        """``[engine_id]``, or every engine's index when None; ValueError for an engine that
        does not exist."""
        n = self.num_engines
        if engine_id is not None and not 0 <= engine_id < n:
            raise ValueError(f"engine_id={engine_id} does not exist: this server runs "
                             f"{n} engine(s), 0..{n - 1}")
        return list(range(n)) if engine_id is None else [engine_id]

    async def kv_cache_snapshots(self, engine_id: int | None = None,
                                 timeout_s: float = 10.0) -> list[KVCacheSnapshot]:
        """The KV cache of engine ``engine_id`` (every engine when None), one snapshot each,
        taken between two steps. Raises ValueError for an engine that does not exist."""
        indices = self.engine_indices(engine_id)
        snapshots = await asyncio.gather(*(
            self.client.call_utility_on(i, "kv_cache_snapshot", result_type=KVCacheSnapshot,
                                        timeout_s=timeout_s) for i in indices))
        for i, snap in zip(indices, snapshots):
            snap.engine_index = i  # an engine does not know its data-parallel index
        return list(snapshots)
