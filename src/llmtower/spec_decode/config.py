"""``--speculative-config``: which proposer drafts tokens and how many, under vLLM's JSON names.

    --speculative-config '{"method": "ngram", "num_speculative_tokens": 5,
                           "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
    --speculative-config '{"method": "suffix", "num_speculative_tokens": 16}'
    --speculative-config '{"method": "draft_model", "model": "/path/to/small",
                           "num_speculative_tokens": 4}'
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    """Owns the settings of speculative decoding (one engine, every request).

    - ``method``: ``ngram`` (prompt lookup), ``suffix`` (suffix tree over the request and
      recent outputs) or ``draft_model`` (a smaller model sharing the tokenizer).
    - ``num_speculative_tokens``: most draft tokens per request per step (K).
    - ``prompt_lookup_min`` / ``prompt_lookup_max``: n-gram lengths that ngram matches.
    - ``suffix_decoding_max_tree_depth``: longest suffix (tokens) the suffix trees index.
    - ``suffix_decoding_max_cached_requests``: finished requests kept in the global suffix tree
      (0: only each request's own tokens are used).
    - ``suffix_decoding_max_cached_tokens``: most output tokens in the global tree (its memory
      bound: at most this many times ``max_tree_depth`` nodes; beyond vLLM's names).
    - ``suffix_decoding_max_spec_factor``: a suffix match of length m drafts at most
      ``factor * m`` tokens (longer matches earn longer drafts).
    - ``suffix_decoding_min_token_prob``: stop drafting when the estimated probability of the
      draft so far falls below this.
    - ``model``: the draft model (method ``draft_model``): a directory or .gguf file.
    - ``adaptive``: shrink a request's K (down to 0) while its drafts are rejected.
    - ``adaptive_min_acceptance``: acceptance rate (accepted / drafted, moving average) under
      which K shrinks; drafting a rejected token costs a position in the forward pass.
    - ``batch_gate``: in a batch with nobody waiting, draft only while the slowest request's
      accepted tokens pay for every request's rejected rows (``batch_gate.py``; needs
      ``adaptive``).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_cached_tokens: int = 32768
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None
    adaptive: bool = True
    adaptive_min_acceptance: float = 0.25
    batch_gate: bool = True

    def __post_init__(self) -> None:
        def need(cond: bool, name: str, allowed: str) -> None:
            if not cond:
                raise ValueError(f"speculative config: {name}={getattr(self, name)!r} is invalid: "
                                 f"{name} must be {allowed}")

        need(self.method in METHODS, "method", "one of " + ", ".join(repr(m) for m in METHODS))
        need(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 64,
             "num_speculative_tokens", "an integer in [1, 64]")
        need(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
             "prompt_lookup_min", "an integer >= 1")
        need(isinstance(self.prompt_lookup_max, int)
             and self.prompt_lookup_max >= self.prompt_lookup_min,
             "prompt_lookup_max", f"an integer >= prompt_lookup_min ({self.prompt_lookup_min})")
        need(isinstance(self.suffix_decoding_max_tree_depth, int)
             and 1 <= self.suffix_decoding_max_tree_depth <= 256,
             "suffix_decoding_max_tree_depth", "an integer in [1, 256]")
        need(isinstance(self.suffix_decoding_max_cached_requests, int)
             and self.suffix_decoding_max_cached_requests >= 0,
             "suffix_decoding_max_cached_requests", "an integer >= 0")
        need(isinstance(self.suffix_decoding_max_cached_tokens, int)
             and self.suffix_decoding_max_cached_tokens >= 0,
             "suffix_decoding_max_cached_tokens", "an integer >= 0")
        need(self.suffix_decoding_max_spec_factor > 0, "suffix_decoding_max_spec_factor",
             "a number > 0")
        need(0.0 <= self.suffix_decoding_min_token_prob <= 1.0, "suffix_decoding_min_token_prob",
             "in [0, 1]")
        need(0.0 <= self.adaptive_min_acceptance < 1.0, "adaptive_min_acceptance", "in [0, 1)")
        if self.method == "draft_model":
            need(bool(self.model), "model", "the draft model's path when method is 'draft_model'")

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """Parse ``--speculative-config`` (a JSON object, or a dict); None or '' -> None."""
        if text is None or text == "" or text == {}:
            return None
        if isinstance(text, str):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON ({e.msg} at character "
                                 f"{e.pos}): pass an object such as "
                                 "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'") from None
        else:
            data = dict(text)
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object, e.g. "
                             "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                             f"known keys: {', '.join(sorted(known))}")
        return cls(**data)
