"""Attach speculative decoding to a built executor (called by the engine factory)."""
from __future__ import annotations

from typing import Any

from llmtower.spec_decode.config import SpeculativeConfig
from llmtower.executor.spec_decode_step import SpecDecodeStep


def attach_spec_decode(executor: Any, config: SpeculativeConfig, **draft_kw: Any) -> SpecDecodeStep:
    """Give ``executor.runner`` its ``SpecDecodeStep``; for ``draft_model`` also load the
    draft model (``draft_kw``: dtype, threads) next to the target."""
    runner = executor.runner
    proposer = None
    if config.method == "draft_model":
        from llmtower.executor.draft_model import DraftModelProposer
        proposer = DraftModelProposer.load(config, runner, **draft_kw)
    step = SpecDecodeStep(config, runner.sampler, runner.max_model_len, proposer)
    runner.spec_decode = step
    return step
