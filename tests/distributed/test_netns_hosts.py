"""Two hosts for real: the head (`llmtower serve`, rank 0) in the root namespace and a headless
host (`llmtower serve --headless`, rank 1) in a network namespace of its own, joined by a veth
pair, serving a tiny model. Outputs, the sync across hosts, kill -9 of the whole host, its
return. Traffic stays on the namespace's link and loopback."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.distributed.dp_hosts import free_port_range
from tests.distributed.netns import make_host, unavailable_reason
from tests.server.server_process import ServerProcess

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

ENGINE_FLAGS = ["--kv-cache-memory", "16MiB", "--num-threads", "1", "--max-model-len", "256",
                "--dp-timeout", "4", "--dp-sync-interval", "8"]


def _headless(host, model_dir, port, log_path) -> subprocess.Popen:
    cmd = host.cmd([sys.executable, "-m", "llmtower.cli.main", "serve", "--headless",
                    "--model", str(model_dir), "--data-parallel-size", "2",
                    "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
                    "--data-parallel-address", host.head_ip,
                    "--data-parallel-rpc-port", str(port), *ENGINE_FLAGS])
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _complete(base_url: str, i: int) -> str:
    r = httpx.post(f"{base_url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "The tower sees the", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "user": f"u{i}"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _wait(cond, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def test_two_hosts_serve_lose_a_host_and_take_it_back(tiny_llama_dir, tmp_path):
    host = make_host(1)
    procs: list[subprocess.Popen] = []
    head = None
    try:
        port = free_port_range(8, host.head_ip)
        procs.append(_headless(host, tiny_llama_dir, port, tmp_path / "host1.log"))
        head = ServerProcess(["--model", str(tiny_llama_dir), "--served-model-name", "tiny",
                              "--data-parallel-size", "2", "--data-parallel-size-local", "1",
                              "--data-parallel-address", host.head_ip,
                              "--data-parallel-rpc-port", str(port), *ENGINE_FLAGS],
                             tmp_path / "head.log").start()
        url = head.base_url
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda i: _complete(url, i), range(8)))
        assert len(set(texts)) == 1  # greedy: the same text whichever host served it
        _wait(lambda: not any(e["in_wave"] for e in httpx.get(
            f"{url}/v1/admin/data_parallel", timeout=10).json()["engines"]), 20, "the wave's end")
        view = httpx.get(f"{url}/v1/admin/data_parallel", timeout=10).json()
        assert view["status"] == "ok" and view["live_ranks"] == [0, 1]
        engines = view["engines"]
        assert [e["members"] for e in engines] == [[0, 1], [0, 1]]
        assert engines[0]["num_syncs"] == engines[1]["num_syncs"] > 0
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'engine="1"' in metrics

        # kill -9 of everything on the host: the head notices, serves on rank 0, degraded.
        for pid in host.pids():
            os.kill(pid, signal.SIGKILL)
        _wait(lambda: httpx.get(f"{url}/health", timeout=5).json().get("status") == "degraded",
              30, "/health degraded")
        health = httpx.get(f"{url}/health", timeout=5).json()
        assert health["lost_ranks"].keys() == {"1"} and health["live_ranks"] == [0]
        assert _complete(url, 100) == texts[0]

        # The host restarts and rejoins.
        procs.append(_headless(host, tiny_llama_dir, port, tmp_path / "host1.log"))
        _wait(lambda: httpx.get(f"{url}/health", timeout=5).json().get("status") == "ok",
              120, "/health ok again")
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            again = list(pool.map(lambda i: _complete(url, i), range(4)))
        assert set(again) == {texts[0]}
        _wait(lambda: httpx.get(f"{url}/v1/admin/data_parallel", timeout=10).json()["epoch"] >= 2,
              30, "the epoch with rank 1 back")
        view = httpx.get(f"{url}/v1/admin/data_parallel", timeout=10).json()
        assert [e["members"] for e in view["engines"]] == [[0, 1], [0, 1]]
    finally:
        if head is not None:
            head.stop()
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
        for pid in host.pids():
            os.kill(pid, signal.SIGKILL)
        host.delete()
