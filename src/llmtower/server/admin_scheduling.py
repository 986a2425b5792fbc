"""Scheduling admin routes (issue 17 and 10):

- ``POST /v1/admin/requests/{request_id}/priority`` with ``{"priority": int}``: change the
  priority of a request in flight (all its samples), under ``--policy priority``. The id is
  the one the API answered with (``id`` of the completion / chat completion). 404 for an
  unknown or finished request; 400 for a bad body or a server that does not run
  ``--policy priority``. Answers ``{"id", "priority", "num_sequences"}``.
- ``GET /v1/admin/tenants``: under ``--policy fair``, per tenant: tokens served, requests
  admitted, their summed queue time (s), requests unfinished, the virtual token counter and
  the weight (``{"tenants": {name: {...}}}``; with several engines, engine 0's).
- ``POST /v1/admin/reset_prefix_cache``: forget the prefix cache. Refused (as in vLLM) while
  any request holds KV blocks: answers ``{"reset": false}`` then, ``{"reset": true}`` when
  done.
"""
from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request

from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.core_client import EngineDeadError
from llmtower.server.errors import APIError

CALL_TIMEOUT_S = 5.0


async def _engine_call(coro) -> Any:
    try:
        return await coro
    except EngineDeadError as e:
        raise APIError(f"the engine is not running: {e}", 503, code="engine_dead") from None
    except asyncio.TimeoutError:
        raise APIError(f"the engine did not answer within {CALL_TIMEOUT_S:g} s", 503,
                       code="engine_busy") from None


def add_scheduling_routes(router: APIRouter, llm: AsyncLLM) -> None:
    @router.post("/requests/{request_id}/priority")
    async def set_priority(request_id: str, request: Request) -> dict:
        try:
            body = await request.json()
        except ValueError:
            raise APIError('the body must be JSON: {"priority": <integer>}', 400) from None
        priority = body.get("priority") if isinstance(body, dict) else None
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise APIError(f'"priority" must be an integer (lower runs first), not {priority!r}',
                           400, param="priority")
        try:
            n = await _engine_call(llm.set_priority(request_id, priority, CALL_TIMEOUT_S))
        except KeyError:
            raise APIError(f"no request {request_id!r} is in flight (unknown or finished)", 404,
                           param="request_id", code="request_not_found") from None
        except ValueError as e:
            raise APIError(str(e), 400, param="priority") from None
        return {"id": request_id, "priority": priority, "num_sequences": n}

    @router.get("/tenants")
    async def tenants() -> dict:
        stats = await _engine_call(llm.get_stats(CALL_TIMEOUT_S))
        return {"tenants": stats.tenants}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        ok = await _engine_call(llm.reset_prefix_cache(CALL_TIMEOUT_S))
        return {"reset": bool(ok)}
