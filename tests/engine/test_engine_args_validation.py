"""Bad engine settings are refused when EngineArgs is built, with a message saying what to
change (issue 10), and --swap-space reads a bare number as GiB, as vLLM does."""
from __future__ import annotations


import pytest

from llmtower.core.sampling_params import SamplingParams
from llmtower.engine.arg_values import parse_swap_space, parse_tenant_weights
from llmtower.engine.args import EngineArgs
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


def test_a_sliding_window_does_not_cap_max_model_len(tmp_path_factory):
    """Sliding-window attention is implemented: a Mistral model with a 16-token window serves
    max_position_embeddings, and a prompt longer than the window is admitted."""
    from llmtower import LLM
    path = make_tiny_model_dir(tmp_path_factory, "mistral", sliding_window=16,
                               max_position_embeddings=128)
    llm = LLM(model=str(path), num_threads=1, kv_cache_memory="4MiB")
    assert llm.engine_core.scheduler.config.max_model_len == 128
    out = llm.generate([list(range(3, 73))], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_token_budget_defaults_smaller_for_gguf_blocks_unless_given():
    # GGUF block weights: a smaller prefill chunk keeps 16 prompts inside the file + KV + 0.6 GB
    # footprint; a budget the user gives is kept either way.
    assert EngineArgs().max_num_batched_tokens == 2048
    assert EngineArgs(quantization="gguf").max_num_batched_tokens == 512
    assert EngineArgs(quantization="gguf", max_num_batched_tokens=4096).max_num_batched_tokens == 4096
