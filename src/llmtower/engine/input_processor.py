"""InputProcessor: from what a user sends to what the engine can run, one place for the
offline ``LLM`` and the serving ``AsyncLLM``.

It tokenizes, renders conversations through the chat template (the model's, the operator's
``--chat-template``, or one a request brings where allowed), validates prompts against the
vocabulary and the context length, truncates prompts on request, adds the model's extra EOS
ids as stop token ids, and fills unset sampling fields from ``generation_config.json``.

The length rule (vLLM's, and the same everywhere): only the prompt can be rejected — it must
leave room for at least one generated token. ``max_tokens`` is never rejected for being too
long; the scheduler clamps it to what the context has left and the request finishes with
``finish_reason="length"`` there.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llmtower.core.errors import AdmissionError
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.template_limits import TemplateTimeoutError, call_with_render_deadline
from llmtower.engine.vllm_compat import check_max_logprobs

Conversation = list[dict[str, Any]]
# A prompt after tokenization: its text (None if given as token ids) and its token ids.
PromptItem = tuple[str | None, list[int]]

# The sampling fields generation_config.json may set, under their SamplingParams names.
_GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                             "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                             "max_new_tokens": "max_tokens"}


def resolve_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file holding a Jinja template, or the template itself."""
    if value is None or value == "":
        return None
    if "{%" in value or "{{" in value:
        return value  # a template given inline
    path = Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"chat template {value!r} is neither a file nor a Jinja template "
                                "(inline templates contain '{{' or '{%')")
    return path.read_text(encoding="utf-8")


def load_generation_defaults(source: str, model_path: Path | None,
                             override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults of ``generation_config.json`` (``--generation-config``):
    ``auto`` reads the model directory's, ``vllm`` ignores it, anything else is a directory
    holding one; then ``override`` (``--override-generation-config``, the same keys) on top,
    as vLLM merges them. Returned under SamplingParams names; only fields that are set."""
    raw = _generation_config(source, model_path)
    raw.update(override or {})
    defaults = {ours: raw[theirs] for theirs, ours in _GENERATION_CONFIG_FIELDS.items()
                if raw.get(theirs) is not None}
    if raw.get("do_sample") is False and "temperature" not in (override or {}):
        defaults["temperature"] = 0.0  # greedy is what "no sampling" means
    SamplingParams(**defaults)  # a bad value fails at start-up, not on every request
    return defaults


def check_generation_override(override: dict[str, Any] | None) -> None:
    """ValueError for an --override-generation-config key that sets nothing here."""
    unknown = sorted(set(override or {}) - {*_GENERATION_CONFIG_FIELDS, "do_sample"})
    if unknown:
        raise ValueError(f"override_generation_config: {', '.join(map(repr, unknown))} "
                         "set(s) no sampling default here; use "
                         f"{', '.join(sorted({*_GENERATION_CONFIG_FIELDS, 'do_sample'}))}")


def _generation_config(source: str, model_path: Path | None) -> dict[str, Any]:
    if source == "vllm":
        return {}
    if source == "auto":
        if model_path is None:
            return {}
        file = Path(model_path) / "generation_config.json"
        if not file.is_file():
            return {}
    else:
        file = Path(source).expanduser() / "generation_config.json"
        if not file.is_file():
            raise FileNotFoundError(f"--generation-config {source}: no generation_config.json "
                                    "there; give a directory holding one, 'auto' (the model's) "
                                    "or 'vllm' (none)")
    import json
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    return dict(raw) if isinstance(raw, dict) else {}


class InputProcessor:
    """Owns the front end's view of the model's inputs: the tokenizer, the chat template, the
    vocabulary and context limits, the EOS ids and the default sampling settings."""

    def __init__(self, tokenizer: Any, *, max_model_len: int, vocab_size: int = 0,
                 eos_token_ids: Sequence[int] = (), chat_template: str | None = None,
                 default_sampling: dict[str, Any] | None = None,
                 max_model_len_reason: str = "", max_logprobs: int = 20) -> None:
        self.tokenizer = tokenizer
        self._backend = _fast_backend(tokenizer)
        self.max_logprobs = max_logprobs  # --max-logprobs
        self.max_model_len = max_model_len
        self.max_model_len_reason = max_model_len_reason  # e.g. the model's sliding window
        # Prompt ids index the model's embedding: its vocabulary bounds them (the tokenizer's
        # may be larger, e.g. a shared tokenizer over a smaller model).
        self.vocab_size = vocab_size or _tokenizer_size(tokenizer)
        tok_eos = getattr(tokenizer, "eos_token_id", None)
        # The engine stops on one EOS id; the model's other EOS ids (generation_config may
        # list several) become stop token ids of each request.
        self.eos_token_id: int | None = tok_eos if tok_eos is not None else (
            eos_token_ids[0] if eos_token_ids else None)
        self.extra_eos_token_ids = [t for t in eos_token_ids if t != self.eos_token_id]
        self.chat_template = chat_template
        self.default_sampling = dict(default_sampling or {})

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        backend = self._backend
        if backend is not None and backend.truncation is None and backend.padding is None \
                and not backend.encode_special_tokens:
            return backend.encode(text, add_special_tokens=add_special_tokens).ids
        enc = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return list(enc.ids) if hasattr(enc, "ids") else list(enc)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, conversation: Conversation, add_generation_prompt: bool = True,
                    chat_template: str | None = None, **template_kwargs: Any
                    ) -> tuple[str, list[int]]:
        """A conversation as prompt text and token ids, through ``chat_template`` if given,
        else the operator's ``--chat-template``, else the tokenizer's own."""
        if not isinstance(conversation, list) or not all(
                isinstance(m, dict) and "role" in m and "content" in m for m in conversation):
            raise ValueError("a conversation must be a list of messages like "
                             "{'role': 'user', 'content': 'Hello'}; got "
                             f"{str(conversation)[:200]}")
        template = chat_template or self.chat_template
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: start the server "
                             "with --chat-template FILE (or pass chat_template=... offline), "
                             "or send a plain prompt to /v1/completions")
        try:
            # A template (the operator's or a trusted request's) may loop: bound its time.
            text = call_with_render_deadline(
                self.tokenizer.apply_chat_template, conversation, tokenize=False,
                add_generation_prompt=add_generation_prompt, chat_template=template,
                **template_kwargs)
        except TemplateTimeoutError:
            raise
        except Exception as e:  # a template may reject a conversation (e.g. role order)
            raise ValueError(f"the chat template rejected the messages: {e}") from e
        # The template already holds any BOS token: do not add special tokens twice.
        return text, self.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ validation
    def check_prompt(self, prompt_token_ids: Sequence[int], index: int | None = None) -> None:
        """Raise ValueError / AdmissionError (HTTP 400) for a prompt the engine could not run:
        empty, a token outside the vocabulary, or no room left for one generated token."""
        which = "the prompt" if index is None else f"prompt {index}"
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError(f"{which} is empty: give at least one token of text")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"{which} has token id(s) {bad[:5]} outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        if n >= self.max_model_len:
            raise AdmissionError(
                f"{which} has {n} tokens but this model's context length (max_model_len) is "
                f"{self.max_model_len} tokens"
                + (f" because {self.max_model_len_reason}" if self.max_model_len_reason else "")
                + ", and at least one token must be generated: "
                "shorten the prompt (or set truncate_prompt_tokens)")

    def check_params(self, sp: SamplingParams) -> None:
        """What only the model can judge in a request's sampling settings."""
        check_max_logprobs(sp, self.max_logprobs)
        n = self.vocab_size
        for name, ids in (("logit_bias", sp.logit_bias or {}),
                          ("stop_token_ids", sp.stop_token_ids or [])):
            bad = [t for t in ids if t >= n]
            if bad:  # a stop token the model cannot produce is a mistake, as vLLM judges
                raise ValueError(f"{name}=... names token id(s) {bad[:5]} outside the "
                                 f"vocabulary of {n} tokens (0..{n - 1})")

    def process_prompt(self, prompt_token_ids: list[int], sp: SamplingParams,
                       index: int | None = None) -> list[int]:
        """The prompt the engine will run: truncated as ``sp`` asks, then checked (with
        ``sp``); raises ValueError / AdmissionError."""
        ids = self.truncate(prompt_token_ids, sp.truncate_prompt_tokens)
        self.check_prompt(ids, index)
        self.check_params(sp)
        return ids

    @staticmethod
    def truncate(prompt_token_ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """Keep the last ``truncate_prompt_tokens`` tokens (vLLM's left truncation)."""
        if truncate_prompt_tokens is None or len(prompt_token_ids) <= truncate_prompt_tokens:
            return prompt_token_ids
        return prompt_token_ids[-truncate_prompt_tokens:]

    # ------------------------------------------------------------------ sampling
    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams from generation_config.json's defaults, then ``overrides``."""
        return SamplingParams(**{**self.default_sampling, **overrides})

    def with_extra_eos(self, sp: SamplingParams) -> SamplingParams:
        extra = [t for t in self.extra_eos_token_ids if t not in sp.stop_token_ids]
        if not extra or sp.ignore_eos:
            return sp
        return dataclasses.replace(sp, stop_token_ids=sp.stop_token_ids + extra)


def _tokenizer_size(tokenizer: Any) -> int:
    return len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.get_vocab_size()


def _fast_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` under a transformers fast tokenizer, to encode prompts
    with directly: the same ids (transformers' ``encode`` calls its ``encode_batch``) without
    the BatchEncoding transformers builds around them, ~0.8x the CPU for a 128-token prompt
    (at saturation tokenizing was a tenth of the API process's CPU). None where transformers
    does more than that call (a tokenizer that splits special tokens) or none of this kind;
    ``encode`` also falls back while the backend has truncation or padding set, which
    transformers clears for a plain encode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or not hasattr(backend, "encode_special_tokens")
            or getattr(tokenizer, "split_special_tokens", False)):
        return None
    return backend

