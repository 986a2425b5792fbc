"""``GET /v1/admin/data_parallel``: the data-parallel view — which ranks serve, which are lost
and why, the process group's epoch and each live engine's sync counters (collectives run,
time they cost the busy loop, waves)."""
from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter

from llmtower.distributed.dp_group import DPStatus
from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.dp_client import DPEngineCoreClient
from llmtower.server.errors import APIError


def add_data_parallel_route(router: APIRouter, llm: AsyncLLM) -> None:
    @router.get("/data_parallel")
    async def data_parallel() -> dict[str, Any]:
        client = llm.client
        if not isinstance(client, DPEngineCoreClient):
            raise APIError("this server runs one engine: start it with --data-parallel-size N "
                           "for a data-parallel view", 404, code="not_data_parallel")
        statuses = await client.call_utility_each("dp_status", result_type=DPStatus,
                                                  timeout_s=10)
        return {**client.health(), "routed": client.router.num_routed,
                "prefix_affinity_hits": client.router.num_affinity_hits,
                "wave_starts": client.num_wave_starts,
                "engines": [dataclasses.asdict(s) for s in statuses]}
