"""LoRA over HTTP: the adapters' /v1/models cards (parent = the base model) and vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter (mounted only with runtime updating
allowed: --enable-lora-runtime-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from llmtower.lora.request import LoRARequest
from llmtower.lora.serving import LoRALoadError, load_adapter, unload_adapter
from llmtower.server.errors import APIError
from llmtower.server.protocol import ModelCard


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def lora_model_card(llm: Any, lora: LoRARequest, expose_path: bool) -> ModelCard:
    return ModelCard(id=lora.lora_name, root=lora.lora_path if expose_path else lora.lora_name,
                     parent=lora.base_model_name or llm.model_name,
                     max_model_len=llm.max_model_len)


def lora_model_cards(llm: Any, expose_path: bool) -> list[ModelCard]:
    loras = getattr(llm, "loras", None)
    return [lora_model_card(llm, r, expose_path) for r in loras] if loras is not None else []


def build_lora_router(llm: Any) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if not body.lora_name or not body.lora_path:
            raise APIError("both lora_name and lora_path must be given", 400)
        try:
            await load_adapter(llm, llm.loras, body.lora_name, body.lora_path,
                               body.base_model_name)
        except LoRALoadError as e:
            raise APIError(str(e), 400, param="lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        try:
            gone = await unload_adapter(llm, llm.loras, body.lora_name)
        except LoRALoadError as e:
            raise APIError(str(e), 409, param="lora_name") from None
        if gone is None:
            known = llm.loras.names()
            raise APIError(f"the LoRA adapter {body.lora_name!r} cannot be found (served "
                           f"adapters: {known or 'none'})", 404, param="lora_name",
                           code="model_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    return router
