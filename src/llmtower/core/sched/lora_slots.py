"""The scheduler's LoRA rule: at most ``max_loras`` distinct adapters among running requests,
so that no step holds more (every running request may run in any step)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmtower.core.request import Request


class LoRASlots:
    """Owns one ``schedule()`` call's set of adapters in use: the running requests' adapters,
    plus those of requests admitted so far this step."""

    __slots__ = ("max_loras", "active")

    def __init__(self, max_loras: int, running: Iterable[Request]) -> None:
        self.max_loras = max_loras
        self.active = {r.lora_request.lora_int_id for r in running
                       if r.lora_request is not None}

    def admits(self, req: Request) -> bool:
        """Whether ``req`` may run beside the active adapters (base-model requests always)."""
        lora = req.lora_request
        return (lora is None or lora.lora_int_id in self.active
                or len(self.active) < self.max_loras)

    def add(self, req: Request) -> None:
        if req.lora_request is not None:
            self.active.add(req.lora_request.lora_int_id)


def lora_slots(max_loras: int, running: Iterable[Request]) -> LoRASlots | None:
    """This step's slots, or None when LoRA is off (``max_loras`` 0): no cost per step."""
    return LoRASlots(max_loras, running) if max_loras > 0 else None


def lora_stats(max_loras: int, running: Iterable[Request], waiting: Iterable[Request]
               ) -> dict[str, Any]:
    """SchedulerStats' LoRA fields: the adapters of running and waiting requests by name, in
    the order first seen (empty when LoRA is off)."""
    if max_loras <= 0:
        return {}

    def names(reqs: Iterable[Request]) -> list[str]:
        return list(dict.fromkeys(r.lora_request.lora_name for r in reqs
                                  if r.lora_request is not None))

    return {"max_lora": max_loras, "running_lora_adapters": names(running),
            "waiting_lora_adapters": names(waiting)}
