"""The EngineCore's LoRA calls (vLLM's ``add_lora`` / ``remove_lora`` / ``list_loras``),
answered by the executor's adapter manager."""
from __future__ import annotations

from typing import Any

from llmtower.lora.peft_loader import LoRAAdapterError
from llmtower.lora.request import LoRARequest


def add_lora(executor: Any, lora_request: LoRARequest | dict) -> bool:
    if isinstance(lora_request, dict):  # a utility call's argument arrives as a map
        lora_request = LoRARequest(**lora_request)
    add = getattr(executor, "add_lora", None)
    if add is None:
        raise ValueError("this executor runs no LoRA adapters")
    try:
        return bool(add(lora_request))
    except LoRAAdapterError:
        raise
    except OSError as e:
        raise LoRAAdapterError(f"LoRA adapter {lora_request.lora_name!r}: cannot read "
                               f"{lora_request.lora_path!r}: {e}") from e


def remove_lora(executor: Any, scheduler: Any, lora_id: int) -> bool:
    users = sum(1 for r in scheduler.requests.values()
                if r.lora_request is not None and r.lora_request.lora_int_id == lora_id)
    if users:
        raise ValueError(f"LoRA adapter {lora_id} is in use by {users} unfinished requests: "
                         "unload it after they finish")
    remove = getattr(executor, "remove_lora", None)
    return bool(remove(lora_id)) if remove is not None else False


def list_loras(executor: Any) -> list[int]:
    listing = getattr(executor, "list_loras", None)
    return list(listing()) if listing is not None else []
