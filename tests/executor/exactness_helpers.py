"""Run prompts through a real EngineCore and through transformers' generate(), greedy."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.factory import create_engine_core

VOCAB = 512  # tests/fixtures/tiny_models.TINY_VOCAB_SIZE


def random_prompts(n: int, min_len: int, max_len: int, seed: int, prefix: list[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(n)]


def make_engine(model_dir: Path, **engine_kw) -> EngineCore:
    kw = dict(model=str(model_dir), num_threads=1, block_size=4, max_model_len=256,
              num_gpu_blocks=512, swap_space="4MiB", seed=0)
    kw.update(engine_kw)
    return create_engine_core(EngineArgs(**kw))


def add_greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int, first_id: int = 0) -> None:
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(
            str(first_id + i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            eos_token_id=2))


def run_all(core: EngineCore, max_steps: int = 20_000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return out
        for o in core.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("the engine did not finish its requests")


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """transformers' generate(), greedy, each prompt alone; EOS does not stop it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    gen = model.generation_config
    gen.eos_token_id = None  # like ignore_eos
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, generation_config=gen)
            outs.append(seq[0, len(p):].tolist())
    return outs
