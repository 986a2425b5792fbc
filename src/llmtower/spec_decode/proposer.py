"""What every proposer offers the runner, and the factory that builds one from the config."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from llmtower.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    """Drafts tokens for requests from their token history (prompt + accepted outputs)."""

    def propose(self, req_ids: list[str], histories: list[np.ndarray], num_drafts: list[int],
                num_prompts: list[int] | None = None) -> list[list[int]]:
        """Up to ``num_drafts[i]`` tokens continuing ``histories[i]`` (may be fewer or none);
        ``num_prompts[i]``: how many of the history's tokens are the prompt."""
        ...

    def remove(self, req_id: str) -> None:
        """The request finished or was aborted: forget (or archive) what is kept for it."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The n-gram and suffix proposers; the draft-model proposer needs the model and the KV
    cache and is built by the executor (see ``executor/draft_model.py``)."""
    if config.method == "ngram":
        from llmtower.spec_decode.ngram_proposer import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from llmtower.spec_decode.suffix_proposer import SuffixProposer
        return SuffixProposer(config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob,
                              config.suffix_decoding_max_cached_tokens)
    raise ValueError(f"speculative method {config.method!r} needs the executor to build it")
