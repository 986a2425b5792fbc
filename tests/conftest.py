"""What every test shares: engines built with ``--dtype auto`` (the default) run in float32,
the dtype that is token-exact against transformers, whatever this CPU multiplies natively;
tests of the auto rule itself clear it (tests/test_utils.py). Set in the environment so that
the `llmtower serve` processes the server tests start follow it too.

And the default model's weights as a complete float32 Hugging Face folder, written once for
the tests that compare against transformers (the conversion is ~8 s of CPU)."""
from __future__ import annotations

import os

import pytest

from llmtower.utils import AUTO_DTYPE_ENV

os.environ.setdefault(AUTO_DTYPE_ENV, "float32")


@pytest.fixture(scope="session")
def smollm2_float32_dir(tmp_path_factory):
    """The installed default model's GGUF exported by convert_gguf_to_hf_dir (config,
    tokenizer, float32 safetensors) for transformers to load; skips without the package."""
    from llmtower.models import default_model
    from llmtower.models.gguf_convert import convert_gguf_to_hf_dir

    try:
        gguf = default_model.default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"the default model is not installed: {e}")
    out = tmp_path_factory.mktemp("smollm2_float32")
    convert_gguf_to_hf_dir(gguf, out)
    return out
