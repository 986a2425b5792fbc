"""`llmtower bench serve` against a live server, through the command line."""
from __future__ import annotations

import json

from llmtower.cli.main import main

from conftest import MODEL


def test_bench_serve_reports_and_saves_figures(tiny_server, tiny_tokenizer_dir, tmp_path, capsys):
    common = ["bench", "serve", "--base-url", tiny_server.base_url, "--tokenizer",
              str(tiny_tokenizer_dir), "--num-prompts", "12", "--random-input-len", "24",
              "--random-output-len", "8", "--ignore-eos", "--disable-tqdm", "--seed", "1"]
    assert main(common + ["--request-rate", "50", "--burstiness", "0.5", "--goodput",
                          "ttft:60000", "--save-result", "--result-dir", str(tmp_path),
                          "--result-filename", "run.json"]) == 0
    out = capsys.readouterr().out
    assert "Successful requests:                     12" in out
    assert "Failed requests:                         0" in out
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["completed"] == 12 and saved["total_output_tokens"] == 12 * 8
    assert saved["config"]["model"] == MODEL and saved["request_goodput"] > 0
    assert saved["ttft_ms"]["p99"] >= saved["ttft_ms"]["median"] > 0
    assert main(common + ["--endpoint", "chat", "--max-concurrency", "4"]) == 0
    assert "Successful requests:                     12" in capsys.readouterr().out
