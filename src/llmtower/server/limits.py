"""The operator's per-request limits (``--max-n``, the prompt's character cap) and the checks
that apply them before a request is tokenized or reaches the engine. Static caps that do not
depend on the server (stop strings, logprobs, messages, tools) are in ``protocol.py``, where
the OpenAPI schema shows them."""
from __future__ import annotations

from dataclasses import dataclass

from llmtower.server.errors import APIError

# Characters a prompt may hold per token of context: a token averages ~4 characters of
# English; 32 leaves room for long whitespace or symbol runs and still bounds the work of
# tokenizing a prompt that can never fit (a 10 MB prompt took 5-19 s to tokenize).
CHARS_PER_TOKEN_CAP = 32
MIN_PROMPT_CHARS = 1 << 16
# apply_chat_template's own parameters: set by the server, never by a request.
_RENDER_ARGUMENTS = frozenset({
    "conversation", "messages", "tokenize", "add_generation_prompt", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


@dataclass(frozen=True)
class RequestLimits:
    """Owns the per-request limits the operator chose for this server."""

    max_n: int = 16
    max_prompt_chars: int = 8192 * CHARS_PER_TOKEN_CAP
    trust_request_chat_template: bool = False

    @classmethod
    def for_model(cls, max_model_len: int, max_n: int = 16,
                  trust_request_chat_template: bool = False) -> RequestLimits:
        return cls(max_n=max_n,
                   max_prompt_chars=max(MIN_PROMPT_CHARS, max_model_len * CHARS_PER_TOKEN_CAP),
                   trust_request_chat_template=trust_request_chat_template)

    def check_n(self, n: int, best_of: int | None = None) -> None:
        for name, value in (("n", n), ("best_of", best_of)):
            if value is not None and value > self.max_n:
                raise APIError(f"{name}={value} is over this server's limit of {self.max_n} "
                               f"samples per request (--max-n): lower {name}", 400, param=name,
                               code="limit_exceeded")

    def check_template_kwargs(self, kwargs: dict | None, request_template: str | None = None
                              ) -> dict:
        """The template variables a request may set. Replacing the template itself (a
        ``chat_template`` in the request or in ``chat_template_kwargs``) needs
        --trust-request-chat-template: a template is code the server runs."""
        kwargs = dict(kwargs or {})
        if "chat_template" in kwargs or request_template is not None:
            if not self.trust_request_chat_template:
                raise APIError("this server does not accept a chat template from the request "
                               "(the operator can allow it with --trust-request-chat-template): "
                               "remove chat_template", 400, param="chat_template",
                               code="chat_template_not_allowed")
            if request_template is not None:
                kwargs["chat_template"] = request_template
        # The renderer's own switches are not template variables.
        for name in sorted(_RENDER_ARGUMENTS & kwargs.keys()):
            raise APIError(f"chat_template_kwargs.{name} is not allowed: it is an argument of "
                           "the renderer, not a template variable; remove it", 400,
                           param="chat_template_kwargs")
        return kwargs

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(f"the {param} has {num_chars} characters, over this server's limit "
                           f"of {self.max_prompt_chars} ({CHARS_PER_TOKEN_CAP} per token of the "
                           "context length): it could never fit the model's context; shorten "
                           "it", 400, param=param, code="context_length_exceeded")
