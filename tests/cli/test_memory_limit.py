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


def _cmd(model_dir, flags: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-m", "llmtower.cli.main", "generate", "hello", "--model",
            str(model_dir), "--num-threads", "1", "--max-tokens", "3", *flags]


def generate(model_dir, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(model_dir, flags), capture_output=True, text=True, timeout=300,
                          preexec_fn=_limited)


def generate_side_by_side(model_dir, *flag_sets: tuple[str, ...]) -> list[tuple[int, str]]:
    """(exit code, stderr) of one limited `llmtower generate` per flag set, all run at once
    (each mostly imports, on one core)."""
    procs = [subprocess.Popen(_cmd(model_dir, flags), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, preexec_fn=_limited)
             for flags in flag_sets]
    try:
        results = []
        for p in procs:
            _, err = p.communicate(timeout=300)
            results.append((p.returncode, err))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_kv_pool_and_swap_over_the_memory_limit_are_refused_at_start(tiny_llama_dir):
    (rc, err), (swap_rc, swap_err) = generate_side_by_side(
        tiny_llama_dir, ("--kv-cache-memory", "8GiB"),
        ("--kv-cache-memory", "64MiB", "--preemption-mode", "swap", "--swap-space", "7GiB"))
    assert rc == 2, err[-2000:]
    # The memory plan (executor/memory_plan.py) refuses before anything is loaded, with the
    # numbers and what to lower.
    assert "does not fit in memory" in err and "KV cache 8.00 GiB" in err
    assert "a smaller --kv-cache-memory" in err
    assert swap_rc == 2 and "--swap-space" in swap_err, swap_err[-2000:]


def test_an_engine_that_fits_the_limit_runs(tiny_llama_dir):
    done = generate(tiny_llama_dir, "--kv-cache-memory", "64MiB")
    assert done.returncode == 0, done.stderr[-2000:]
