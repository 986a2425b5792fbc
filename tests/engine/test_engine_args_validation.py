"""Bad engine settings are refused when EngineArgs is built, with a message saying what to
change (issue 10), and --swap-space reads a bare number as GiB, as vLLM does."""
from __future__ import annotations

import logging

import pytest

from llmtower.core.errors import AdmissionError
from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.args import EngineArgs, parse_swap_space, parse_tenant_weights
from tests.fixtures.tiny_models import make_tiny_model_dir


@pytest.mark.parametrize("kw, words", [
    ({"dtype": "float16"}, ["float16", "bfloat16", "--dtype"]),
    ({"dtype": "fp8"}, ["dtype='fp8'", "'float32'"]),
    ({"policy": "lifo"}, ["policy='lifo'", "'fair'"]),
    ({"preemption_mode": "drop"}, ["preemption_mode"]),
    ({"preemption_victim": "oldest"}, ["preemption_victim", "'remaining'"]),
    ({"attention_backend": "cuda"}, ["attention_backend"]),
    ({"block_size": 0}, ["block_size=0", ">= 1"]),
    ({"max_num_seqs": -1}, ["max_num_seqs"]),
    ({"tenant_weights": "a=0"}, ["a", "> 0"]),
    ({"tenant_weights": "a:2"}, ["tenant=weight"]),
    ({"swap_space": "lots"}, ["lots"]),
    ({"swap_space_dtype": "int8"}, ["--preemption-mode swap", "'recompute'"]),
])
def test_bad_settings_are_refused_at_construction(kw, words):
    with pytest.raises(ValueError) as e:
        EngineArgs(**kw)
    for w in words:
        assert w in str(e.value)


def test_int8_swap_space_with_swap_preemption_is_accepted():
    assert EngineArgs(swap_space_dtype="int8", preemption_mode="swap").swap_space_dtype == "int8"


def test_swap_space_bare_number_is_gib():
    assert parse_swap_space("4") == 4 * 2**30
    assert parse_swap_space(4) == 4 * 2**30
    assert parse_swap_space("0.5") == 2**29
    assert parse_swap_space("512MiB") == 512 * 2**20
    assert parse_swap_space("2GB") == 2 * 10**9


def test_tenant_weights():
    assert parse_tenant_weights("a=2, b=1") == {"a": 2.0, "b": 1.0}
    assert parse_tenant_weights("") == {}
    cfg = EngineArgs(policy="fair", tenant_weights="a=2").create_scheduler_config(64)
    assert cfg.policy == "fair" and cfg.tenant_weights == {"a": 2.0}


def test_sliding_window_cap_is_warned_and_named_at_admission(tmp_path_factory, caplog):
    from llmtower import LLM
    path = make_tiny_model_dir(tmp_path_factory, "mistral", sliding_window=64)
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(path), num_threads=1, kv_cache_memory="4MiB")
    assert any("sliding window is 64" in r.getMessage() for r in caplog.records)
    assert llm.engine_core.scheduler.config.max_model_len == 64
    with pytest.raises(AdmissionError) as e:
        llm.generate([list(range(3, 73))], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    assert "max_model_len) is 64 tokens because the model's sliding window is 64" in str(e.value)
    assert "sliding-window attention is not implemented" in str(e.value)
