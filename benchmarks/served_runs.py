"""What the served benchmarks share: start `llmtower serve` on a free port and wait for it,
run `llmtower bench serve` against a server and read its JSON figures, and the CPU time of a
process. A module of its own so that api_cpu_per_token.py, served_vs_peers.py and
served_stream_interval.py measure the same way."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(src: str | None = None) -> dict[str, str]:
    # $LLMTOWER_SRC: another tree's sources (e.g. a baseline commit's) under the same scripts
    src = src or os.environ.get("LLMTOWER_SRC") or str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": src, "PYTHONUNBUFFERED": "1"}


PROFILED_MAIN = """
import cProfile, runpy, sys, time
out, module = sys.argv[1], sys.argv[2]
sys.argv = [module, *sys.argv[3:]]
prof = cProfile.Profile(time.thread_time)
prof.enable()
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
finally:
    prof.disable()
    prof.dump_stats(out)
"""


class Server:
    """Owns one `llmtower serve` process group (API process + engine) and its log file."""

    def __init__(self, args: list[str], profile: str | None = None,
                 src: str | None = None) -> None:
        self.port = free_port()
        self.log = Path(tempfile.mkstemp(prefix="llmtower-serve-", suffix=".log")[1])
        # under --profile: the API process's main thread (its event loop) under cProfile with
        # a CPU-time clock, so time spent waiting for a core is not counted as work
        launcher = [PYTHON, "-c", PROFILED_MAIN, profile] if profile else [PYTHON, "-m"]
        cmd = [*launcher, "llmtower.cli.main", "serve", "--port", str(self.port),
               "--disable-log-stats", *args]
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env(src),
                                         start_new_session=True)
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("the server did not start in 600 s")

    def api_cpu_seconds(self) -> float:
        """User + system CPU seconds of the API process (its own, not the engine's)."""
        return sum(self.api_cpu_times())

    def api_cpu_times(self) -> tuple[float, float]:
        """(user, system) CPU seconds of the API process (all its threads)."""
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user, t.system

    def engine_cpu_seconds(self) -> float:
        total = 0.0
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                t = child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    def stop(self) -> None:
        # SIGINT to the API process alone: it drains, stops its engine and (under cProfile)
        # writes the profile; the group is killed after it, whatever is left.
        try:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def bench(port: int, model: str, tokenizer: str, rate: str, seed: int, num_prompts: int = 64,
          input_len: int = 128, output_len: int = 64, base_url: str | None = None) -> dict:
    """One `llmtower bench serve` run (random prompts, EOS ignored): its JSON figures."""
    out = Path(tempfile.mkdtemp(prefix="llmtower-bench-"))
    cmd = [PYTHON, "-m", "llmtower.cli.main", "bench", "serve",
           "--base-url", base_url or f"http://127.0.0.1:{port}", "--model", model,
           "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(num_prompts), "--request-rate", rate, "--seed", str(seed),
           "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", str(out),
           "--result-filename", "r.json"]
    subprocess.run(cmd, env=env(), check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "r.json").read_text())


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
