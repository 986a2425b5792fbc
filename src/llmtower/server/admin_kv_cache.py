"""``GET /v1/admin/kv_cache``: what every KV block of one engine, or of all, holds right now
(``llmtower diag memory`` reads it). ``?engine_id=all`` (default) or ``?engine_id=N``.

The answer is ``{"engines": [KVCacheSnapshot, ...]}`` encoded straight from the msgspec
structs (no pydantic pass over a 100k-character block map).
"""
from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter
from fastapi.responses import Response

from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.core_client import EngineDeadError
from llmtower.server.errors import APIError

SNAPSHOT_TIMEOUT_S = 10.0


def parse_engine_id(value: str, num_engines: int) -> int | None:
    """``all`` -> None, ``N`` -> N; anything else is an APIError (400) saying what to send."""
    if value == "all":
        return None
    if not value.isdigit() or int(value) >= num_engines:
        raise APIError(f"engine_id={value!r} is invalid: use 'all' or an engine index "
                       f"0..{num_engines - 1} (this server runs {num_engines} engine(s))",
                       400, param="engine_id")
    return int(value)


def add_kv_cache_route(router: APIRouter, llm: AsyncLLM) -> None:
    encoder = msgspec.json.Encoder()

    @router.get("/kv_cache")
    async def kv_cache(engine_id: str = "all") -> Response:
        index = parse_engine_id(engine_id, llm.num_engines)
        try:
            snapshots = await llm.kv_cache_snapshots(index, timeout_s=SNAPSHOT_TIMEOUT_S)
        except EngineDeadError as e:
            raise APIError(f"the engine is not running: {e}", 503, code="engine_dead") from None
        except asyncio.TimeoutError:
            raise APIError(f"the engine did not answer within {SNAPSHOT_TIMEOUT_S:g} s",
                           503, code="engine_busy") from None
        return Response(encoder.encode({"engines": snapshots}), media_type="application/json")
