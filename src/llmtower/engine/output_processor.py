"""OutputProcessor: turns the engine's token outputs into what clients read.

Shared by the offline ``LLM`` (in-process, FINAL_ONLY outputs) and the API server
(``AsyncLLM``, streaming DELTA outputs). The engine only sees single-sequence requests: a
request with ``n > 1`` is fanned out here into ``n`` child requests and its outputs gathered
back into one ``RequestOutput``. Stop strings are also checked here, on detokenized text, so a
request that hits one must be aborted in the engine: ``process_outputs`` returns those ids.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmtower.lora.request import LoRARequest
from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest, RequestMetrics
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.detokenizer import make_decode_fn, make_detokenizer_factory
from llmtower.engine.request_output import RequestOutput, RequestOutputKind
from llmtower.engine.request_state import RequestState


@dataclass
class ProcessedOutputs:
    """The result of one engine step, for the client: outputs to deliver, and child request
    ids the engine must abort at once (they hit a stop string)."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    # The client_state of each output's request, in the same order (AsyncLLM's queue and
    # per-request metrics state; None offline).
    client_states: list[Any] = field(default_factory=list)
    # Tokens each output's request generated in this step (its delta may hold more: those
    # of the steps held back by the stream interval, already counted then).
    step_tokens: list[int] = field(default_factory=list)
    # Requests that generated tokens in this step but whose output waits for the stream
    # interval: their client_state and their tokens of this step (for the metrics).
    held_states: list[Any] = field(default_factory=list)
    held_tokens: list[int] = field(default_factory=list)


class ParentRequest:
    """Owns one client request: its prompt, output kind, its ``n`` sequences, and what the
    front end keeps with it (``client_state``: AsyncLLM's output queue and metrics state)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 output_kind: RequestOutputKind, children: list[RequestState],
                 client_state: Any = None) -> None:
        self.request_id = request_id
        self.client_state = client_state
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.output_kind = output_kind
        self.children = children
        self.num_unfinished = len(children)
        self._prompt_logprobs_sent = False  # DELTA outputs carry them once
        # --stream-interval: tokens generated since the last output, and whether one went out.
        self.unsent_tokens = 0
        self.sent_any = False

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def make_output(self) -> RequestOutput | None:
        if self.output_kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        children = self.children
        if len(children) == 1:  # n = 1, most requests: no fan-in to do
            only = children[0]
            output = only.make_output()
            if output is None:
                return None
            completions = [output]
            prompt_logprobs = only.prompt_logprobs
            metrics = only.metrics
            num_cached = only.num_cached_tokens
        else:
            completions = [c for c in (child.make_output() for child in children) if c]
            if not completions:
                return None
            prompt_logprobs = next((c.prompt_logprobs for c in children
                                    if c.prompt_logprobs is not None), None)
            metrics = merge_metrics([c.metrics for c in children]) if self.finished else None
            num_cached = max(c.num_cached_tokens for c in children)
        if self.output_kind is RequestOutputKind.DELTA:
            if self._prompt_logprobs_sent:
                prompt_logprobs = None
            self._prompt_logprobs_sent |= prompt_logprobs is not None
        return RequestOutput(
            self.request_id, self.prompt, self.prompt_token_ids, completions, self.finished,
            metrics if self.finished else None, num_cached, prompt_logprobs)


class OutputProcessor:
    """Owns the client-side state of every request in flight: detokenizers, stop strings,
    the fan-out of ``n > 1`` requests, and what each client was already sent. It is the front
    end's one registry of requests (as vLLM's): the offline LLM and AsyncLLM keep none of
    their own, AsyncLLM attaches its per-request state as ``client_state``."""

    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        # DELTA outputs every N tokens (the first at once, the last always): vLLM's
        # --stream-interval, fewer outputs (and SSE events) for the API process to make.
        self.stream_interval = stream_interval
        self._decode = make_decode_fn(tokenizer)
        self._make_detokenizer = make_detokenizer_factory(tokenizer, self._decode)
        self.parents: dict[str, ParentRequest] = {}  # client request id -> request
        self.request_states: dict[str, RequestState] = {}  # child (engine) id -> sequence

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    sampling_params: SamplingParams, n: int | None = None, *,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
                    eos_token_id: int | None = None, arrival_time: float | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    tenant: str = "", client_state: Any = None,
                    lora_request: LoRARequest | None = None) -> list[EngineCoreRequest]:
        """Register a request; return the ``EngineCoreRequest``s the caller must send to the
        engine: one, or ``n`` children (ids ``f"{request_id}-{i}"``, seed ``seed + i``)."""
        n = sampling_params.n if n is None else n
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r} is out of range: n must be an integer >= 1")
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use; "
                             "request ids must be unique")
        child_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        for cid in child_ids:
            if cid in self.request_states:
                raise ValueError(f"request id {cid!r} is already in use by another request; "
                                 "request ids must be unique")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        states, engine_requests = [], []
        for i, cid in enumerate(child_ids):
            params = sampling_params
            if n > 1 or params.n != 1:
                seed = None if params.seed is None else params.seed + i
                params = dataclasses.replace(params, n=1, seed=seed)
            states.append(RequestState(cid, i, prompt_token_ids, params, self._decode,
                                       output_kind, arrival, self._make_detokenizer))
            engine_requests.append(EngineCoreRequest(
                cid, list(prompt_token_ids), params, eos_token_id=eos_token_id,
                arrival_time=arrival, priority=priority, cache_salt=cache_salt, tenant=tenant,
                lora_request=lora_request))
        parent = ParentRequest(request_id, prompt, list(prompt_token_ids), output_kind, states,
                               client_state)
        self.parents[request_id] = parent
        for st in states:
            st.parent = parent
            self.request_states[st.request_id] = st
        return engine_requests

    def parent_of(self, engine_request_id: str) -> ParentRequest | None:
        """The client request an engine request (one sample) belongs to, while in flight."""
        st = self.request_states.get(engine_request_id)
        return st.parent if st is not None else None

    def abort_requests(self, request_ids: Sequence[str]) -> list[str]:
        """Forget client requests (e.g. the client went away); return the engine ids of
        their unfinished sequences, which the caller must abort in the engine."""
        to_abort = []
        for rid in request_ids:
            parent = self.parents.pop(rid, None)
            if parent is None:
                continue
            for st in parent.children:
                if self.request_states.pop(st.request_id, None) is not None:
                    st.finish_aborted()
                    to_abort.append(st.request_id)
        return to_abort

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parents)

    # ------------------------------------------------------------------ outputs
    def process_outputs(self, engine_core_outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Apply one engine step: detokenize, check stop strings, and build one
        ``RequestOutput`` per client request that has something to say."""
        result = ProcessedOutputs()
        # insertion-ordered: deterministic output order; the value: tokens of this step
        touched: dict[str, tuple[ParentRequest, int]] = {}
        for out in engine_core_outputs.outputs:
            st = self.request_states.get(out.request_id)
            if st is None:
                continue  # aborted here while the engine was still running it
            num_before = len(st.token_ids)
            if st.update(out):
                result.reqs_to_abort.append(st.request_id)
            parent = st.parent
            if st.finished:
                del self.request_states[st.request_id]
                parent.num_unfinished -= 1
            seen = touched.get(parent.request_id)
            touched[parent.request_id] = (parent, len(st.token_ids) - num_before
                                          + (seen[1] if seen is not None else 0))
        interval = self.stream_interval
        for parent, num_new in touched.values():
            if interval > 1 and self._hold(parent, num_new, interval):
                result.held_states.append(parent.client_state)
                result.held_tokens.append(num_new)
                continue
            ro = parent.make_output()
            if ro is not None:
                result.request_outputs.append(ro)
                result.client_states.append(parent.client_state)
                result.step_tokens.append(num_new)
            if parent.finished:
                del self.parents[parent.request_id]
        return result

    @staticmethod
    def _hold(parent: ParentRequest, num_new: int, interval: int) -> bool:
        """Whether a streamed request's output waits for more tokens (--stream-interval)."""
        if parent.output_kind is not RequestOutputKind.DELTA or parent.finished:
            return False
        parent.unsent_tokens += num_new
        if parent.sent_any and parent.unsent_tokens < interval:
            return True
        parent.sent_any = parent.sent_any or parent.unsent_tokens > 0
        parent.unsent_tokens = 0
        return False


def merge_metrics(all_metrics: list[RequestMetrics | None]) -> RequestMetrics | None:
    """One request's metrics from those of its sequences: times until the first sequence
    got there, counts summed, the cache hit of the luckiest sequence."""
    ms = [m for m in all_metrics if m is not None]
    if len(ms) <= 1:
        return ms[0] if ms else None
    return RequestMetrics(
        arrival_time=min(m.arrival_time for m in ms),
        queue_time=min(m.queue_time for m in ms),
        ttft=min(m.ttft for m in ms),
        prefill_time=min(m.prefill_time for m in ms),
        decode_time=max(m.decode_time for m in ms),
        e2e_latency=max(m.e2e_latency for m in ms),
        num_preemptions=sum(m.num_preemptions for m in ms),
        num_cached_tokens=max(m.num_cached_tokens for m in ms),
        num_prompt_tokens=ms[0].num_prompt_tokens,
        num_generation_tokens=sum(m.num_generation_tokens for m in ms),
        spec_num_draft_tokens=sum(m.spec_num_draft_tokens for m in ms),
        spec_num_accepted_tokens=sum(m.spec_num_accepted_tokens for m in ms))
