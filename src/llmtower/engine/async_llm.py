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
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.core.outputs import EngineCoreOutputs, SchedulerStats
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core_client import EngineCoreClient, EngineDeadError
from llmtower.engine.core_messages import EngineReady, PingResult, RequestError
from llmtower.engine.core_proc import EngineFactory, default_engine_factory
from llmtower.engine.dp_client import DPEngineCoreClient
from llmtower.engine.output_processor import OutputProcessor
from llmtower.engine.request_output import RequestOutput, RequestOutputKind
from llmtower.metrics.prometheus import ServingMetrics
from llmtower.metrics.stats_logger import LoggingStatLogger

logger = logging.getLogger(__name__)


class RequestTimeoutError(TimeoutError):
    """The request waited in the queue past --request-timeout without a token (HTTP 408)."""


class _Tracked:
    """What the front end keeps per request in flight, next to the OutputProcessor's state."""

    __slots__ = ("queue", "engine_ids", "num_prompt_tokens", "last_output_time")

    def __init__(self, engine_ids: list[str], num_prompt_tokens: int) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.engine_ids = engine_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.last_output_time = 0.0


class AsyncLLM:
    """Owns the API process's side of serving: the tokenizer, the ``OutputProcessor``, the
    ``EngineCoreClient``, one output queue per request in flight, and the serving metrics."""

    def __init__(self, engine_args: EngineArgs, *, tokenizer: Any = None,
                 engine_factory: EngineFactory = default_engine_factory,
                 request_timeout_s: float | None = None, stats_interval_s: float = 0.5) -> None:
        if engine_args.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={engine_args.data_parallel_size} is invalid: "
                             "use 1 (one engine) or more")
        if request_timeout_s is not None and request_timeout_s <= 0:
            raise ValueError(f"request_timeout={request_timeout_s} is invalid: give a number of "
                             "seconds > 0, or leave it out for no timeout")
        self.engine_args = engine_args
        self.tokenizer = tokenizer
        self.request_timeout_s = request_timeout_s
        self.client: EngineCoreClient | DPEngineCoreClient = (
            DPEngineCoreClient(engine_args, engine_factory, stats_interval_s)
            if engine_args.data_parallel_size > 1
            else EngineCoreClient(engine_args, engine_factory, stats_interval_s))
        self.model_name = engine_args.served_model_name or engine_args.model
        self.metrics = ServingMetrics(self.model_name)
        self.stat_logger = LoggingStatLogger()
        self.ready: EngineReady | None = None
        self.output_processor: OutputProcessor | None = None
        self.eos_token_id: int | None = None
        self.extra_eos_token_ids: list[int] = []
        self.vocab_size = 0
        self._requests: dict[str, _Tracked] = {}
        self._engine_to_request: dict[str, str] = {}
        self._handler: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    async def create(cls, engine_args: EngineArgs, **kwargs: Any) -> "AsyncLLM":
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
        self.output_processor = OutputProcessor(tokenizer)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = list(self.ready.eos_token_ids)
        # As the offline LLM: the engine stops on one EOS id, the model's other EOS ids
        # become stop token ids of each request.
        self.eos_token_id = tok_eos if tok_eos is not None else (eos_ids[0] if eos_ids else None)
        self.extra_eos_token_ids = [t for t in eos_ids if t != self.eos_token_id]
        # Prompt ids index the model's embedding: the model's vocabulary bounds them (the
        # tokenizer's may be larger, e.g. a shared tokenizer over a smaller model).
        self.vocab_size = self.ready.vocab_size or len(tokenizer)
        self._handler = asyncio.create_task(self._output_handler())
        logger.info("serving %s: max_model_len=%d, %d KV blocks of %d tokens",
                    self.model_name, self.max_model_len, self.ready.num_gpu_blocks,
                    self.ready.block_size)

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
        self.client.shutdown()

    @property
    def max_model_len(self) -> int:
        assert self.ready is not None, "start() the AsyncLLM first"
        return self.ready.max_model_len

    @property
    def is_dead(self) -> bool:
        return self.client.is_dead

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    # ------------------------------------------------------------------ prompts
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **template_kwargs: Any) -> tuple[str, list[int]]:
        """The conversation through the model's chat template: its text and token ids."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions "
                             "with a plain prompt")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                **template_kwargs)
        except Exception as e:  # a template may reject a conversation (e.g. role order)
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        # The template already holds any BOS token: do not add special tokens twice.
        return text, self.encode(text, add_special_tokens=False)

    def check_prompt(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Raise ValueError / AdmissionError (HTTP 400) for a prompt the engine could not run,
        saying the lengths involved."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token of text")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} are outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        limit = self.max_model_len
        if n >= limit:
            raise AdmissionError(
                f"the prompt has {n} tokens but this model's context length (max_model_len) is "
                f"{limit} tokens, and at least one token must be generated: shorten the prompt")
        asked = sampling_params.max_tokens
        if asked is not None and n + asked > limit:
            raise AdmissionError(
                f"the prompt has {n} tokens and max_tokens is {asked}, {n + asked} in all, but "
                f"this model's context length (max_model_len) is {limit} tokens: lower "
                f"max_tokens to at most {limit - n} or shorten the prompt")

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt: str | None, prompt_token_ids: list[int],
                       sampling_params: SamplingParams, request_id: str, *, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream the ``RequestOutput`` deltas of one request (all ``n`` samples), the last
        one with ``finished`` set. Raises EngineDeadError (503), QueueFullError (429),
        AdmissionError / ValueError (400) or RequestTimeoutError (408, no token within
        ``request_timeout_s``). Leaving the loop early aborts the request in the engine."""
        if self.client.is_dead:
            raise EngineDeadError(self.client.dead_reason)
        assert self.output_processor is not None, "start() the AsyncLLM first"
        self.check_prompt(prompt_token_ids, sampling_params)
        arrival = time.monotonic()
        params = self._with_extra_eos(sampling_params)
        engine_reqs = self.output_processor.add_request(
            request_id, prompt, list(prompt_token_ids), params,
            output_kind=RequestOutputKind.DELTA, eos_token_id=self.eos_token_id,
            arrival_time=arrival, priority=priority, cache_salt=cache_salt)
        tracked = _Tracked([r.request_id for r in engine_reqs], len(prompt_token_ids))
        self._requests[request_id] = tracked
        for eid in tracked.engine_ids:
            self._engine_to_request[eid] = request_id
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
            self._forget(request_id)
            if not finished:
                self._abort(request_id)

    def _with_extra_eos(self, sp: SamplingParams) -> SamplingParams:
        extra = [t for t in self.extra_eos_token_ids if t not in sp.stop_token_ids]
        if not extra or sp.ignore_eos:
            return sp
        return dataclasses.replace(sp, stop_token_ids=sp.stop_token_ids + extra)

    def _abort(self, request_id: str, count: bool = True) -> None:
        """Forget a request here and free its KV blocks in the engine, without awaiting."""
        assert self.output_processor is not None
        engine_ids = self.output_processor.abort_requests([request_id])
        if engine_ids:
            if count:
                for _ in engine_ids:  # per sample, like "stop" and "length"
                    self.metrics.record_finished("abort")
            self.client.abort_requests_nowait(engine_ids)

    def _forget(self, request_id: str) -> None:
        tracked = self._requests.pop(request_id, None)
        if tracked is not None:
            for eid in tracked.engine_ids:
                self._engine_to_request.pop(eid, None)

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
            for tracked in list(self._requests.values()):
                tracked.queue.put_nowait(EngineDeadError(str(e)))
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here would hang every client: fail them loudly instead
            logger.exception("the output handler failed")
            err = EngineDeadError("the server's output handler failed; see the server log")
            self.client._mark_dead(str(err))
            for tracked in list(self._requests.values()):
                tracked.queue.put_nowait(err)

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        assert self.output_processor is not None
        metrics = self.metrics
        if outputs.scheduler_stats is not None:
            metrics.record_scheduler_stats(outputs.scheduler_stats)
            self.stat_logger.maybe_log(outputs.scheduler_stats)
        if not outputs.outputs:
            return
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:  # stop strings: the engine must stop them now
            self.client.abort_requests_nowait(processed.reqs_to_abort)
        now = time.monotonic()
        for ro in processed.request_outputs:
            tracked = self._requests.get(ro.request_id)
            if tracked is None:
                continue
            num_new = sum(len(c.token_ids) for c in ro.outputs)
            metrics.record_generation_tokens(num_new)
            num_prompt = 0
            if tracked.last_output_time:
                metrics.record_inter_token_latency(now - tracked.last_output_time)
            else:
                num_prompt = tracked.num_prompt_tokens
                metrics.record_prompt_tokens(num_prompt)
            self.stat_logger.record_tokens(num_prompt, num_new)
            tracked.last_output_time = now
            for c in ro.outputs:
                if c.finish_reason is not None:
                    metrics.record_finished(c.finish_reason)
            if ro.finished and ro.metrics is not None:
                metrics.record_request_timings(ro.metrics)
            tracked.queue.put_nowait(ro)

    def _on_request_error(self, err: RequestError) -> None:
        request_id = self._engine_to_request.get(err.request_id)
        self.metrics.record_rejection(err.kind)
        if request_id is None:
            return
        exc: Exception
        if err.kind == "queue_full":
            exc = QueueFullError(err.message)
        elif err.kind == "admission":
            exc = AdmissionError(err.message)
        else:
            exc = ValueError(err.message)
        tracked = self._requests.get(request_id)
        if tracked is not None:
            tracked.queue.put_nowait(exc)
        self._abort(request_id, count=False)  # the other samples of an n > 1 request

    # ------------------------------------------------------------------ engine utilities
    async def ping(self, timeout_s: float = 5.0) -> PingResult:
        return await self.client.call_utility("ping", result_type=PingResult,
                                              timeout_s=timeout_s)

    async def get_stats(self, timeout_s: float = 5.0) -> SchedulerStats:
        return await self.client.call_utility("get_stats", result_type=SchedulerStats,
                                              timeout_s=timeout_s)

    async def reset_prefix_cache(self, timeout_s: float = 5.0) -> None:
        await self.client.call_utility("reset_prefix_cache", timeout_s=timeout_s)
