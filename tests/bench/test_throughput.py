"""`llmtower bench throughput` end to end on a tiny model: figures printed and written as JSON."""
from __future__ import annotations

import json

import numpy as np
import pytest

from llmtower.bench.throughput import input_lengths
from llmtower.cli.main import main
from tests.fixtures.tiny_models import tiny_llama_dir, tiny_tokenizer_dir  # noqa: F401


def test_bench_throughput_prints_and_writes_json(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "result.json"
    rc = main(["bench", "throughput", "--model", str(tiny_llama_dir), "--num-prompts", "6",
               "--input-len-range", "4:20", "--output-len", "5", "--ignore-eos", "--num-threads", "1",
               "--max-model-len", "64", "--kv-cache-memory", "4MiB", "--output-json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "output tokens/s" in printed
    result = json.loads(out.read_text())
    assert result["num_requests"] == 6 and result["num_output_tokens"] == 30
    assert result["output_tokens_per_second"] > 0
    assert result["tokens_per_second"] > result["output_tokens_per_second"]


def test_prompt_lengths():
    rng = np.random.default_rng(0)
    lens = input_lengths(1000, 100, 0.5, None, rng)
    assert lens.min() >= 50 and lens.max() <= 150 and len(set(lens.tolist())) > 50
    assert set(input_lengths(50, 0, 0.0, "32:33", rng).tolist()) == {32, 33}
    assert set(input_lengths(5, 7, 0.0, None, rng).tolist()) == {7}
    with pytest.raises(ValueError, match="LO:HI"):
        input_lengths(5, 7, 0.0, "32-256", rng)
