"""The server's adapters by name: what clients send as ``model``, each with the
``LoRARequest`` the engine runs it with."""
from __future__ import annotations

from llmtower.lora.request import LoRARequest


class LoRARegistry:
    """Owns the served adapters (name -> LoRARequest, in the order added) and hands out their
    ``lora_int_id``s (never reused: an id names one adapter's weights in the engine's LRU and
    prefix cache, even after an unload)."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name is not None else None

    def new_request(self, name: str, path: str, base_model_name: str | None = None
                    ) -> LoRARequest:
        """A LoRARequest with a fresh id (not registered until ``add``)."""
        req = LoRARequest(name, self._next_id, path, base_model_name)
        self._next_id += 1
        return req

    def add(self, req: LoRARequest) -> None:
        if req.lora_name in self._by_name:
            raise ValueError(f"the LoRA adapter {req.lora_name!r} has already been loaded")
        self._by_name[req.lora_name] = req

    def remove(self, name: str) -> LoRARequest | None:
        return self._by_name.pop(name, None)

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def names(self) -> list[str]:
        return list(self._by_name)
