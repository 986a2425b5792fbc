"""Issue 11, item 6: a streamed n > 1 request reports each sample's finish exactly once, however
long its siblings run on after it."""
from __future__ import annotations

from collections import Counter

from llmtower.core.outputs import EngineCoreOutput, EngineCoreOutputs, RequestMetrics
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.output_processor import OutputProcessor
from llmtower.engine.request_output import RequestOutputKind


def test_each_sample_of_a_streamed_n_request_finishes_once(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = tokenizer.encode("Q:")
    children = proc.add_request("r", "Q:", ids, SamplingParams(n=4, max_tokens=8),
                                output_kind=RequestOutputKind.DELTA)
    word = tokenizer.encode(" the")[0]
    # Sample i ends after i + 1 tokens: sample 0 finishes first, then its siblings step on.
    lengths = {c.request_id: i + 1 for i, c in enumerate(children)}
    finishes: Counter = Counter()
    tokens: Counter = Counter()
    outputs = []
    for step in range(1, 5):
        batch = [EngineCoreOutput(rid, [word], finish_reason="length" if step == n else None,
                                  metrics=RequestMetrics() if step == n else None)
                 for rid, n in lengths.items() if step <= n]
        outputs += proc.process_outputs(EngineCoreOutputs(outputs=batch)).request_outputs
    for ro in outputs:
        for c in ro.outputs:
            tokens[c.index] += len(c.token_ids)
            if c.finish_reason is not None:
                finishes[c.index] += 1
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}
    assert tokens == {0: 1, 1: 2, 2: 3, 3: 4}
    assert outputs[-1].finished and not proc.has_unfinished_requests()
