"""``GET /v1/admin/data_parallel``: the data-parallel view — which ranks serve, which are lost
and why, the process group's epoch and each live engine's sync counters (collectives run,
time they cost the busy loop, waves)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from llmtower.engine.async_llm import AsyncLLM
from llmtower.server.errors import APIError


def add_data_parallel_route(router: APIRouter, llm: AsyncLLM) -> None:
    @router.get("/data_parallel")
    async def data_parallel() -> dict[str, Any]:
        view = await llm.client.data_parallel_view(timeout_s=10)
        if view is None:
            raise APIError("this server runs one engine: start it with --data-parallel-size N "
                           "for a data-parallel view", 404, code="not_data_parallel")
        return view
