"""llmtower: an LLM inference and serving engine with vLLM's architecture."""
from __future__ import annotations

from llmtower.core.sampling_params import SamplingParams
from llmtower.lora.request import LoRARequest

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from llmtower.engine.llm import LLM
        return LLM
    raise AttributeError(f"module 'llmtower' has no attribute {name!r}")
