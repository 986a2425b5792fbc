"""Device and model profiles: shipped data files, user files, Hugging Face configs."""
from __future__ import annotations

import json

import pytest

from llmtower.sim.profiles import available, load_device, load_model

DEVICES = ["h100", "h200", "a100", "l4"]
MODELS = ["llama-3-8b", "llama-3-70b", "qwen2.5-7b", "smollm2-135m", "w1"]


@pytest.mark.parametrize("name", DEVICES)
def test_shipped_devices_load_and_cite_their_source(name):
    d = load_device(name)
    assert d.name == name and d.source and d.peak_flops > 1e13 and d.mem_bandwidth > 1e11


@pytest.mark.parametrize("name", MODELS)
def test_shipped_models_load_and_cite_their_source(name):
    m = load_model(name)
    assert m.name == name and m.source


def test_parameter_counts_match_the_published_model_sizes():
    assert load_model("llama-3-8b").num_params == pytest.approx(8.03e9, rel=0.01)
    assert load_model("llama-3-70b").num_params == pytest.approx(70.6e9, rel=0.01)
    assert load_model("qwen2.5-7b").num_params == pytest.approx(7.6e9, rel=0.02)
    assert load_model("smollm2-135m").num_params == pytest.approx(134.5e6, rel=0.02)
    assert load_model("llama-3-8b").kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_unknown_profile_lists_the_available_ones():
    with pytest.raises(ValueError, match="unknown device profile 'h900'.*h100"):
        load_device("h900")
    assert set(DEVICES) <= set(available("device"))
    assert set(MODELS) <= set(available("model"))


def test_a_user_profile_file_is_loaded_and_checked(tmp_path):
    f = tmp_path / "mygpu.json"
    f.write_text(json.dumps({"kind": "device", "peak_flops": 1e14, "mem_bandwidth": 1e12,
                             "memory_bytes": 1e10}))
    assert load_device(str(f)).name == "mygpu"
    f.write_text(json.dumps({"kind": "device", "peak_flops": 1e14, "mem_bandwith": 1e12,
                             "memory_bytes": 1e10}))
    with pytest.raises(ValueError, match="unknown field.*mem_bandwith"):
        load_device(str(f))
    f.write_text(json.dumps({"kind": "device", "peak_flops": -1, "mem_bandwidth": 1e12,
                             "memory_bytes": 1e10}))
    with pytest.raises(ValueError, match="peak_flops"):
        load_device(str(f))


def test_profiles_on_the_search_path_win(tmp_path, monkeypatch):
    (tmp_path / "h100.json").write_text(json.dumps(
        {"kind": "device", "name": "h100", "peak_flops": 1e12, "mem_bandwidth": 1e9,
         "memory_bytes": 1e9}))
    monkeypatch.setenv("LLMTOWER_PROFILE_PATH", str(tmp_path))
    assert load_device("h100").peak_flops == 1e12


def test_a_hugging_face_model_directory_is_a_model_profile(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 512, "torch_dtype": "float32", "tie_word_embeddings": True}))
    m = load_model(str(tmp_path))
    assert (m.hidden_size, m.num_kv_heads, m.dtype_bytes, m.head_size) == (64, 2, 4, 16)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="lacks num_hidden_layers"):
        load_model(str(tmp_path))


def test_the_shipped_cpu_profile_is_a_calibration_of_this_machine():
    cpu = load_device("cpu")
    assert cpu.calibration["model"] == "w1" and "calibrate" in cpu.source
    assert cpu.overlap in ("max", "sum") and cpu.default_kv_cache_bytes > 0
    assert cpu.compute_efficiency == cpu.bandwidth_efficiency == 1.0
