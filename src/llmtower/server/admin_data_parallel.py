"""Data-parallel admin routes (behind the API key like every ``/v1/admin`` route):

- ``GET /v1/admin/data_parallel``: which ranks serve, which are lost and why, which are quiet
  or draining (and whether drained), the process group's epoch, requests re-sent, and each
  live engine's sync counters (collectives run, time they cost the busy loop, waves); an
  engine that does not answer in time is listed in ``unanswered``.
- ``POST /v1/admin/drain?engine_id=N``: stop routing to engine N, move its un-started requests
  to the others, let its running ones finish; answers the drain's status (``drained`` once
  it holds nothing). ``llmtower ctl drain`` calls it.
- ``POST /v1/admin/undrain?engine_id=N``: route to engine N again.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from llmtower.engine.async_llm import AsyncLLM
from llmtower.server.errors import APIError

NOT_DP = ("this server runs one engine: start it with --data-parallel-size N for a "
          "data-parallel view")


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

    def set_draining(engine_id: str, draining: bool) -> dict[str, Any]:
        if llm.num_engines < 2:
            raise APIError(NOT_DP, 404, code="not_data_parallel")
        rank = _engine_id(engine_id, llm.num_engines)
        try:
            status = llm.client.set_draining(rank, draining)
        except ValueError as e:  # the last engine that serves
            raise APIError(str(e), 409, code="drain_refused") from None
        assert status is not None  # data parallel: a status
        return status

    @router.post("/drain")
    async def drain(engine_id: str) -> dict[str, Any]:
        return set_draining(engine_id, True)

    @router.post("/undrain")
    async def undrain(engine_id: str) -> dict[str, Any]:
        return set_draining(engine_id, False)
