"""Memory admin routes (``llmtower ctl`` and ``llmtower preload`` call them):

- ``POST /v1/admin/defrag?engine_id=all|N``: a full KV defragmentation; answers
  ``{"engines": [DefragResult, ...]}`` (moves made, fragmentation before and after).
- ``POST /v1/admin/preload``: body ``{"prompts": [{"prompt": ...} | {"messages": [...]}],
  "pin": false, "engine_id": "all", "cache_salt": null}``; computes the prompts' KV into the
  prefix cache and answers when it is there: ``{"engines": [PreloadStatus, ...], "errors":
  [{"index": i, "message": ...}]}`` (a prompt that fails does not stop the others).
- ``POST /v1/admin/unpin?engine_id=all|N``: releases every pinned block;
  ``{"engines": [{"engine_index": i, "num_unpinned": n}]}``.
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from llmtower.engine import memory_ops
from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.core_client import EngineDeadError
from llmtower.engine.preload_file import PreloadItem, parse_item
from llmtower.server.admin_kv_cache import parse_engine_id
from llmtower.server.errors import APIError

MAX_PRELOAD_PROMPTS = 10_000


class PreloadBody(msgspec.Struct, forbid_unknown_fields=True):
    prompts: list[Any]
    pin: bool = False
    engine_id: str = "all"
    cache_salt: str | None = None


def add_memory_routes(router: APIRouter, llm: AsyncLLM) -> None:
    encoder = msgspec.json.Encoder()

    def answer(obj: Any) -> Response:
        return Response(encoder.encode(obj), media_type="application/json")

    async def guarded(coro):
        try:
            return await coro
        except EngineDeadError as e:
            raise APIError(f"the engine is not running: {e}", 503, code="engine_dead") from None
        except asyncio.TimeoutError as e:
            raise APIError(f"the engine did not answer in time: {e}", 503,
                           code="engine_busy") from None
        except RuntimeError as e:  # the utility raised inside the engine
            raise APIError(str(e), 400) from None

    @router.post("/defrag")
    async def defrag(engine_id: str = "all") -> Response:
        index = parse_engine_id(engine_id, llm.num_engines)
        return answer({"engines": await guarded(memory_ops.defragment(llm, index))})

    @router.post("/unpin")
    async def unpin(engine_id: str = "all") -> Response:
        index = parse_engine_id(engine_id, llm.num_engines)
        counts = await guarded(memory_ops.unpin(llm, index))
        first = 0 if index is None else index
        return answer({"engines": [{"engine_index": first + k, "num_unpinned": n}
                                   for k, n in enumerate(counts)]})

    @router.post("/preload")
    async def preload(raw: Request) -> Response:
        try:
            body = msgspec.json.decode(await raw.body(), type=PreloadBody)
        except msgspec.ValidationError as e:
            raise APIError(f"invalid preload body: {e}; send {{\"prompts\": [{{\"prompt\": "
                           "...}} or {{\"messages\": [...]}}], \"pin\": false}}", 400) from None
        except msgspec.DecodeError as e:
            raise APIError(f"the body is not valid JSON: {e}", 400) from None
        if not body.prompts:
            raise APIError("'prompts' is empty: send at least one prompt", 400, param="prompts")
        if len(body.prompts) > MAX_PRELOAD_PROMPTS:
            raise APIError(f"{len(body.prompts)} prompts in one call; send at most "
                           f"{MAX_PRELOAD_PROMPTS} per call", 400, param="prompts")
        index = parse_engine_id(body.engine_id, llm.num_engines)
        items: list[tuple[int, PreloadItem]] = []
        bad: list[tuple[int, str]] = []  # (index in the body, why)
        for i, obj in enumerate(body.prompts):
            try:
                items.append((i, parse_item(obj, i)))
            except ValueError as exc:
                bad.append((i, str(exc)))
        statuses, errors = await guarded(memory_ops.preload(
            llm, [it for _, it in items], body.pin, index, body.cache_salt))
        # Back from positions among the readable items to positions in the body.
        bad += [(items[err.index][0], err.message) for err in errors]
        for st in statuses:
            for err in st.errors:
                err.index = items[err.index][0]
        bad.sort()
        return answer({"engines": statuses,
                       "errors": [{"index": i, "message": m} for i, m in bad]})


async def preload_at_start(llm: AsyncLLM, path: str, pin: bool) -> None:
    """``serve --preload-prompts FILE``: preload every readable line into every engine before
    serving; bad lines are logged with their number (the server still starts), a missing or
    empty file stops the start."""
    import logging

    from llmtower.engine.preload_file import read_prompts_file

    log = logging.getLogger(__name__)
    pf = read_prompts_file(path)
    for err in pf.errors:
        log.error("--preload-prompts: %s (skipped)", err)
    statuses, errors = await memory_ops.preload(llm, pf.items, pin)
    for e in errors:
        log.error("--preload-prompts: %s:%d: %s (skipped)", path, pf.items[e.index].line,
                  e.message)
    for st in statuses:
        log.info("preloaded %d prompt(s) of %s into engine %d: %d cached blocks, %d pinned "
                 "(%d/%d pinned in all)", st.num_done, path, st.engine_index,
                 st.num_cached_blocks, st.num_pinned_blocks, st.total_pinned_blocks,
                 st.max_pinned_blocks)
