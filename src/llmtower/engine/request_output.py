"""What the engine's clients get back: one ``RequestOutput`` per request, holding one
``CompletionOutput`` per sample (``n`` of them), with vLLM's names and meanings."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from llmtower.core.outputs import RequestMetrics


class RequestOutputKind(enum.Enum):
    """How much each ``RequestOutput`` of a request carries.

    - ``CUMULATIVE``: everything so far (text, token ids, logprobs), at every step.
    - ``DELTA``: only what is new since the previous output of the request (streaming).
    - ``FINAL_ONLY``: one output, when the request has finished (offline ``LLM.generate``).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class Logprob:
    """The log-probability of one token, its rank among the vocabulary (1 = most likely)
    and its text on its own."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the sampled token and its top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# One per prompt token (None for the first, which nothing predicts), as SampleLogprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a request: its text, token ids and, once finished, why it stopped.

    ``finish_reason`` is None while generating, then ``"stop"`` (EOS, a stop token or a stop
    string), ``"length"`` (max_tokens or the context length) or ``"abort"``. ``stop_reason``
    is the stop string or stop token id that ended it (None for EOS and length).
    ``cumulative_logprob`` and ``logprobs`` are None unless logprobs were asked for.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request as its client sees it: the prompt, one ``CompletionOutput``
    per sample, whether every sample has finished, and (when finished) its metrics.

    ``num_cached_tokens`` is the number of prompt tokens served from the prefix cache.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: in the first output of the request (DELTA) or in each.
    prompt_logprobs: PromptLogprobs | None = None
