"""The probe routes vLLM deployments call beside /health: ``/ping`` (SageMaker's health
check, GET or POST) and ``/load`` (how many requests this server has in flight, for a load
balancer that routes to the least loaded replica)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from llmtower.engine.async_llm import AsyncLLM
from llmtower.server.errors import error_response


def build_probe_router(llm: AsyncLLM) -> APIRouter:
    """/ping and /load over a started AsyncLLM."""
    router = APIRouter()

    @router.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        if llm.is_dead:
            return error_response(503, f"the engine is not running: {llm.dead_reason}",
                                  code="engine_dead")
        return Response(status_code=200)

    @router.get("/load")
    async def load() -> JSONResponse:
        return JSONResponse({"server_load": llm.num_requests_in_flight})

    return router
