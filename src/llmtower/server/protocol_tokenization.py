"""Request bodies of POST /tokenize and POST /detokenize (vLLM's tokenizer endpoints)."""
from __future__ import annotations

from typing import Any

from pydantic import Field

from llmtower.server.protocol import MAX_MESSAGES, MAX_TOOLS, OpenAIModel, TokenId
from llmtower.server.protocol_chat import ChatMessage


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: a prompt, or chat messages (the chat template is applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # As for chat (vLLM's /tokenize takes them): what the template renders besides messages.
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # vLLM's: each token's string in the vocabulary too


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]
