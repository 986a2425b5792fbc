"""GGUF files with RoPE scaling, written the way llama.cpp's converter writes them (llama3 as a
``rope_freqs`` tensor of per-frequency divisors, linear and YaRN as ``rope.scaling.*`` keys),
served by llmtower from the file: greedy tokens equal transformers' on the Hugging Face
original in float32, through the whole engine (prefill, the fused decode step). The scaling is
chosen to change the tokens at these prompt lengths, and each case checks that it does."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from llmtower.models.gguf_convert import convert_gguf_to_hf_dir
from llmtower.models.gguf_loader import field_value, gguf_model_config, open_gguf
from llmtower.models.gguf_rope import gguf_rope_scaling
from llmtower.models.layers.rotary import rope_inv_freq
from tests.executor.exactness_helpers import add_greedy, hf_greedy, make_engine, random_prompts, run_all
from tests.fixtures.gguf_rope_writer import llama3_rope_factors
from tests.fixtures.tiny_gguf import write_gguf_from_hf_dir
from tests.fixtures.tiny_models import make_tiny_model_dir

MODEL = dict(hidden_size=64, num_heads=4, num_kv_heads=2, initializer_range=0.2, seed=3)
MAX_TOKENS = 6
PROMPTS = random_prompts(3, 20, 40, seed=26)
SCALINGS = {
    # Trained on 16 positions: every wavelength past 4 is stretched (one blended, the rest x8).
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
             "beta_fast": 16.0, "beta_slow": 2.0},
}


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg")))
        yield


@pytest.fixture(scope="module")
def scaled(tmp_path_factory, tiny_tokenizer_dir):
    """name -> (the Hugging Face original with that scaling, its GGUF), each built once."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in built:
            hf_dir = make_tiny_model_dir(tmp_path_factory, "llama", rope_scaling=SCALINGS[name],
                                         tokenizer_dir=tiny_tokenizer_dir, **MODEL)
            built[name] = hf_dir, write_gguf_from_hf_dir(
                hf_dir, tmp_path_factory.mktemp("g") / f"{name}.gguf")
        return built[name]
    return get


@pytest.mark.usefixtures("cache_home")
@pytest.mark.parametrize("name", list(SCALINGS))
def test_scaled_gguf_follows_transformers_greedy(name, scaled, tiny_tokenizer_dir, tmp_path_factory):
    hf_dir, path = scaled(name)
    want = hf_greedy(hf_dir, PROMPTS, MAX_TOKENS)
    plain = make_tiny_model_dir(tmp_path_factory, "llama", tokenizer_dir=tiny_tokenizer_dir, **MODEL)
    assert hf_greedy(plain, PROMPTS, MAX_TOKENS) != want, f"{name} scaling changes no token here"
    core = make_engine(path)
    add_greedy(core, PROMPTS, MAX_TOKENS)
    out = run_all(core)
    assert [out[str(i)] for i in range(len(PROMPTS))] == want


@pytest.mark.parametrize("name", list(SCALINGS))
def test_metadata_maps_back_onto_the_hf_scaling(name, scaled):
    reader = open_gguf(scaled(name)[1])
    config = gguf_model_config(reader)
    scaling = config.rope_scaling
    assert scaling is not None
    if name == "llama3":  # the factors themselves, as transformers' longrope reads them
        factors = llama3_rope_factors(SCALINGS[name], config.head_dim)
        assert scaling["rope_type"] == "longrope" and scaling["attention_factor"] == 1.0
        assert np.array_equal(np.float32(scaling["short_factor"]), factors)
        assert scaling["short_factor"] == scaling["long_factor"]
        # The frequencies the HF original rotates by, within a float32 rounding.
        ours, scale = rope_inv_freq(config.head_dim, config.rope_theta, scaling)
        theirs, _ = rope_inv_freq(config.head_dim, config.rope_theta, SCALINGS[name])
        assert scale == 1.0
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=2e-7, atol=0)
    else:
        assert scaling == SCALINGS[name]


def test_llama3_gguf_converts_to_a_directory_transformers_runs(scaled, tmp_path):
    """``gguf_convert``'s directory states the factors as transformers' longrope, so
    transformers itself serves it with the original's tokens."""
    hf_dir, path = scaled("llama3")
    out = tmp_path / "converted"
    out.mkdir()
    convert_gguf_to_hf_dir(path, out)
    assert hf_greedy(out, PROMPTS, MAX_TOKENS) == hf_greedy(hf_dir, PROMPTS, MAX_TOKENS)


def _gguf(tmp_path, keys: dict, freqs: np.ndarray | None = None):
    path = tmp_path / "rope.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in keys.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_float32(key, value)
    if freqs is not None:
        writer.add_tensor("rope_freqs.weight", freqs)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = open_gguf(path)
    return gguf_rope_scaling(reader, lambda k, d: field_value(reader, k, d), "llama", 128)


def test_plain_and_old_style_keys(tmp_path):
    assert _gguf(tmp_path, {}) is None
    assert _gguf(tmp_path, {"llama.rope.scaling.type": "none"}) is None
    assert _gguf(tmp_path, {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.0}) is None
    # As llama.cpp: a factor without a type is linear, under the key's older name too.
    assert _gguf(tmp_path, {"llama.rope.scaling.factor": 2.0}) == {"rope_type": "linear", "factor": 2.0}
    assert _gguf(tmp_path, {"llama.rope.scale_linear": 2.0}) == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("keys, freqs, match", [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}, True,
     "combines rope_freqs with llama.rope.scaling.type='linear'"),
    ({"llama.rope.scaling.type": "longrope"}, False, "scaling.type='longrope' is not supported"),
    ({"llama.rope.scaling.type": "su"}, False, "scaling.type='su' is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.yarn_ext_factor": 0.5}, False, "yarn_ext_factor=0.5 is not supported"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
      "llama.rope.scaling.yarn_log_multiplier": 0.1}, False, "yarn_log_multiplier"),
    ({"llama.rope.scaling.type": "yarn"}, False, "lacks llama.rope.scaling.factor"),
    ({"llama.rope.scaling.attn_factor": 0.5}, False, "attn_factor=0.5"),
])
def test_variants_without_a_hf_counterpart_are_refused(tmp_path, keys, freqs, match):
    with pytest.raises(ValueError, match=match):
        _gguf(tmp_path, keys, np.full(8, 2.0, np.float32) if freqs else None)


def test_wrong_number_of_factors_is_refused(tmp_path):
    scaling = _gguf(tmp_path, {}, np.full(3, 2.0, np.float32))
    with pytest.raises(ValueError, match="3 per-frequency factors but the head has 8"):
        rope_inv_freq(16, 10000.0, scaling)
