"""POST /tokenize and POST /detokenize (vLLM's): a prompt or a conversation as the model's
token ids, and token ids back as text. A conversation is rendered exactly as
/v1/chat/completions renders it (``OpenAIServingChat.render_prompt``), so the count is the one
a chat request would use."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from llmtower.server.errors import APIError
from llmtower.server.protocol_tokenization import DetokenizeRequest, TokenizeRequest
from llmtower.server.serving_chat import OpenAIServingChat
from llmtower.server.tool_parsers.tool_choice import ToolSettings, plan_tools


def build_tokenization_router(chat: OpenAIServingChat) -> APIRouter:
    """/tokenize and /detokenize over the chat endpoint's server (its model, limits and
    rendering)."""
    router = APIRouter()
    llm = chat.llm

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        chat.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("send exactly one of prompt or messages", 400)
        if body.messages is not None:
            # The template renders the tools whatever the tool choice: count them as sent.
            tools = (plan_tools(body.tools, "required", None, ToolSettings()).template_tools()
                     if body.tools else None)
            _, ids = await chat.render_prompt(
                body.messages, body.add_generation_prompt, body.continue_final_message,
                body.chat_template_kwargs, None, tools)
        else:
            chat.limits.check_prompt_chars(len(body.prompt or ""))
            ids = await llm.encode_async(body.prompt or "",
                                         add_special_tokens=body.add_special_tokens)
        # token_strs: null unless asked for (vLLM's shape).
        strs = (llm.tokenizer.convert_ids_to_tokens(ids)
                if body.return_token_strs and hasattr(llm.tokenizer, "convert_ids_to_tokens")
                else None)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len,
                "token_strs": strs}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        chat.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < llm.vocab_size]
        if bad:
            raise APIError(f"token id(s) {bad[:5]} are outside the vocabulary "
                           f"(0..{llm.vocab_size - 1})", 400, param="tokens")
        return {"prompt": await llm.off_loop.run(llm.decode, body.tokens)}

    return router
