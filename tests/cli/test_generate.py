"""`llmtower generate` and `llmtower chat` in a subprocess, on a tiny random-weight model. The
module's four commands run side by side (each mostly imports, on one core); every test reads
its own command's result."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures.tiny_models import tiny_llama_dir, tiny_tokenizer_dir  # noqa: F401

ENGINE_FLAGS = ["--num-threads", "1", "--max-model-len", "128", "--kv-cache-memory", "8MiB"]


def _argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmtower.cli.main", *args]


def _run_side_by_side(commands: dict[str, tuple[list[str], str]]
                      ) -> dict[str, subprocess.CompletedProcess]:
    procs = {name: subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for name, (argv, _) in commands.items()}
    try:
        done = {}
        for name, proc in procs.items():
            out, err = proc.communicate(commands[name][1], timeout=120)
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return done
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    return _run_side_by_side({
        "help": (_argv("generate", "--help"), ""),
        "bad_model": (_argv("generate", "--model",
                            str(tmp_path_factory.mktemp("no_model") / "nope"), "hi"), ""),
        "generate": (_argv("generate", "--model", str(tiny_llama_dir), "--max-tokens", "8",
                           "--temperature", "0", "--ignore-eos", *ENGINE_FLAGS, "Hello world"),
                     ""),
        "chat": (_argv("chat", "--model", str(tiny_llama_dir), "--max-tokens", "6",
                       "--temperature", "0", *ENGINE_FLAGS),
                 "Hello\nHow are you?\n/exit\nignored\n"),
    })


def test_generate_help_lists_sampling_and_engine_flags(runs):
    r = runs["help"]
    assert r.returncode == 0
    for flag in ("--max-tokens", "--temperature", "--top-p", "--top-k", "--seed", "--stop",
                 "--chat", "--model", "--kv-cache-memory"):
        assert flag in r.stdout


def test_generate_bad_model_is_a_clear_error(runs):
    r = runs["bad_model"]
    assert r.returncode != 0 and "not found" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture
def needs_factory():
    pytest.importorskip("llmtower.engine.factory",
                        reason="llmtower.engine.factory.create_engine_core is not built yet")


def test_generate_prints_the_completion(needs_factory, runs):
    r = runs["generate"]
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "8 tokens" in r.stderr and "finish_reason=length" in r.stderr


def test_chat_keeps_going_until_exit(needs_factory, runs):
    r = runs["chat"]
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stdout.splitlines() if line.strip()]) >= 2
