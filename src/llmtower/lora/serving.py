"""Serving adapters: --lora-modules loaded at start, and the load / unload of
/v1/load_lora_adapter and /v1/unload_lora_adapter, on every engine."""
from __future__ import annotations

import asyncio
from typing import Any

from llmtower.lora.registry import LoRARegistry
from llmtower.lora.request import LoRARequest
from llmtower.lora.serving_args import parse_lora_modules


class LoRALoadError(ValueError):
    """An adapter the engines refused (the message says why)."""


def _clients(llm: Any) -> list[Any]:
    return getattr(llm.client, "clients", None) or [llm.client]


def _reason(e: BaseException) -> str:
    """The engine's own message, without the utility call's wrapping."""
    text = str(e)
    for method in ("add_lora", "remove_lora"):
        prefix = f"engine utility {method!r} failed: "
        if prefix in text:
            text = text.split(prefix, 1)[-1]
            for kind in ("LoRAAdapterError: ", "ValueError: "):
                text = text.removeprefix(kind)
    return text


async def load_adapter(llm: Any, registry: LoRARegistry, name: str, path: str,
                       base_model_name: str | None = None) -> LoRARequest:
    """Check and load an adapter on every engine, then serve it under ``name``; raises
    LoRALoadError with the engine's reason (nothing registered then)."""
    if registry.get(name) is not None:
        raise LoRALoadError(f"the LoRA adapter {name!r} has already been loaded")
    if name in llm.served_model_names:
        raise LoRALoadError(f"{name!r} is the base model's name: give the adapter another")
    req = registry.new_request(name, path, base_model_name)
    try:
        await asyncio.gather(*(c.call_utility("add_lora", req, timeout_s=120.0)
                               for c in _clients(llm)))
    except RuntimeError as e:
        raise LoRALoadError(_reason(e)) from None
    registry.add(req)
    return req


async def unload_adapter(llm: Any, registry: LoRARegistry, name: str) -> LoRARequest | None:
    """Stop serving ``name`` and unload it on every engine; None if it is not served. Raises
    LoRALoadError while requests use it (it stays served)."""
    req = registry.get(name)
    if req is None:
        return None
    try:
        await asyncio.gather(*(c.call_utility("remove_lora", req.lora_int_id, timeout_s=30.0)
                               for c in _clients(llm)))
    except RuntimeError as e:
        raise LoRALoadError(_reason(e)) from None
    registry.remove(name)
    return req


async def load_lora_modules(llm: Any, registry: LoRARegistry, modules: list[str] | None) -> None:
    """--lora-modules at start: a bad adapter stops the server with its reason."""
    for m in parse_lora_modules(modules):
        try:
            await load_adapter(llm, registry, m.name, m.path, m.base_model_name)
        except LoRALoadError as e:
            raise ValueError(f"--lora-modules {m.name}={m.path}: {e}") from None
