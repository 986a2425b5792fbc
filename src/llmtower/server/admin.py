"""Admin routes under ``/v1/admin/``: operator actions and views that are not part of the
OpenAI API (KV-cache snapshot, defragmentation, preload, priority changes, ...).

They sit behind ``--api-key`` like every non-public path (``middleware.PUBLIC_PATHS`` does not
list them). Each feature adds its routes to ``build_admin_router`` below; a route calls the
engine through ``AsyncLLM`` (a utility call between two steps), never into engine internals.
"""
from __future__ import annotations

from fastapi import APIRouter

from llmtower.engine.async_llm import AsyncLLM
from llmtower.server.admin_data_parallel import add_data_parallel_route
from llmtower.server.admin_kv_cache import add_kv_cache_route
from llmtower.server.admin_memory import add_memory_routes
from llmtower.server.admin_scheduling import add_scheduling_routes


def build_admin_router(llm: AsyncLLM) -> APIRouter:
    """The ``/v1/admin`` routes over one started ``AsyncLLM``."""
    router = APIRouter(prefix="/v1/admin")
    add_kv_cache_route(router, llm)  # GET /v1/admin/kv_cache (issue 13)
    add_memory_routes(router, llm)  # POST /v1/admin/defrag, preload, unpin (issue 14)
    add_scheduling_routes(router, llm)  # POST .../requests/{id}/priority, reset_prefix_cache
    add_data_parallel_route(router, llm)  # GET /v1/admin/data_parallel (issue 16)
    return router
