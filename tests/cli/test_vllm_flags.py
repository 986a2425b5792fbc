"""vLLM's `vllm serve` flags at `llmtower serve` (and the same settings as `LLM(...)` keyword
arguments): each is honoured with vLLM's meaning, or accepted with one warning line where it
changes nothing on this CPU engine, or refused with an error that says what to use instead."""
from __future__ import annotations

import argparse
import logging

import pytest

from llmtower.cli.main import build_parser, main
from llmtower.engine.args import EngineArgs
from tests.fixtures.tiny_models import tiny_llama_dir, tiny_tokenizer_dir  # noqa: F401


def _serve_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv,message", [
    (["-tp", "2"], "use --data-parallel-size"),
    (["--tensor-parallel-size", "4"], "use --data-parallel-size"),
    (["-pp", "2"], "use --data-parallel-size"),
    (["--gpu-memory-utilization", "0.9"], "size the KV cache with --kv-cache-memory"),
    (["--revision", "main"], "never downloads"),
    (["--tokenizer-revision", "v1"], "never downloads"),
    (["--download-dir", "/models"], "never downloads"),
    (["--load-format", "pt"], "Convert other checkpoints to safetensors"),
    (["--load-format", "gguf"], "needs a .gguf file"),
    (["--tokenizer-mode", "mistral"], "use --tokenizer-mode auto"),
    (["--max-logprobs", "-1"], "at most 20 logprobs"),
    (["--max-logprobs", "50"], "at most 20 logprobs"),
    (["--kv-cache-memory-bytes", "0"], "byte count > 0"),
    (["--response-role", "bot"], "always have the role 'assistant'"),
    (["--ssl-keyfile", "key.pem"], "needs both --ssl-keyfile and --ssl-certfile"),
    (["--enable-log-requests", "--disable-log-requests"], "contradict"),
    (["--no-disable-uvicorn-access-log"], "use --enable-log-requests"),
    (["--no-enable-prompt-tokens-details"], "always sends"),
    (["--allow-credentials", "--allowed-origins", "*"], "name the origins"),
])
def test_refused_vllm_flags_say_what_to_use_instead(argv, message, capsys):
    # Refused before any model is loaded: a one-line error, exit status 2, no traceback.
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_flags_that_change_nothing_here_log_one_warning_each(caplog):
    args = _serve_args(["--enforce-eager", "--trust-remote-code", "-tp", "1"])
    with caplog.at_level(logging.WARNING):
        EngineArgs.from_cli_args(args)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(lines) == 2, lines
    assert lines[0].startswith("--enforce-eager changes nothing here") and "CUDA graphs" in lines[0]
    assert lines[1].startswith("--trust-remote-code changes nothing here")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        EngineArgs.from_cli_args(_serve_args([]))
    assert not caplog.records  # nothing to say when no such flag is given


def test_kv_cache_memory_bytes_reads_vllms_units_and_wins():
    assert EngineArgs.from_cli_args(_serve_args(["--kv-cache-memory-bytes", "2G"])
                                    ).kv_cache_memory == str(2 * 2**30)
    args = _serve_args(["--kv-cache-memory", "1GiB", "--kv-cache-memory-bytes", "512M"])
    assert EngineArgs.from_cli_args(args).kv_cache_memory == str(512 * 2**20)
    assert EngineArgs(kv_cache_memory_bytes="1k").kv_cache_memory == "1000"  # LLM(...) form


def test_old_and_new_request_log_spellings():
    from llmtower.cli.serve import log_requests
    assert log_requests(_serve_args([])) is False
    assert log_requests(_serve_args(["--disable-log-requests"])) is False
    assert log_requests(_serve_args(["--enable-log-requests"])) is True
    assert log_requests(_serve_args(["--no-disable-log-requests"])) is True
    assert log_requests(_serve_args(["--enable-log-requests", "--no-enable-log-requests"])) \
        is False


def test_frontend_flags_in_vllms_json_form_and_as_words():
    from llmtower.cli.serve import frontend_options
    opts = frontend_options(_serve_args(["--allowed-origins", '["https://a.example"]',
                                         "--allowed-methods", "GET", "POST",
                                         "--enable-force-include-usage", "--root-path", "/llm"]))
    assert opts.allowed_origins == ["https://a.example"]
    assert opts.allowed_methods == ["GET", "POST"] and opts.allowed_headers is None
    assert opts.enable_force_include_usage and opts.root_path == "/llm"
    assert opts.scheme == "http"


def test_config_file_takes_the_vllm_flags(tmp_path):
    from llmtower.cli.config_file import apply_config_file
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tensor-parallel-size: 1\nenforce-eager: true\nkv-cache-memory-bytes: 1G\n"
                   "enable-request-id-headers: true\nallowed-origins: ['*']\n"
                   "max-logprobs: 4\n")
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    apply_config_file(sub.choices["serve"], str(cfg))
    args = sub.choices["serve"].parse_args([])
    assert (args.tensor_parallel_size, args.enforce_eager, args.kv_cache_memory_bytes,
            args.enable_request_id_headers, args.allowed_origins, args.max_logprobs) == (
        1, True, 2**30, True, ["*"], 4)


def test_override_generation_config_merges_over_the_models_defaults(tmp_path):
    import json

    from llmtower.engine.input_processor import load_generation_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "do_sample": False}))
    assert load_generation_defaults("auto", tmp_path) == {"temperature": 0.0, "top_p": 0.9}
    args = EngineArgs.from_cli_args(_serve_args(
        ["--override-generation-config", '{"temperature": 0.3, "max_new_tokens": 7}']))
    assert load_generation_defaults("auto", tmp_path, args.generation_overrides()) == {
        "temperature": 0.3, "top_p": 0.9, "max_tokens": 7}
    assert load_generation_defaults("vllm", tmp_path, {"top_k": 5}) == {"top_k": 5}
    cfg = tmp_path / "c.yaml"  # a YAML mapping works as the JSON value
    cfg.write_text("override-generation-config: {top_k: 4}\n")
    from llmtower.cli.config_file import apply_config_file
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    apply_config_file(sub.choices["serve"], str(cfg))
    assert EngineArgs.from_cli_args(sub.choices["serve"].parse_args([])
                                    ).generation_overrides() == {"top_k": 4}
    with pytest.raises(ValueError, match="no sampling default"):
        EngineArgs(override_generation_config='{"temp": 1}')


def test_offline_llm_takes_vllm_keyword_arguments(tiny_llama_dir, caplog):
    from llmtower.core.sampling_params import SamplingParams
    from llmtower import LLM as EngineLLM

    with pytest.raises(ValueError, match="no GPU"):
        EngineLLM(str(tiny_llama_dir), gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="use --data-parallel-size"):
        EngineLLM(str(tiny_llama_dir), tensor_parallel_size=2)
    with caplog.at_level(logging.WARNING):
        llm = EngineLLM(str(tiny_llama_dir), tensor_parallel_size=1, enforce_eager=True,
                        max_logprobs=2, num_threads=1, max_model_len=128,
                        kv_cache_memory_bytes="8M",
                        override_generation_config={"max_new_tokens": 3, "temperature": 0})
    assert any("--enforce-eager changes nothing here" in r.getMessage()
               for r in caplog.records)
    out = llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0, logprobs=2))
    assert len(out[0].outputs[0].token_ids) == 2
    assert len(llm.generate(["hello"])[0].outputs[0].token_ids) <= 3  # the override's default
    with pytest.raises(ValueError, match="max_logprobs of 2"):
        llm.generate(["hello"], SamplingParams(max_tokens=2, logprobs=3))
