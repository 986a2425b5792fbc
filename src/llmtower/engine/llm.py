"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``.

``LLM`` runs an ``EngineCore`` in this process (no sockets), through the synchronous
``InprocEngineClient``: it tokenizes, hands the requests to the engine, steps it until every
request has finished, and returns one ``RequestOutput`` per prompt, in input order, however the
scheduler interleaved them.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

from llmtower.lora.request import LoRARequest
from llmtower.core.kv_cache.relocator import DefragResult
from llmtower.core.kv_cache.snapshot import KVCacheSnapshot
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import DEFAULT_MODEL, EngineArgs
from llmtower.engine.inproc_client import InprocEngineClient
from llmtower.engine.input_processor import (
    Conversation,
    InputProcessor,
    PromptItem,
    load_generation_defaults,
)
from llmtower.engine.output_processor import OutputProcessor
from llmtower.engine.preload import PreloadStatus
from llmtower.engine.request_output import RequestOutput, RequestOutputKind
from llmtower.engine.vllm_compat import log_ignored_vllm_settings

if TYPE_CHECKING:  # the engine core pulls in torch and the executor: imported when built
    from llmtower.engine.core import EngineCore


class LLM:
    """Owns the in-process engine client (over its ``EngineCore``), the tokenizer and the
    ``OutputProcessor``, and runs batches of prompts to completion.

    ``LLM(model=None, **engine_args)``: ``model`` is a Hugging Face directory, a .gguf file or
    'smollm2-135m-instruct' (the default); ``engine_args`` are ``EngineArgs`` fields
    (``max_num_seqs=...``, ``kv_cache_memory="2GiB"``, ``num_threads=2``, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = sorted(set(engine_args) - {f.name for f in dataclasses.fields(EngineArgs)})
        if unknown:
            valid = ", ".join(f.name for f in dataclasses.fields(EngineArgs))
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}: "
                             f"LLM(...) accepts model and the EngineArgs fields: {valid}")
        args = EngineArgs(model=model or DEFAULT_MODEL, **engine_args)
        log_ignored_vllm_settings(args)  # vLLM settings that change nothing here, once
        if args.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={args.data_parallel_size}: the offline LLM runs "
                             "one engine in this process; for several engine processes use "
                             "`llmtower serve --data-parallel-size N`")
        from llmtower.models.loader import load_tokenizer, resolve_model_path

        path = resolve_model_path(args.model)  # a missing model fails here, before any work
        defaults = load_generation_defaults(args.generation_config, path,
                                            args.generation_overrides())
        from llmtower.engine.factory import create_engine_core  # builds the model: slow import

        engine_core = create_engine_core(args)
        info = engine_core.model_info
        assert info is not None  # create_engine_core always loads a model
        tokenizer = load_tokenizer(resolve_model_path(args.tokenizer) if args.tokenizer else path)
        self._setup(engine_core, InputProcessor(
            tokenizer, max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids, default_sampling=defaults,
            max_model_len_reason=engine_core.scheduler.config.max_model_len_reason,
            max_logprobs=args.max_logprobs))
        # The model, its modules and the imports live as long as this LLM: frozen out of the
        # collector's reach, so that its full passes (set off by every step's garbage) stop
        # walking them, as in the engine process (core_proc.py) and vLLM's engine core.
        gc.collect()
        gc.freeze()

    @classmethod
    def from_engine_core(cls, engine_core: EngineCore, tokenizer: Any,
                         eos_token_ids: Sequence[int] | None = None) -> LLM:
        """An ``LLM`` over an engine core built elsewhere (tests, benchmarks, other executors).
        ``eos_token_ids`` default to the tokenizer's EOS token."""
        llm = cls.__new__(cls)
        info = engine_core.model_info
        max_model_len = (info.max_model_len if info is not None
                         else engine_core.scheduler.config.max_model_len)
        llm._setup(engine_core, InputProcessor(
            tokenizer, max_model_len=max_model_len, vocab_size=info.vocab_size if info else 0,
            eos_token_ids=list(eos_token_ids or [])))
        return llm

    def _setup(self, engine_core: EngineCore, input_processor: InputProcessor) -> None:
        self.client = InprocEngineClient(engine_core)
        self.input_processor = input_processor
        self.tokenizer = input_processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()
        self._busy = False

    @property
    def engine_core(self) -> EngineCore:
        """The engine this ``LLM`` drives (for tools and tests that look inside it)."""
        return self.client.engine_core

    # ------------------------------------------------------------------ public API
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None,
                 tenant: str | list[str] | None = None,
                 lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate completions for ``prompts`` (text, or token ids); one ``RequestOutput``
        per prompt, in input order. ``sampling_params`` is one for all or one per prompt;
        ``priority`` (one per prompt, lower runs first) needs ``policy="priority"``;
        ``tenant`` (one for all or one per prompt) is who is served, for ``policy="fair"``;
        ``lora_request`` (one for all or one per prompt, None: the base model) needs
        ``enable_lora=True``."""
        items = self._tokenize_prompts(prompts)
        return self._run(items, sampling_params, use_tqdm, priority, tenant, lora_request)

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             priority: list[int] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or
        to a list of them, rendered with the tokenizer's chat template."""
        conversations: list[Conversation] = (
            messages if messages and all(isinstance(m, list) for m in messages)  # type: ignore[assignment]
            else [messages])  # type: ignore[list-item]
        items = [self.render_chat(c, add_generation_prompt, chat_template) for c in conversations]
        return self._run(items, sampling_params, use_tqdm, priority)

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
               priority: int = 0, tenant: str = "") -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding ``RequestOutput``s with only the new text and
        tokens of each step (DELTA). The request is sent to the engine at the first
        ``next()`` (admission errors are raised there); closing the iterator early aborts it."""
        (item,) = self._tokenize_prompts([prompt] if isinstance(prompt, str) else [prompt])
        return self._stream(item, sampling_params, priority, tenant)

    def stream_chat(self, messages: Conversation,
                    sampling_params: SamplingParams | None = None,
                    add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> Iterator[RequestOutput]:
        """``stream`` for one conversation, rendered with the chat template."""
        return self._stream(self.render_chat(messages, add_generation_prompt, chat_template),
                            sampling_params, 0)

    def render_chat(self, conversation: Conversation, add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> PromptItem:
        """A conversation as prompt text and token ids, through the chat template."""
        return self.input_processor.render_chat(conversation, add_generation_prompt,
                                                chat_template)

    def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """What the KV cache holds now: every block's state, the block tables, fragmentation
        and the prefix cache (``llmtower diag memory`` draws it; see docs/operations.md)."""
        return self.client.call_utility("kv_cache_snapshot", result_type=KVCacheSnapshot)

    def defragment(self) -> DefragResult:
        """Move KV blocks so that each request's block table and the free space are one run
        each (see docs/memory.md); answers with the moves made and fragmentation before/after."""
        self._check_idle()
        return self.client.call_utility("defragment", result_type=DefragResult)

    def preload(self, prompts: str | list[str] | list[list[int]] | list[Conversation],
                pin: bool = False) -> PreloadStatus:
        """Compute the KV of ``prompts`` (text, token ids, or conversations, rendered without
        the generation prompt) into the prefix cache, generating nothing; with ``pin`` their
        blocks are kept out of eviction (up to ``max_pinned_blocks``) until ``unpin()``."""
        self._check_idle()
        if isinstance(prompts, list) and prompts and all(
                isinstance(c, list) and c and isinstance(c[0], dict) for c in prompts):
            ids = [self.render_chat(cast(Conversation, c), add_generation_prompt=False)[1]
                   for c in prompts]
        else:
            ids = [t for _, t in self._tokenize_prompts(prompts)]
        st = self.client.call_utility("preload", ids, pin, result_type=PreloadStatus)
        while not st.finished:
            self.client.get_output()
            st = self.client.call_utility("preload_status", st.batch_id,
                                          result_type=PreloadStatus)
        return st

    def unpin(self) -> int:
        """Release every pinned prefix block; returns how many there were."""
        return self.client.call_utility("unpin", result_type=int)

    def set_priority(self, request_id: str, priority: int) -> None:
        """Change the priority of a request in flight (e.g. from a ``stream()`` loop, with the
        ``request_id`` of its outputs); needs ``policy="priority"``. Raises KeyError for an
        unknown or finished request."""
        parent = self.output_processor.parents.get(request_id)
        engine_ids = [st.request_id for st in parent.children] if parent is not None else []
        if not engine_ids or not self.client.call_utility("update_priority", engine_ids, priority,
                                                          result_type=int):
            raise KeyError(f"request {request_id!r} is not in flight (unknown or finished)")

    def shutdown(self) -> None:
        self.client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals
    def _tokenize_prompts(self, prompts: Any) -> list[PromptItem]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a string, a non-empty list of strings, or a list "
                             f"of token-id lists; got {type(prompts).__name__}")
        if all(isinstance(p, int) for p in prompts):
            raise ValueError("prompts is a flat list of ints: wrap one tokenized prompt in a "
                             "list, e.g. generate([[1, 2, 3]])")
        items: list[PromptItem] = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                ids = self.input_processor.encode(p)
                text: str | None = p
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                ids, text = list(p), None
            else:
                raise ValueError(f"prompt {i} is a {type(p).__name__}: each prompt must be a "
                                 "string or a list of token ids")
            items.append((text, ids))
        return items

    def _check_idle(self) -> None:
        if self._busy:
            raise RuntimeError("this LLM is still running a stream; consume or close it "
                               "before starting another generation")

    def _add(self, items: list[PromptItem], params: list[SamplingParams], priorities: list[int],
             kind: RequestOutputKind, tenants: list[str] | None = None,
             loras: list[LoRARequest | None] | None = None) -> list[str]:
        """Send every request to the engine, or none: on an error, everything added so far
        is aborted again and the error is raised with its message intact."""
        request_ids: list[str] = []
        ip = self.input_processor
        # All truncated and checked before any is sent.
        items = [(text if len(ids2) == len(ids) else None, ids2) for i, ((text, ids), sp) in
                 enumerate(zip(items, params)) for ids2 in [ip.process_prompt(ids, sp, i)]]
        try:
            for (text, ids), sp, prio, tenant, lora in zip(items, params, priorities,
                                                           tenants or [""] * len(items),
                                                           loras or [None] * len(items)):
                rid = str(next(self._counter))
                request_ids.append(rid)
                sp = ip.with_extra_eos(sp)
                for req in self.output_processor.add_request(
                        rid, text, ids, sp, output_kind=kind, eos_token_id=ip.eos_token_id,
                        priority=prio, tenant=tenant, lora_request=lora):
                    self.client.add_request(req)
        except BaseException:
            self.client.abort_requests(self.output_processor.abort_requests(request_ids))
            raise
        return request_ids

    def _step(self) -> list[RequestOutput]:
        if not self.client.has_unfinished_requests():
            raise RuntimeError("the engine has no requests left but some never finished: "
                               f"{list(self.output_processor.parents)[:5]}")
        outputs = self.client.get_output()
        if outputs.request_errors:  # failed after admission (a grammar): raise like at add
            raise ValueError(outputs.request_errors[0][1])
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            self.client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def _abort_all(self) -> None:
        ids = list(self.output_processor.parents)
        self.client.abort_requests(self.output_processor.abort_requests(ids))

    def _run(self, items: list[PromptItem],
             sampling_params: SamplingParams | list[SamplingParams] | None, use_tqdm: bool,
             priority: list[int] | None,
             tenant: str | list[str] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        self._check_idle()
        params = _per_prompt(sampling_params, len(items), "sampling_params",
                             self.input_processor.default_sampling_params())
        priorities = _per_prompt(priority, len(items), "priority", 0)
        tenants = _per_prompt([tenant] * len(items) if isinstance(tenant, str) else tenant,
                              len(items), "tenant", "")
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, not "
                                 f"{type(sp).__name__}: use SamplingParams(max_tokens=..., ...)")
        loras = _per_prompt(lora_request, len(items), "lora_request", None)
        request_ids = self._add(items, params, priorities, RequestOutputKind.FINAL_ONLY, tenants,
                                loras)
        results: dict[str, RequestOutput] = {}
        from tqdm.auto import tqdm
        pbar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                    dynamic_ncols=True)
        num_out_tokens = 0
        self._busy = True
        try:
            while self.output_processor.has_unfinished_requests():
                for ro in self._step():
                    results[ro.request_id] = ro
                    num_out_tokens += sum(len(c.token_ids) for c in ro.outputs)
                    elapsed = pbar.format_dict.get("elapsed") or 0.0
                    if elapsed > 0:
                        pbar.set_postfix_str(f"output: {num_out_tokens / elapsed:.1f} tok/s",
                                             refresh=False)
                    pbar.update(1)
        except BaseException:
            self._abort_all()  # e.g. Ctrl-C: leave nothing running in the engine
            raise
        finally:
            self._busy = False
            pbar.close()
        return [results[rid] for rid in request_ids]

    def _stream(self, item: PromptItem, sampling_params: SamplingParams | None,
                priority: int, tenant: str = "") -> Iterator[RequestOutput]:
        # A generator: the request is added at the first next(), so an iterator that is
        # dropped before it starts leaves nothing behind in the engine.
        self._check_idle()
        self._add([item], [sampling_params or self.input_processor.default_sampling_params()],
                  [priority],
                  RequestOutputKind.DELTA, [tenant])
        self._busy = True
        try:
            while self.output_processor.has_unfinished_requests():
                yield from self._step()
        finally:
            # Also on close() or an exception in the consumer: abort what is left.
            self._abort_all()
            self._busy = False


def _per_prompt(value: Any, n: int, name: str, default: Any) -> list[Any]:
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts: give one per "
                             "prompt, or a single value for all")
        return list(value)
    return [value] * n
