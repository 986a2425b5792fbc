"""`llmtower simulate run`: one run, --compare tables, JSON, plots and clear errors."""
from __future__ import annotations

import json

import pytest

from llmtower.cli.main import main

SMALL = ["simulate", "run", "--num-requests", "150", "--rate", "30", "--max-num-seqs", "16"]


def test_a_run_prints_the_serving_metrics_and_saves_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(SMALL + ["--priority-mix", "0:1,1:1", "--slo", "ttft:500", "tpot:50",
                         "--output-json", str(out), "--policy", "priority"]) == 0
    text = capsys.readouterr().out
    for line in ("Successful requests:", "Request throughput (req/s):", "Mean TTFT (ms):",
                 "P99 ITL (ms):", "Median TPOT (ms):", "Request goodput (req/s):",
                 "Preemptions:", "Prefix cache hit rate (%):", "Peak KV cache usage (%):",
                 "By priority"):
        assert line in text
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 150
    assert set(data["by_priority"]) == {"0", "1"}
    assert len(data["requests"]["ttft"]) == 150 and data["timeline"]["t"]


def test_compare_runs_every_variant_on_the_same_trace(tmp_path, capsys):
    out = tmp_path / "c.json"
    plot = tmp_path / "c.png"
    assert main(SMALL + ["--compare", "preemption_mode=recompute,swap", "--num-gpu-blocks", "300",
                         "--output-json", str(out), "--plot", str(plot)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "preemption_mode" in table[0] and table[1].split()[0] == "recompute"
    assert table[2].split()[0] == "swap"
    data = json.loads(out.read_text())
    runs = data["variants"]
    assert data["compare"] == "preemption_mode" and set(runs) == {"recompute", "swap"}
    rec, swp = runs["recompute"]["summary"], runs["swap"]["summary"]
    assert rec["total_input_tokens"] == swp["total_input_tokens"]
    assert runs["swap"]["summary"]["num_swap_outs"] > 0
    assert plot.stat().st_size > 10_000


def test_compare_accepts_booleans_and_cluster_settings(capsys):
    assert main(SMALL + ["--compare", "enable-prefix-caching=true,false",
                         "--num-prefix-groups", "2"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:3]
    assert float(rows[0].split()[-2]) > 0 and float(rows[1].split()[-2]) == 0  # hit %
    assert main(SMALL + ["--compare", "num_replicas=1,2"]) == 0


@pytest.mark.parametrize("spec, message", [
    ("policy", "FIELD=V1,V2"),
    ("rate=1,2", "same trace"),
    ("colour=red,blue", "unknown setting 'colour'"),
    ("enable_prefix_caching=maybe", "not a boolean"),
])
def test_bad_compare_specs_are_clear_errors(spec, message, capsys):
    assert main(SMALL + ["--compare", spec]) == 2
    assert message in capsys.readouterr().err


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    assert main(SMALL + ["--device", "h900"]) == 2
    assert "unknown device profile 'h900'" in capsys.readouterr().err
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"arrival_time": 0, "prompt_len": 5, "output_len": 2}\n{"arrival_time": 1}\n')
    assert main(["simulate", "run", "--trace", str(bad)]) == 2
    assert "t.jsonl:2: field 'prompt_len' is missing" in capsys.readouterr().err
    assert main(SMALL + ["--model", "llama-3-70b"]) == 2
    assert "--tensor-parallel-size" in capsys.readouterr().err


def test_a_saved_trace_replays_to_the_same_result(tmp_path):
    trace = tmp_path / "t.jsonl"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert main(SMALL + ["--num-prefix-groups", "3", "--save-trace", str(trace),
                         "--output-json", str(a)]) == 0
    assert main(["simulate", "run", "--trace", str(trace), "--max-num-seqs", "16",
                 "--output-json", str(b)]) == 0
    ra, rb = (json.loads(p.read_text())["summary"] for p in (a, b))
    for key in ("completed", "total_output_tokens", "ttft_ms", "e2el_ms", "prefix_cache_hit_rate"):
        assert ra[key] == rb[key]
