"""`llmtower bench serve` against a live server, through the command line."""
from __future__ import annotations

import json

from llmtower.cli.main import main

from server_args import MODEL


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


def test_bench_serve_speaks_vllms_backend_and_endpoint_flags(tiny_server, tiny_tokenizer_dir,
                                                            capsys):
    host, port = tiny_server.base_url.removeprefix("http://").split(":")
    common = ["bench", "serve", "--host", host, "--port", port, "--tokenizer",
              str(tiny_tokenizer_dir), "--num-prompts", "3", "--random-input-len", "8",
              "--random-output-len", "4", "--ignore-eos", "--disable-tqdm"]
    assert main(common + ["--backend", "openai-chat"]) == 0
    assert "Successful requests:                     3" in capsys.readouterr().out
    assert main(common + ["--backend", "openai", "--endpoint", "/v1/completions"]) == 0
    assert "Successful requests:                     3" in capsys.readouterr().out
    # A wrong path is the server's 404, said in one line.
    assert main(common + ["--endpoint", "/v1/nothing"]) == 1
    assert "HTTP 404" in capsys.readouterr().err


def test_bench_serve_without_a_server_is_a_one_line_error(tiny_tokenizer_dir, capsys):
    from server_process import free_port

    argv = ["bench", "serve", "--port", str(free_port()), "--tokenizer", str(tiny_tokenizer_dir),
            "--num-prompts", "1", "--random-input-len", "4", "--disable-tqdm"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot reach a server" in err and "Traceback" not in err
    assert main(argv + ["--model", "m"]) == 1  # the test request fails instead
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err) and err[-1].startswith("llmtower bench serve:")
