"""Prompt logprobs against transformers: every prompt token's logprob and rank, through
chunked prefill, next to requests without them, and with a cached prefix that such a request
must not use."""
from __future__ import annotations

import torch

from exactness_helpers import make_engine, random_prompts
from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)


def _run(core, reqs):
    for r in reqs:
        core.add_request(r)
    got: dict[str, list] = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            if o.new_prompt_logprobs is not None:
                assert o.request_id not in got, "prompt logprobs must come once"
                got[o.request_id] = o.new_prompt_logprobs
    return got


def test_prompt_logprobs_match_transformers_through_chunks_and_a_cached_prefix(tiny_llama_dir):
    (prompt,) = random_prompts(1, 40, 40, seed=3)
    want = hf_prompt_logprobs(tiny_llama_dir, prompt)
    # 16-token budget: the 40-token prompt is prefilled in three chunks.
    core = make_engine(tiny_llama_dir, max_num_batched_tokens=16, enable_chunked_prefill=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    # First a request without prompt logprobs fills the prefix cache with the same prompt.
    assert _run(core, [EngineCoreRequest("warm", prompt, greedy)]) == {}
    asked = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    got = _run(core, [EngineCoreRequest("a", prompt, asked),
                      EngineCoreRequest("b", prompt[:20], greedy)])
    assert set(got) == {"a"}
    entries = got["a"]
    assert [e[0] for e in entries] == prompt[1:]  # tokens 1.. in order, each once
    for p, (token, logprob, rank, top) in enumerate(entries):
        row = want[p]
        assert abs(logprob - row[token].item()) < 1e-4
        assert rank == int((row > row[token]).sum()) + 1
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
