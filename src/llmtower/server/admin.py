"""Admin routes under ``/v1/admin/``: operator actions and views that are not part of the
OpenAI API (KV-cache snapshot, defragmentation, preload, priority changes, ...).

They sit behind ``--api-key`` like every non-public path (``middleware.PUBLIC_PATHS`` does not
list them). Each feature adds its routes to ``build_admin_router`` below; a route calls the
engine through ``AsyncLLM`` (a utility call between two steps), never into engine internals.
"""
from __future__ import annotations

from fastapi import APIRouter

from llmtower.engine.async_llm import AsyncLLM


def build_admin_router(llm: AsyncLLM) -> APIRouter:
    """The ``/v1/admin`` routes over one started ``AsyncLLM``."""
    router = APIRouter(prefix="/v1/admin")
    return router
