"""The memory tools against a live server under load: `llmtower serve --data-parallel-size 2
--api-key ... --kv-allocator relocator --preload-prompts FILE --preload-pin`, with streams
running while `llmtower ctl defrag`, `llmtower preload` and `llmtower ctl unpin` act on it.
No request fails, and the KV cache returns to its idle level when the load stops."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from llmtower.cli.main import main
from tests.fixtures.tiny_models import tiny_llama_dir, tiny_tokenizer_dir  # noqa: F401
from tests.server.server_process import ServerProcess

KEY = "memory-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You are the billing assistant of a company that sells " + "very " * 60 + "many things."


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("preload") / "prompts.txt"
    f.write_text(f'{SYSTEM}\n{{"prompt": broken\n'
                 '{"messages": [{"role": "system", "content": "' + SYSTEM + ' Be brief."}]}\n')
    return f


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir, prompts_file):
    log = tmp_path_factory.mktemp("memory_server") / "server.log"
    proc = ServerProcess(["--model", str(tiny_llama_dir), "--served-model-name", "tiny",
                          "--num-threads", "1", "--max-model-len", "512", "--block-size", "8",
                          "--num-gpu-blocks", "160", "--max-num-seqs", "16",
                          "--data-parallel-size", "2", "--api-key", KEY,
                          "--kv-allocator", "relocator", "--fragmentation-threshold", "0.2",
                          "--preload-prompts", str(prompts_file), "--preload-pin"], log).start()
    proc.log_path = log
    yield proc
    proc.stop()


class Load:
    """Streams completions from several threads until stopped, counting failures."""

    def __init__(self, base_url: str, threads: int = 6) -> None:
        self.base_url = base_url
        self.stop_event = threading.Event()
        self.done = 0
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(threads)]

    def _run(self, i: int) -> None:
        n = 0
        with httpx.Client(base_url=self.base_url, headers=AUTH, timeout=120) as c:
            while not self.stop_event.is_set():
                n += 1
                body = {"model": "tiny", "prompt": SYSTEM + f" question {i} {n}" * (1 + n % 4),
                        "max_tokens": 20 + 7 * (n % 5), "temperature": 0.0, "ignore_eos": True}
                r = c.post("/v1/completions", json=body)
                if r.status_code != 200:
                    self.failed.append(f"{r.status_code}: {r.text[:200]}")
                self.done += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(120)


def _snapshots(base_url: str) -> list[dict]:
    return httpx.get(f"{base_url}/v1/admin/kv_cache", headers=AUTH, timeout=60).json()["engines"]


def _wait_idle(base_url: str, timeout_s: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snaps = _snapshots(base_url)
        if not any(s["requests"] for s in snaps):
            return snaps
        time.sleep(0.2)
    raise AssertionError("requests still hold KV blocks after the load stopped")


def test_preload_at_start_pins_and_names_the_bad_line(server, prompts_file):
    log = server.log_path.read_text()
    assert f"{prompts_file}:2: not valid JSON" in log
    assert "preloaded 2 prompt(s)" in log and "engine 1" in log
    # Pinned blocks are held by no request: in use while idle, on both engines.
    for s in _wait_idle(server.base_url):
        assert s["num_used"] + s["num_shared"] > 0 and not s["requests"]


def test_defrag_preload_and_unpin_under_load_lose_nothing(server, tmp_path, capsys):
    idle = [s["num_free"] + s["num_cached_free"] for s in _wait_idle(server.base_url)]
    extra = tmp_path / "more.txt"
    extra.write_text("Another long system prompt " * 20 + "\n\n{\"messages\": 3}\n")
    with Load(server.base_url) as load:
        while load.done < 4:
            time.sleep(0.1)
        assert main(["ctl", "defrag", "--url", server.base_url, "--api-key", KEY]) == 0
        out = capsys.readouterr().out
        assert "engine 0:" in out and "engine 1:" in out and "block moves" in out
        assert main(["ctl", "defrag", "--url", server.base_url, "--api-key", KEY,
                     "--engine-id", "1"]) == 0
        assert "engine 0" not in capsys.readouterr().out
        rc = main(["preload", "--prompts-file", str(extra), "--url", server.base_url,
                   "--api-key", KEY])
        cap = capsys.readouterr()
        assert rc == 1  # one line was bad; the other was preloaded
        assert f"{extra}:3:" in cap.err and "'messages' must be" in cap.err
        assert "preloaded 1 of 1 prompt(s)" in cap.out
        time.sleep(1.0)
    assert load.done > 8 and not load.failed, load.failed[:3]
    after = [s["num_free"] + s["num_cached_free"] for s in _wait_idle(server.base_url)]
    assert after == idle  # nothing leaked: the same blocks are free as before the load
    assert main(["ctl", "unpin", "--url", server.base_url, "--api-key", KEY]) == 0
    assert "blocks unpinned" in capsys.readouterr().out
    for s in _wait_idle(server.base_url):
        assert s["num_free"] + s["num_cached_free"] == s["num_blocks"]


def test_memory_routes_are_behind_the_key_and_check_their_input(server, capsys):
    base = server.base_url
    assert httpx.post(f"{base}/v1/admin/defrag", timeout=60).status_code == 401
    assert main(["ctl", "defrag", "--url", base]) == 1
    assert "401" in capsys.readouterr().err
    r = httpx.post(f"{base}/v1/admin/defrag", params={"engine_id": "7"}, headers=AUTH,
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "engine_id"
    r = httpx.post(f"{base}/v1/admin/preload", json={"prompts": []}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/admin/preload", json={"prompt": "x"}, headers=AUTH, timeout=60)
    assert r.status_code == 400 and "invalid preload body" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/admin/preload", headers=AUTH, timeout=60,
                   json={"prompts": [{"prompt": "ok " * 30}, {"prompt": "x" * 5000}]})
    body = r.json()
    assert r.status_code == 200 and [e["index"] for e in body["errors"]] == [1]
    assert [e["num_done"] for e in body["engines"]] == [1, 1]
