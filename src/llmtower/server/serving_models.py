"""GET /v1/models and GET /v1/models/{model}: the model this server serves, under each of its
--served-model-name names, and its LoRA adapters (OpenAI's model list; the SDK's
``models.list`` / ``retrieve``)."""
from __future__ import annotations

from fastapi import APIRouter

from llmtower.server.lora_routes import lora_model_card, lora_model_cards
from llmtower.server.protocol import ModelCard, ModelList
from llmtower.server.serving_base import ServingBase


def build_models_router(serving: ServingBase, expose_model_path: bool) -> APIRouter:
    """The model routes; ``expose_model_path``: a card's ``root`` is the model's path (it
    tells a caller about the host: only when the operator asks), else its name."""
    router = APIRouter()
    llm = serving.llm

    def model_card(name: str) -> ModelCard:
        ready = llm.ready
        return ModelCard(id=name, root=(ready.model_path if ready and expose_model_path
                                        else name),
                         max_model_len=llm.max_model_len)

    @router.get("/v1/models")
    async def list_models() -> ModelList:
        # LoRA adapters follow the base model, each with the base as its parent.
        return ModelList(data=[model_card(name) for name in llm.served_model_names]
                         + lora_model_cards(llm, expose_model_path))

    # OpenAI's GET /v1/models/{model} (the SDK's models.retrieve); ids may hold slashes.
    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> ModelCard:
        serving.check_model(model)
        lora = serving.lora_request(model)
        return model_card(model) if lora is None else lora_model_card(llm, lora,
                                                                       expose_model_path)

    return router
