"""The routes a deployment's monitors call: ``/health`` (the engine is alive; for data
parallelism which ranks serve), ``/ready`` (the engine loop answers between two steps),
``/ping`` (SageMaker's health check, GET or POST), ``/load`` (how many requests this server has
in flight, for a load balancer that routes to the least loaded replica), ``/metrics``
(Prometheus) and ``/version``."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

import llmtower
from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.core_client import EngineDeadError
from llmtower.server.errors import error_response

# How long /ready waits for the engine loop to answer between two steps.
READY_TIMEOUT_S = 5.0


def build_probe_router(llm: AsyncLLM) -> APIRouter:
    """The probe routes over a started AsyncLLM."""
    router = APIRouter()

    def engine_dead() -> Response | None:
        if not llm.is_dead:
            return None
        return error_response(503, f"the engine is not running: {llm.dead_reason}",
                              code="engine_dead")

    @router.get("/health")
    async def health() -> Response:
        if (dead := engine_dead()) is not None:
            return dead
        ranks = llm.client.health()  # data parallel: which ranks serve
        if ranks is not None:
            return JSONResponse(ranks)
        return Response(status_code=200)

    @router.get("/ready")
    async def ready() -> Response:
        try:
            ping = await llm.ping(timeout_s=READY_TIMEOUT_S)
        except EngineDeadError as e:
            return error_response(503, f"the engine is not running: {e}", code="engine_dead")
        except asyncio.TimeoutError:
            return error_response(503, f"the engine loop did not answer within "
                                  f"{READY_TIMEOUT_S:g} s", code="engine_busy")
        return JSONResponse({"status": "ready", "num_steps": ping.num_steps,
                             "num_unfinished_requests": ping.num_unfinished_requests})

    @router.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return engine_dead() or Response(status_code=200)

    @router.get("/load")
    async def load() -> JSONResponse:
        return JSONResponse({"server_load": llm.num_requests_in_flight})

    @router.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(llm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": llmtower.__version__}

    return router
