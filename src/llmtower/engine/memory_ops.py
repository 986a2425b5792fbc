"""The API process's side of the memory operations on running engines: defragmentation,
prefix preload and unpin, on one engine or on every data-parallel engine (each has its own KV
cache and prefix cache). They run as utility calls between two engine steps, so requests in
flight keep running."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from llmtower.core.kv_cache.relocator import DefragResult
from llmtower.engine.preload import PreloadError, PreloadStatus
from llmtower.engine.preload_file import PreloadItem

if TYPE_CHECKING:
    from llmtower.engine.async_llm import AsyncLLM

# How often a preload asks its engines how far they are.
PRELOAD_POLL_S = 0.05


async def defragment(llm: AsyncLLM, engine_id: int | None = None,
                     timeout_s: float = 60.0) -> list[DefragResult]:
    """A full KV defragmentation on each chosen engine."""
    indices = llm.engine_indices(engine_id)
    results = await asyncio.gather(*(
        llm.client.call_utility_on(i, "defragment", result_type=DefragResult,
                                   timeout_s=timeout_s) for i in indices))
    for i, r in zip(indices, results):
        r.engine_index = i
    return list(results)


async def unpin(llm: AsyncLLM, engine_id: int | None = None,
                timeout_s: float = 10.0) -> list[int]:
    """Release every pinned prefix block; the number released per engine."""
    return list(await asyncio.gather(*(
        llm.client.call_utility_on(i, "unpin", result_type=int, timeout_s=timeout_s)
        for i in llm.engine_indices(engine_id))))


async def tokenize_items(llm: AsyncLLM, items: list[PreloadItem]) -> tuple[list[list[int]], list[int],
                                                                      list[PreloadError]]:
    """Token ids of each item (chat messages through the template); items that cannot be
    rendered become errors. Returns (token ids, their item indices, errors)."""
    prompts: list[list[int]] = []
    where: list[int] = []
    errors: list[PreloadError] = []
    for i, item in enumerate(items):
        try:
            if item.messages is not None:
                _, ids = await llm.render_chat_async(item.messages, item.add_generation_prompt)
            else:
                ids = await llm.encode_async(item.prompt or "")
            ids = llm.check_prompt(ids)
        except Exception as e:  # a template error, a prompt too long for the model, ...
            errors.append(PreloadError(i, f"{type(e).__name__}: {e}"))
            continue
        prompts.append(ids)
        where.append(i)
    return prompts, where, errors


async def preload(llm: AsyncLLM, items: list[PreloadItem], pin: bool = False,
                  engine_id: int | None = None, cache_salt: str | None = None,
                  timeout_s: float = 600.0) -> tuple[list[PreloadStatus], list[PreloadError]]:
    """Compute the KV of ``items`` into the prefix cache of each chosen engine and wait until
    it is there. Returns each engine's status and the items that failed (by item index),
    whether in tokenization or in the engine."""
    prompts, where, errors = await tokenize_items(llm, items)
    indices = llm.engine_indices(engine_id)
    if not prompts:
        return [PreloadStatus(engine_index=i) for i in indices], errors
    started = await asyncio.gather(*(
        llm.client.call_utility_on(i, "preload", prompts, pin, cache_salt,
                                   result_type=PreloadStatus, timeout_s=10.0)
        for i in indices))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    statuses: list[PreloadStatus] = []
    for i, st in zip(indices, started):
        while not st.finished:
            if loop.time() > deadline:
                raise asyncio.TimeoutError(f"engine {i} did not finish the preload within "
                                           f"{timeout_s:g} s")
            await asyncio.sleep(PRELOAD_POLL_S)
            st = await llm.client.call_utility_on(i, "preload_status", st.batch_id,
                                                  result_type=PreloadStatus, timeout_s=10.0)
        st.engine_index = i
        statuses.append(st)
    seen = {e.index for e in errors}
    for st in statuses:  # the engine numbers prompts in the order sent: map back to items
        for e in st.errors:
            idx = where[e.index]
            if idx not in seen:
                seen.add(idx)
                errors.append(PreloadError(idx, e.message))
        st.errors = [PreloadError(where[e.index], e.message) for e in st.errors]
    errors.sort(key=lambda e: e.index)
    return statuses, errors
