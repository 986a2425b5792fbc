"""An engine given a memory limit (here ``ulimit -v``, as a container's cgroup limit would be
read too) refuses at start a KV pool and swap space that do not fit, with a message saying
what to lower, instead of being killed or failing half-way; one that fits runs."""
from __future__ import annotations

import resource
import subprocess
import sys

from tests.fixtures.tiny_models import tiny_llama_dir, tiny_tokenizer_dir  # noqa: F401

LIMIT = 6 * 2**30


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def generate(model_dir, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "llmtower.cli.main", "generate", "hello", "--model",
           str(model_dir), "--num-threads", "1", "--max-tokens", "3", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=_limited)


def test_kv_pool_and_swap_over_the_memory_limit_are_refused_at_start(tiny_llama_dir):
    done = generate(tiny_llama_dir, "--kv-cache-memory", "8GiB")
    assert done.returncode == 2, done.stderr[-2000:]
    # The memory plan (executor/memory_plan.py) refuses before anything is loaded, with the
    # numbers and what to lower.
    assert "does not fit in memory" in done.stderr and "KV cache 8.00 GiB" in done.stderr
    assert "a smaller --kv-cache-memory" in done.stderr
    done = generate(tiny_llama_dir, "--kv-cache-memory", "64MiB", "--preemption-mode", "swap",
                    "--swap-space", "7GiB")
    assert done.returncode == 2 and "--swap-space" in done.stderr


def test_an_engine_that_fits_the_limit_runs(tiny_llama_dir):
    done = generate(tiny_llama_dir, "--kv-cache-memory", "64MiB")
    assert done.returncode == 0, done.stderr[-2000:]
