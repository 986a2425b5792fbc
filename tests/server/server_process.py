"""`llmtower serve` as a subprocess for tests: started on a free port of 127.0.0.1, waited for
until /health answers, and always stopped — with its engine process — even when a test fails,
a start is interrupted (Ctrl-C) or a fixture never reaches its teardown (an exit handler kills
every server still running when pytest exits).

``launch()`` and ``wait_ready()`` apart let a test start several servers at once: each start is
mostly two processes importing one after the other, so two starts side by side take little
longer than one on a machine with a spare core."""
from __future__ import annotations

import atexit
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

    def start(self) -> ServerProcess:
        """launch() and wait_ready(): the server answers /health when this returns."""
        return self.launch().wait_ready()

    def launch(self) -> ServerProcess:
        """Starts the process and returns at once; wait_ready() waits for it to serve."""
        cmd = [sys.executable, "-m", "llmtower.cli.main", "serve", "--port", str(self.port),
               *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            # Its own session: stop() can then signal the API server and engine together.
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        _RUNNING.append(self)
        return self

    def wait_ready(self) -> ServerProcess:
        """Waits until /health answers 200; stops the server and raises if it exits, does not
        come up in START_TIMEOUT_S, or the wait is interrupted."""
        assert self.proc is not None, "launch() first"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    if self._healthy():
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            raise RuntimeError(f"the server did not start in {START_TIMEOUT_S} s:\n{self.log()}")
        except BaseException:
            self.stop()
            raise

    def _healthy(self) -> bool:
        return httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200

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
        if self in _RUNNING:
            _RUNNING.remove(self)


def launch_all(servers: list[ServerProcess]) -> list[ServerProcess]:
    """Starts every server side by side and waits for all; if one fails, all are stopped."""
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


# Every server launched and not yet stopped, killed at interpreter exit: a fixture whose
# setup was interrupted never reaches its teardown, and its server must not outlive pytest.
_RUNNING: list[ServerProcess] = []


def _kill_leftovers() -> None:
    for server in list(_RUNNING):
        try:
            server._kill_group()
        except Exception:  # exiting anyway: one stuck server must not spare the others
            pass


atexit.register(_kill_leftovers)
