"""Sampling parameters of one request, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from llmtower.structured_output.params import StructuredOutputsParams


def _check(cond: bool, name: str, value: object, allowed: str) -> None:
    if not cond:
        raise ValueError(f"{name}={value!r} is out of range: {name} must be {allowed}")


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop.

    ``top_k`` 0 (or -1) disables top-k; ``top_p`` 1.0 disables nucleus sampling; ``min_p`` 0
    disables min-p; ``temperature`` 0 means greedy. ``max_tokens`` None means "up to the
    model's context length". ``logprobs`` is the number of top alternatives to return with
    each sampled token's own log-probability (None: no logprobs). Priority is not here: it
    belongs to the request.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias, -100..100).
    logit_bias: dict[int, float] | None = None
    # Keep only the last this-many prompt tokens (vLLM's left truncation); None: all.
    truncate_prompt_tokens: int | None = None
    # Logprobs of the prompt's tokens (with this many top alternatives); None: none. Such a
    # prompt is computed in full (no prefix-cache hit), as its logits are needed.
    prompt_logprobs: int | None = None
    # Grammar-constrained decoding (JSON schema, regex, choice, EBNF); a dict is read as
    # StructuredOutputsParams(**dict).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "a number >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "an integer >= 0 (0 or -1 disables top-k)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an integer >= 1 or None")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is out of range: min_tokens must be "
                             f"<= max_tokens={self.max_tokens}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "an integer in [0, 20] or None")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               self.frequency_penalty, "in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty,
               "a number > 0 (1 disables it)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "a list of non-negative token ids")
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed,
               "an integer or None")
        if self.logit_bias:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            _check(all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()),
                   "logit_bias", self.logit_bias,
                   "a map of token id (>= 0) to a bias in [-100, 100]")
        _check(self.prompt_logprobs is None or (
            isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
            "prompt_logprobs", self.prompt_logprobs, "an integer in [0, 20] or None")
        _check(self.truncate_prompt_tokens is None or (
            isinstance(self.truncate_prompt_tokens, int) and self.truncate_prompt_tokens >= 1),
            "truncate_prompt_tokens", self.truncate_prompt_tokens, "an integer >= 1 or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
