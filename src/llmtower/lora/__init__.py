"""Many LoRA adapters on one base model (vLLM's multi-LoRA): PEFT folders loaded and checked
against the model (``peft_loader``), the executor's adapters kept LRU (``model_manager``), and
the step's batched low-rank product grouped by adapter (``punica``). The scheduler only counts
adapters per step (``core/sched/lora_slots.py``)."""
from llmtower.lora.request import LoRARequest

__all__ = ["LoRARequest"]
