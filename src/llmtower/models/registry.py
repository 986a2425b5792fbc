"""Which model class serves which Hugging Face architecture (config.json's ``architectures``).

Adding a family is one line here and one file under models/. Modules are imported on first
use, so reading a config does not import every family.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmtower.models.interface import CausalLM


@dataclass(frozen=True)
class Family:
    """One supported architecture: the module and class that implement it, and the
    ``model_type`` config.json files name it by when they lack ``architectures``."""

    module: str
    cls: str
    model_type: str


_M = "llmtower.models."
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(_M + "llama", "LlamaForCausalLM", "llama"),
    "Qwen2ForCausalLM": Family(_M + "llama", "LlamaForCausalLM", "qwen2"),
    "Qwen3ForCausalLM": Family(_M + "llama", "LlamaForCausalLM", "qwen3"),
    "MistralForCausalLM": Family(_M + "llama", "LlamaForCausalLM", "mistral"),
    "Phi3ForCausalLM": Family(_M + "llama", "LlamaForCausalLM", "phi3"),
    "Gemma2ForCausalLM": Family(_M + "gemma", "Gemma2ForCausalLM", "gemma2"),
    "Gemma3ForCausalLM": Family(_M + "gemma", "Gemma3ForCausalLM", "gemma3_text"),
    "GraniteForCausalLM": Family(_M + "granite", "GraniteForCausalLM", "granite"),
    "Olmo2ForCausalLM": Family(_M + "olmo2", "Olmo2ForCausalLM", "olmo2"),
    "Olmo3ForCausalLM": Family(_M + "olmo3", "Olmo3ForCausalLM", "olmo3"),
    "SmolLM3ForCausalLM": Family(_M + "smollm3", "SmolLM3ForCausalLM", "smollm3"),
    "MixtralForCausalLM": Family(_M + "moe", "MixtralForCausalLM", "mixtral"),
    "Qwen2MoeForCausalLM": Family(_M + "moe", "Qwen2MoeForCausalLM", "qwen2_moe"),
    "Qwen3MoeForCausalLM": Family(_M + "moe", "Qwen3MoeForCausalLM", "qwen3_moe"),
    "OlmoeForCausalLM": Family(_M + "moe", "OlmoeForCausalLM", "olmoe"),
    "GptOssForCausalLM": Family(_M + "gpt_oss", "GptOssForCausalLM", "gpt_oss"),
}

# Kinds of model that stay unsupported, recognized by a part of the architecture's name, so
# the refusal says why and not only that.
_UNSUPPORTED_KINDS = (
    (("ForConditionalGeneration", "Vision", "VL", "Llava", "Whisper"),
     "multimodal (image / audio inputs): serve its text-only variant if there is one"),
    (("Mamba", "Jamba", "Zamba", "FalconH1", "NemotronH", "Hymba", "GraniteMoeHybrid",
      "Lfm2", "RecurrentGemma"),
     "a state-space / attention hybrid (no paged KV cache for its recurrent layers)"),
    (("Bert", "Roberta", "T5", "Bart", "Encoder", "ForMaskedLM", "ForSequenceClassification",
      "ForTokenClassification", "ForPreTraining"),
     "an encoder or a model without a language-modelling head"),
)


def supported_architectures() -> tuple[str, ...]:
    """Every architecture name llmtower loads, in registry order."""
    return tuple(FAMILIES)


def architecture_of_model_type(model_type: str) -> str:
    """The architecture a config.json's ``model_type`` stands for ('' if none)."""
    return next((a for a, f in FAMILIES.items() if f.model_type == model_type), "")


def check_architecture(arch: str, where: str = "") -> None:
    """Raise ValueError naming ``arch``, why it is refused where known, and what is supported."""
    if arch in FAMILIES:
        return
    why = next((w for parts, w in _UNSUPPORTED_KINDS if any(p in arch for p in parts)), "")
    at = f" in {where}" if where else ""
    kind = f" ({why})" if why else ""
    raise ValueError(f"unsupported architecture {arch!r}{at}{kind}: llmtower loads "
                     f"{', '.join(FAMILIES)}")


def model_class(arch: str) -> type[CausalLM]:
    """The class that serves ``arch`` (ValueError for an unsupported one)."""
    check_architecture(arch)
    family = FAMILIES[arch]
    cls: type[CausalLM] = getattr(importlib.import_module(family.module), family.cls)
    return cls
