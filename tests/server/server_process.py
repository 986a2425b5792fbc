"""`llmtower serve` as a subprocess for tests: started on a free port of 127.0.0.1, waited for
until /health answers, and always stopped — with its engine process — even when a test fails."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 300  # the default model's first start converts its GGUF file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Owns one `llmtower serve` process group (API server + engine) and its log file."""

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "llmtower.cli.main", "serve", "--port", str(self.port),
               *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            # Its own session: stop() can then signal the API server and engine together.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server did not start in {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def engine_pid(self) -> int:
        m = re.search(r"engine core process started \(pid (\d+)\)", self.log_path.read_text())
        assert m, f"no engine pid in the server log:\n{self.log()}"
        return int(m.group(1))

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            self._kill_group()
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group()

    def _kill_group(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left: the engine, the tracker
        except ProcessLookupError:
            pass
        self.proc.wait(5)
