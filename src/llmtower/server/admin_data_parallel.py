"""Data-parallel admin routes (behind the API key like every ``/v1/admin`` route):

- ``GET /v1/admin/data_parallel``: which ranks serve, which are lost and why, which are quiet
  or draining (and whether drained), the process group's epoch, requests re-sent, and each
  live engine's sync counters (collectives run, time they cost the busy loop, waves).
- ``POST /v1/admin/drain?engine_id=N``: stop routing to engine N, move its un-started requests
  to the others, let its running ones finish; answers the drain's status (``drained`` once
  it holds nothing). ``llmtower ctl drain`` calls it.
- ``POST /v1/admin/undrain?engine_id=N``: route to engine N again.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.dp_client import DPEngineCoreClient
from llmtower.server.errors import APIError

NOT_DP = ("this server runs one engine: start it with --data-parallel-size N for a "
          "data-parallel view")


def _dp_client(llm: AsyncLLM) -> DPEngineCoreClient:
    client = llm.client
    if not isinstance(client, DPEngineCoreClient):
        raise APIError(NOT_DP, 404, code="not_data_parallel")
    return client


def _engine_id(engine_id: str, n: int) -> int:
    try:
        rank = int(engine_id)
    except ValueError:
        rank = -1
    if not 0 <= rank < n:
        raise APIError(f"engine_id={engine_id!r} is not an engine of this server: give one of "
                       f"0..{n - 1}", 400, code="invalid_engine_id")
    return rank


def add_data_parallel_route(router: APIRouter, llm: AsyncLLM) -> None:
    @router.get("/data_parallel")
    async def data_parallel() -> dict[str, Any]:
        view = await llm.client.data_parallel_view(timeout_s=10)
        if view is None:
            raise APIError(NOT_DP, 404, code="not_data_parallel")
        return view

    @router.post("/drain")
    async def drain(engine_id: str) -> dict[str, Any]:
        client = _dp_client(llm)
        rank = _engine_id(engine_id, len(client.clients))
        try:
            return client.drain(rank)
        except ValueError as e:  # the last engine that serves
            raise APIError(str(e), 409, code="drain_refused") from None

    @router.post("/undrain")
    async def undrain(engine_id: str) -> dict[str, Any]:
        client = _dp_client(llm)
        return client.undrain(_engine_id(engine_id, len(client.clients)))
