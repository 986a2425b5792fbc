"""The client-side state of one sequence (one sample of a request): its tokens, its text so
far, its stop strings and logprobs, and what has already been sent to the client."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from llmtower.core.outputs import EngineCoreOutput, RequestMetrics
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.detokenizer import (DecodeFn, Detokenizer, DetokenizerFactory,
                                         IncrementalDetokenizer)
from llmtower.engine.request_output import (CompletionOutput, Logprob, PromptLogprobs,
                                            RequestOutputKind, SampleLogprobs)
from llmtower.engine.stop_checker import StopChecker


class RequestState:
    """Owns one engine request's output as the client sees it: token ids, detokenized text
    (cut at a stop string), logprobs, finish reason, and the offsets of what was sent."""

    def __init__(self, request_id: str, index: int, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, decode: DecodeFn,
                 output_kind: RequestOutputKind, arrival_time: float | None = None,
                 make_detokenizer: DetokenizerFactory | None = None) -> None:
        self.request_id = request_id
        self.index = index
        self.parent: Any = None  # its client request (a ParentRequest), set by the OutputProcessor
        self.output_kind = output_kind
        self.min_tokens = sampling_params.min_tokens
        skip = sampling_params.skip_special_tokens
        self.detokenizer: Detokenizer = (
            make_detokenizer(prompt_token_ids, skip) if make_detokenizer is not None
            else IncrementalDetokenizer(decode, prompt_token_ids, skip))
        self.stop_checker = StopChecker(sampling_params.stop,
                                        sampling_params.include_stop_str_in_output)
        self._decode = decode
        wants_logprobs = sampling_params.logprobs is not None
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: SampleLogprobs | None = [] if wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics: RequestMetrics | None = None
        self.prompt_logprobs: PromptLogprobs | None = None  # with the first token, if asked
        self.num_cached_tokens = 0
        self.num_prompt_tokens = len(prompt_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_token_time = 0.0
        self.queue_time = 0.0  # as the engine measured it
        self.num_preemptions = 0
        # What DELTA outputs have already sent.
        self.sent_tokens = 0
        self.sent_chars = 0
        # A DELTA output says "finished" once: a finished sibling of an n > 1 request must not
        # repeat its last delta each time another sample advances.
        self.sent_finish = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> bool:
        """Take one step's output from the engine. Returns True when a stop string ended the
        request here: the engine does not know yet and must be told to abort it."""
        if len(out.new_token_ids) > 1 and self.stop_checker.stop:
            return self._update_token_by_token(out)
        return self._update_one(out)

    def _update_token_by_token(self, out: EngineCoreOutput) -> bool:
        """Several tokens in one step (accepted draft tokens of speculative decoding): take
        them one at a time so that a stop string ends the output at the token completing it,
        exactly as without speculation."""
        toks, lps = out.new_token_ids, out.new_logprobs
        last = len(toks) - 1
        for j, tok in enumerate(toks):
            final = j == last
            piece = msgspec.structs.replace(
                out, new_token_ids=[tok], new_logprobs=lps[j:j + 1] if lps else lps,
                new_prompt_logprobs=out.new_prompt_logprobs if j == 0 else None,
                finish_reason=out.finish_reason if final else None,
                stop_reason=out.stop_reason if final else None,
                metrics=out.metrics if final else None)
            stopped = self._update_one(piece)
            if self.finished:
                if out.metrics is not None:
                    self.metrics = out.metrics
                return stopped and not out.finished
        return False

    def _update_one(self, out: EngineCoreOutput) -> bool:
        if not self.first_token_time and out.new_token_ids:
            self.first_token_time = time.monotonic()
            self.queue_time = out.queue_time
        self.num_preemptions = out.num_preemptions
        self.token_ids.extend(out.new_token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        if out.new_logprobs and self.logprobs is not None:
            self._add_logprobs(out.new_logprobs)
        if out.new_prompt_logprobs is not None:
            self.prompt_logprobs = [None] + [self._logprob_dict(*e)
                                             for e in out.new_prompt_logprobs]
        new_text = self.detokenizer.update(out.new_token_ids)
        if out.finished:
            new_text += self.detokenizer.flush()
        self.text += new_text
        stopped_by_string = False
        if new_text and len(self.token_ids) >= self.min_tokens:
            match = self.stop_checker.check(self.text, len(new_text))
            if match is not None:
                self.text = self.text[:match.truncate_to]
                self.finish_reason, self.stop_reason = "stop", match.stop
                stopped_by_string = not out.finished
        if out.finished and not self.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        if out.metrics is not None:
            self.metrics = out.metrics
        elif stopped_by_string:
            self.metrics = self._client_side_metrics()
        return stopped_by_string

    def finish_aborted(self) -> None:
        """The client gave up on the request (e.g. it disconnected)."""
        if not self.finished:
            self.text += self.detokenizer.flush()
            self.finish_reason = "abort"

    def _client_side_metrics(self) -> RequestMetrics:
        """Metrics of a request that the engine did not finish (a stop string ended it here):
        the times the client saw, with the queue time and preemptions the engine sent along."""
        now = time.monotonic()
        first = self.first_token_time or now
        ttft = max(0.0, first - self.arrival_time)
        return RequestMetrics(
            arrival_time=self.arrival_time, queue_time=self.queue_time, ttft=ttft,
            prefill_time=max(0.0, ttft - self.queue_time), decode_time=max(0.0, now - first),
            e2e_latency=max(0.0, now - self.arrival_time), num_preemptions=self.num_preemptions,
            num_cached_tokens=self.num_cached_tokens, num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=len(self.token_ids))

    def make_output(self) -> CompletionOutput | None:
        """This sequence's ``CompletionOutput`` for the client, by ``output_kind``; None when
        a DELTA has nothing new to say."""
        # Until it has finished, keep back the text that may be the start of a stop string.
        visible = len(self.text) if self.finished else max(
            self.sent_chars, len(self.text) - self.stop_checker.holdback)
        if self.output_kind is not RequestOutputKind.DELTA:
            return CompletionOutput(self.index, self.text[:visible], list(self.token_ids),
                                    self.cumulative_logprob,
                                    list(self.logprobs) if self.logprobs is not None else None,
                                    self.finish_reason, self.stop_reason)
        n_tok = len(self.token_ids)
        if (visible == self.sent_chars and n_tok == self.sent_tokens
                and (not self.finished or self.sent_finish)):
            return None
        out = CompletionOutput(
            self.index, self.text[self.sent_chars:visible], self.token_ids[self.sent_tokens:],
            self.cumulative_logprob,
            self.logprobs[self.sent_tokens:] if self.logprobs is not None else None,
            self.finish_reason, self.stop_reason)
        self.sent_chars, self.sent_tokens = visible, n_tok
        self.sent_finish = self.finished
        return out

    def _logprob_dict(self, token_id: int, logprob: float, rank: int,
                      top: list[tuple[int, float]]) -> dict[int, Logprob]:
        """A token's logprob, then its top alternatives (rank order), with their texts."""
        d = {token_id: Logprob(logprob, rank, self._decode([token_id], False))}
        for r, (alt_id, alt_logprob) in enumerate(top, start=1):
            if alt_id not in d:
                d[alt_id] = Logprob(alt_logprob, r, self._decode([alt_id], False))
        return d

    def _add_logprobs(self, entries: list[tuple[int, float, int, list[tuple[int, float]]]]) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        for token_id, logprob, rank, top in entries:
            d = self._logprob_dict(token_id, logprob, rank, top)
            self.logprobs.append(d)
            self.cumulative_logprob += logprob
