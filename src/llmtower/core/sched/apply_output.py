"""Applying a step's outputs (``update_from_output``): take back rejected drafts, cache newly
full blocks, append the sampled tokens one by one with their stop checks (and grammar),
finish stopped requests at once (their blocks are free for the next step) and report the new
tokens, logprobs and, for finished requests, their metrics to the clients.

Outputs are matched to the request objects their step scheduled, never to ids alone (ids are
reused; two steps may be in flight under --async-scheduling)."""
from __future__ import annotations

from llmtower.core.outputs import (EngineCoreOutput, EngineCoreOutputs, LogprobsEntry,
                                   ModelRunnerOutput, SchedulerOutput)
from llmtower.core.request import Request, RequestStatus
from llmtower.core.sched.grammar import GrammarMixin
from llmtower.core.sched.spec_drafts import apply_verification, next_drafts
from llmtower.core.sched.stats import request_metrics

_FINISHED = RequestStatus.FINISHED_STOPPED  # statuses from here on are finished ones


class ApplyOutputMixin(GrammarMixin):
    """Turns a step's ``ModelRunnerOutput`` into request progress and client outputs."""

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, stop finished requests, free their blocks at once, cache
        newly full blocks, and report new tokens to the clients."""
        now = self.clock()
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        logprobs = model_runner_output.logprobs
        prompt_lps = model_runner_output.prompt_logprobs
        caching = self.kv.enable_prefix_caching
        num_cached_blocks = self.kv.num_cached_blocks
        bs = self.cache_config.block_size
        spec_sched = scheduler_output.scheduled_spec_decode_tokens
        proposed = model_runner_output.spec_token_ids
        sched_reqs = scheduler_output.scheduled_requests
        append_tokens = self._append_tokens  # bound once: this loop runs per request per step
        check_stop = self._check_stop
        for i, rid in enumerate(model_runner_output.req_ids):
            # The request object this step scheduled: an id it did not schedule is ignored,
            # and so is a request that finished or was aborted since (its id may already
            # belong to a new request).
            req = sched_reqs.get(rid)
            if req is None or req.status >= _FINISHED:
                continue
            running = req.status == RequestStatus.RUNNING
            sampled = model_runner_output.sampled_token_ids[i]
            if spec_sched and rid in spec_sched:  # before caching: rejected drafts' KV is not
                apply_verification(req, spec_sched[rid], sampled, self.kv, self.spec_stats)
            if (running and caching
                    and req.num_computed_tokens // bs > num_cached_blocks.get(rid, 0)):
                self.kv.cache_blocks(req, req.num_computed_tokens)  # a block just filled
            if prompt_lps is not None and rid in prompt_lps:
                req.prompt_logprobs = (req.prompt_logprobs or []) + prompt_lps[rid]
            if not sampled:
                continue  # a prefill chunk that has not reached the end of the prompt
            if len(sampled) == 1 and req.structured_output is None and not req.queue_entry:
                # The common case, one token of a plain running request: _append_tokens'
                # loop and bookkeeping reduce to this.
                tok = sampled[0]
                req.all_token_ids.append(tok)
                new_tokens = [tok]
                status = check_stop(req, tok)
            else:
                new_tokens, status = append_tokens(req, sampled)
            out = _new_output(req, new_tokens, logprobs[i] if logprobs is not None else None, now)
            if status is not None:
                self._stop(req, status, out, running, stopped)
            elif proposed is not None and running and req.structured_output is None:
                # (No drafts for a constrained request: its grammar mask covers one token.)
                req.spec_token_ids = next_drafts(req, proposed[i])
            outputs.append(out)
        if stopped:
            gone = {r.request_id for r in stopped}
            self.running = [r for r in self.running if r.request_id not in gone]
        return EngineCoreOutputs(outputs=outputs, timestamp=now)

    def _append_tokens(self, req: Request, sampled: list[int]
                       ) -> tuple[list[int], RequestStatus | None]:
        """Append ``sampled`` token by token until one ends the request: the tokens appended
        (jump-forward ones included) and the status it ends with (None: it goes on)."""
        new_tokens: list[int] = []
        status = None
        for tok in sampled:
            req.all_token_ids.append(tok)
            new_tokens.append(tok)
            status = self._check_stop(req, tok)
            if req.structured_output is not None:
                status = self._advance_grammar(req, tok, status, new_tokens)
            if status is not None:
                break
        if req.queue_entry:  # preempted while this step was in flight: back in waiting
            self.waiting.grow(req, len(new_tokens))
        return new_tokens, status

    def _stop(self, req: Request, status: RequestStatus, out: EngineCoreOutput, running: bool,
              stopped: list[Request], now: float | None = None) -> None:
        """End ``req`` with ``status`` now (or at ``now``: a step of a decode run); a running
        one leaves ``running`` after the loop (``stopped``), in one pass rather than one O(n)
        removal each."""
        if running:
            stopped.append(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, status, now)
        out.finish_reason = status.finish_reason
        out.stop_reason = req.stop_reason
        out.metrics = request_metrics(req)


def _new_output(req: Request, new_tokens: list[int], logprobs: list[LogprobsEntry] | None,
                now: float) -> EngineCoreOutput:
    """The client's output for ``new_tokens``: logprobs, prompt logprobs, timings."""
    times = req.times
    out = EngineCoreOutput(req.request_id, new_tokens,
                           num_cached_tokens=req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
                           num_preemptions=req.num_preemptions)
    if not times.first_token:
        times.first_token = now
        out.queue_time = times.queue_time
    times.last_token = now
    if logprobs:
        out.new_logprobs = [(e.token_id, e.logprob, e.rank, e.top)
                            for e in logprobs[:len(new_tokens)]]
    if req.prompt_logprobs is not None:
        out.new_prompt_logprobs = [(e.token_id, e.logprob, e.rank, e.top)
                                   for e in req.prompt_logprobs]
        req.prompt_logprobs = None
    return out
