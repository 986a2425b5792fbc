"""`llmtower serve` command line: every option documented, defaults that bind locally."""
from __future__ import annotations

import argparse

import pytest

from llmtower.cli.main import build_parser


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_serve_option_has_a_help_line():
    p = _serve_parser()
    options = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert {"--model", "--host", "--port", "--api-key", "--request-timeout",
            "--max-request-body-bytes", "--max-num-seqs", "--kv-cache-memory",
            "--max-num-queued-reqs", "--max-num-queued-tokens"} <= {
                s for a in options for s in a.option_strings}
    for action in options:
        assert action.help and len(action.help) > 10, action.option_strings


def test_serve_binds_to_localhost_by_default():
    args = _serve_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.port == 8000
    assert args.api_key is None and args.request_timeout is None


@pytest.mark.parametrize("command", [["serve"], ["bench", "serve"], ["bench", "throughput"],
                                     ["simulate", "run"], ["generate"]])
def test_help_says_each_default_once(command):
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    text = " ".join(out.getvalue().split())
    import re
    assert not re.search(r"\(default: [^)]*\) \(default:", text)
    assert "(default: --model)" not in text and "(default: None)" not in text


@pytest.mark.parametrize("argv,field,value", [
    (["--scheduling-policy", "priority"], "policy", "priority"),
    (["--kv-cache-memory-bytes", "1000000"], "kv_cache_memory_bytes", 1000000),
    (["--kv-cache-memory-bytes", "2G"], "kv_cache_memory_bytes", 2 * 2**30),
    (["--kv-cache-memory-bytes", "2g"], "kv_cache_memory_bytes", 2 * 10**9),
    (["-tp", "1"], "tensor_parallel_size", 1),
    (["-pp", "1"], "pipeline_parallel_size", 1),
    (["-q", "int8"], "quantization", "int8"),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--no-enable-chunked-prefill"], "enable_chunked_prefill", False),
    (["--max-logprobs", "5"], "max_logprobs", 5),
    (["--num-gpu-blocks-override", "64"], "num_gpu_blocks", 64),
    (["-dp", "2"], "data_parallel_size", 2),
    (["--max-model-len", "4k"], "max_model_len", 4000),
    (["--max-model-len", "32K"], "max_model_len", 32768),
    (["--max-num-batched-tokens", "2K"], "max_num_batched_tokens", 2048),
    (["--served-model-name", "a", "b"], "served_model_name", ["a", "b"]),
    (["--api-key", "k1", "k2"], "api_key", ["k1", "k2"]),
    (["--generation-config", "vllm"], "generation_config", "vllm"),
])
def test_vllm_flag_spellings(argv, field, value):
    assert getattr(_serve_parser().parse_args(argv), field) == value


def test_token_counts_that_are_not_whole_numbers_are_refused(capsys):
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["--max-model-len", "1.5"])
    assert "not a whole number" in capsys.readouterr().err


def test_model_as_positional_argument_and_twice_is_an_error():
    from llmtower.cli.serve import resolve_model
    from llmtower.engine.args import DEFAULT_MODEL

    args = _serve_parser().parse_args(["/models/x"])
    resolve_model(args, DEFAULT_MODEL)
    assert args.model == "/models/x"
    args = _serve_parser().parse_args(["/models/x", "--model", "/models/y"])
    with pytest.raises(ValueError, match="given twice"):
        resolve_model(args, DEFAULT_MODEL)


def test_config_file_sets_defaults_and_the_command_line_wins(tmp_path):
    from llmtower.cli.config_file import apply_config_file

    cfg = tmp_path / "c.yaml"
    cfg.write_text("max-num-seqs: 7\nscheduling_policy: sjf\nenable-prefix-caching: false\n"
                   "api-key: [a, b]\nmax-model-len: 2K\n")
    p = _serve_parser()
    apply_config_file(p, str(cfg))
    args = p.parse_args(["--max-num-seqs", "9"])
    assert (args.max_num_seqs, args.policy, args.enable_prefix_caching, args.api_key,
            args.max_model_len) == (9, "sjf", False, ["a", "b"], 2048)


@pytest.mark.parametrize("text,message", [
    ("no-such-flag: 1\n", "unknown flag 'no-such-flag'"),
    ("policy: lifo\n", "not one of"),
    ("enable-prefix-caching: maybe\n", "true or false"),
    ("- a\n- b\n", "must be a mapping"),
])
def test_config_file_errors_name_the_key(tmp_path, text, message):
    from llmtower.cli.main import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=message):
        from llmtower.cli.config_file import apply_config_file
        apply_config_file(_serve_parser(), str(cfg))
    assert main(["serve", "--config", str(cfg)]) == 2  # a one-line error, no traceback
