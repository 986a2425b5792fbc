"""The operator tools against a live server under load: `llmtower serve --data-parallel-size 2
--api-key ...` with the tiny model, streams running in the background while `GET
/v1/admin/kv_cache`, `llmtower diag memory`, `llmtower monitor` (JSON, and drawn in a
pseudo-terminal) and the Grafana dashboard's queries are checked."""
from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmtower.cli.main import main
from tests.fixtures.tiny_models import tiny_llama_dir, tiny_tokenizer_dir  # noqa: F401
from tests.server.server_process import ServerProcess

KEY = "operator-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_BLOCKS = 256
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "llmtower-dashboard.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    log = tmp_path_factory.mktemp("operator_server") / "server.log"
    proc = ServerProcess(["--model", str(tiny_llama_dir), "--served-model-name", "tiny",
                          "--num-threads", "1", "--max-model-len", "512",
                          "--num-gpu-blocks", str(NUM_BLOCKS), "--max-num-seqs", "32",
                          "--data-parallel-size", "2", "--api-key", KEY], log).start()
    yield proc
    proc.stop()


class Load:
    """Streams completions from several threads until stopped, so that every engine holds
    running requests and KV blocks while the tools look."""

    def __init__(self, base_url: str, threads: int = 8) -> None:
        self.base_url = base_url
        self.stop_event = threading.Event()
        self.done = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(threads)]

    def _run(self, i: int) -> None:
        body = {"model": "tiny", "prompt": f"load {i} " * 20, "max_tokens": 200,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.base_url, headers=AUTH, timeout=60) as c:
            while not self.stop_event.is_set():
                with c.stream("POST", "/v1/completions", json=body) as r:
                    for _ in r.iter_lines():
                        if self.stop_event.is_set():
                            break
                self.done += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(30)


def _wait_running(base_url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(f"{base_url}/metrics").text
        if re.search(r'^vllm:num_requests_running\{[^}]*\} [1-9]', text, re.MULTILINE):
            return
        time.sleep(0.2)
    raise AssertionError("the load never showed as running requests")


def test_admin_kv_cache_is_per_engine_and_behind_the_key(server):
    url = f"{server.base_url}/v1/admin/kv_cache"
    r = httpx.get(url)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with Load(server.base_url, threads=4):
        _wait_running(server.base_url)
        deadline = time.monotonic() + 30
        while True:  # a snapshot falls between two requests of every client only rarely
            both = httpx.get(url, headers=AUTH).json()["engines"]
            if sum(len(e["requests"]) for e in both) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        one = httpx.get(url, params={"engine_id": "1"}, headers=AUTH).json()["engines"]
    assert [e["engine_index"] for e in both] == [0, 1]
    assert all(len(e["block_states"]) == e["num_blocks"] == NUM_BLOCKS for e in both)
    assert sum(len(e["requests"]) for e in both) > 0  # the load holds blocks somewhere
    assert [e["engine_index"] for e in one] == [1]
    for bad in ("2", "x", "-1"):
        r = httpx.get(url, params={"engine_id": bad}, headers=AUTH)
        assert r.status_code == 400, bad
        err = r.json()["error"]
        assert err["param"] == "engine_id" and "0..1" in err["message"]


def test_diag_memory_reports_and_draws_every_engine_under_load(server, tmp_path, capsys):
    png = tmp_path / "kv.png"
    with Load(server.base_url, threads=4):
        _wait_running(server.base_url)
        rc = main(["diag", "memory", "--url", server.base_url, "--api-key", KEY,
                   "--engine-id", "all", "--visualize", "--output", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "engine 0" in out and "engine 1" in out
    assert out.count("largest free run") == 2
    assert re.search(r"requests: \d+ holding blocks", out)
    for i in (0, 1):
        assert (tmp_path / f"kv.engine{i}.png").is_file()
    assert main(["diag", "memory", "--url", server.base_url, "--engine-id", "0"]) == 1
    assert "401" in capsys.readouterr().err  # no key: refused, said plainly


def _monitor_json(capsys, base_url: str, *extra: str, count: int = 4) -> list[dict]:
    """`llmtower monitor --json` run in this process (the pseudo-terminal test below runs the
    command as its own process): its lines of JSON."""
    capsys.readouterr()
    rc = main(["monitor", "--url", base_url, "--json", "--interval", "400ms",
               "--count", str(count), *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_monitor_json_sees_both_engines_and_the_load(server, capsys):
    with Load(server.base_url, threads=4):
        _wait_running(server.base_url)
        # The tiny model makes a request's 200 tokens in a burst far shorter than the client
        # takes to read them, so a busy machine can leave the engines idle at all of one run's
        # polls: the monitor runs again until one of its polls catches a request running.
        deadline = time.monotonic() + 60
        while True:
            lines = _monitor_json(capsys, server.base_url)
            if (max(line["total"]["scheduler.running"] for line in lines) > 0
                    or time.monotonic() > deadline):
                break
    assert all(line["up"] for line in lines)
    assert set(lines[-1]["engines"]) == {"0", "1"}
    assert max(line["total"]["scheduler.running"] for line in lines) > 0
    total = [line["total"] for line in lines[1:]]  # the first poll has no rates yet
    assert max(t["throughput.generation_tokens.per_s"] or 0 for t in total) > 0
    assert any(t["scheduler.step_delay.p99"] is not None for t in total)
    assert all(0 <= t["kv_cache.usage"] <= 1 for t in total)
    running = [sum(line["engines"][e]["scheduler.running"] for e in ("0", "1"))
               for line in lines]
    assert running == [line["total"]["scheduler.running"] for line in lines]


def test_monitor_metric_selects_by_the_seeds_dotted_names(server, capsys):
    lines = _monitor_json(capsys, server.base_url, "--metric", "scheduler.queue_depth", "--metric",
                          "input_queue.size", "--metric", "scheduler.preempt_count", count=2)
    assert set(lines[-1]["total"]) == {"scheduler.queue_depth", "input_queue.size",
                                       "scheduler.preempt_count",
                                       "scheduler.preempt_count.per_s"}


def _read_pty(fd: int, proc: subprocess.Popen, timeout_s: float) -> str:
    chunks = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    return b"".join(chunks).decode(errors="replace")


def test_monitor_draws_a_live_view_in_a_terminal_under_load(server):
    master, slave = pty.openpty()
    env = {**os.environ, "COLUMNS": "200", "LINES": "60", "TERM": "xterm-256color"}
    with Load(server.base_url, threads=4):
        _wait_running(server.base_url)
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmtower.cli.main", "monitor", "--url", server.base_url,
             "--interval", "400ms", "--count", "4"],
            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        screen = _read_pty(master, proc, 90)
        proc.wait(30)
    os.close(master)
    assert proc.returncode == 0, screen[-2000:]
    assert "\x1b[" in screen  # drawn by rich with terminal control codes, colours included
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    assert "up, 2 engine(s)" in plain
    for heading in ("requests", "KV cache", "steps (ms)", "throughput and latency",
                    "delay p99", "prefix hit", "gen tok/s"):
        assert heading in plain, heading
    assert re.search(r"^\s*total\s+\d+", plain, re.MULTILINE)  # a row of numbers in total
    assert any(ch in plain for ch in "▁▂▃▄▅▆▇█")  # the queue-depth sparkline


def _dashboard_series() -> set[str]:
    """Every metric name the dashboard's PromQL expressions read."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    names = set()
    for panel in panels:
        for target in panel.get("targets", []):
            names |= set(re.findall(r"\b((?:vllm|llmtower|process|http|python)[:_][\w:]+)",
                                    target["expr"]))
    return names


def test_every_series_the_grafana_dashboard_queries_exists_on_a_live_server(server):
    with Load(server.base_url, threads=2):
        _wait_running(server.base_url)
    text = httpx.get(f"{server.base_url}/metrics").text
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    queried = _dashboard_series()
    assert len(queried) >= 20
    missing = sorted(queried - exposed)
    assert not missing, f"the dashboard queries series /metrics does not have: {missing}"
    # The HTTP family labels requests by route template, as the instrumentator does.
    assert re.search(r'http_requests_total\{handler="/v1/completions",method="POST",'
                     r'status="2xx"\} [1-9]', text)
