"""Engines with and without speculation over the tiny models, and prompts worth drafting for."""
from __future__ import annotations

import json
import random
from pathlib import Path

from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.factory import create_engine_core

VOCAB = 512


def spec_json(method: str, k: int = 4, **kw) -> str:
    """The engines here run their requests in lock step, where the batch gate soon stops
    drafting on timing grounds (a tiny model's step is mostly host time): it is off unless
    asked for, so that tests of the drafts' mechanics always have drafts."""
    kw.setdefault("batch_gate", False)
    return json.dumps({"method": method, "num_speculative_tokens": k, **kw})


def make_engine(model_dir: Path, spec: str | None = None, **engine_kw) -> EngineCore:
    kw = dict(model=str(model_dir), num_threads=1, block_size=4, max_model_len=256,
              num_gpu_blocks=512, swap_space="4MiB", seed=0, speculative_config=spec)
    kw.update(engine_kw)
    return create_engine_core(EngineArgs(**kw))


def copy_prompts(n: int, seed: int, prefix: list[int] = ()) -> list[list[int]]:
    """Prompts made of a random passage written twice (and a bit more): something to copy."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        passage = [rng.randrange(3, VOCAB) for _ in range(rng.randint(8, 20))]
        out.append(list(prefix) + passage + [rng.randrange(3, VOCAB)] + passage
                   + passage[:rng.randint(2, 5)])
    return out


def add_requests(core: EngineCore, prompts: list[list[int]], max_tokens: int,
                 first_id: int = 0, **sp_kw) -> None:
    sp = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sp.update(sp_kw)
    for i, p in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(first_id + i), p, SamplingParams(**sp),
                                           eos_token_id=2))


def run_all(core: EngineCore, max_steps: int = 20_000) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return out
        for o in core.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("the engine did not finish its requests")


def assert_nothing_held(core: EngineCore) -> None:
    """Every KV block is back in the pool and the runner holds no request."""
    kv = core.scheduler.kv
    assert not kv.req_to_blocks
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


class ContinuationProposer:
    """Drafts the known continuation of each prompt (an oracle: every draft is accepted
    under greedy decoding), so tests can place any output token inside an accepted draft."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.known = {tuple(p): o for p, o in zip(prompts, outputs)}

    def propose(self, req_ids, histories, num_drafts, num_prompts=None):  # noqa: ARG002
        out = []
        for h, k in zip(histories, num_drafts):
            h = h.tolist()
            got: list[int] = []
            for n in range(1, len(h)):
                cont = self.known.get(tuple(h[:n]))
                if cont is not None and h[n:] == cont[:len(h) - n]:
                    got = cont[len(h) - n:len(h) - n + k]
                    break
            out.append(got)
        return out

    def remove(self, req_id):
        pass
