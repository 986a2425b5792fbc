"""``LoRARequest``: which adapter a request runs with, named as vLLM names it."""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """Names one adapter: ``lora_name`` (what clients send as ``model``), ``lora_int_id`` (a
    positive id unique per adapter: the executor's and the prefix cache's key for it) and
    ``lora_path`` (a local PEFT folder). ``base_model_name``: the model it was trained for, as
    listed by /v1/models (optional)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive "
                             f"integer (0 means no adapter), got {self.lora_int_id}")
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id
