"""Killing the engine process: waiting clients get 503 at once instead of hanging, /health
turns 503, and the server log names the cause."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx

from server_args import MODEL, TINY_SERVER_ARGS, start_server

# The bound on noticing a dead engine; detection itself is event-driven (the process
# sentinel), so this is a generous margin, not a race.
DEATH_NOTICE_S = 2.0


def test_killed_engine_fails_waiting_requests_with_503(tmp_path_factory, tiny_llama_dir):
    server = start_server(tmp_path_factory, "doomed_server",
                          ["--model", str(tiny_llama_dir), *TINY_SERVER_ARGS])
    try:
        url = f"{server.base_url}/v1/completions"
        body = {"model": MODEL, "prompt": "wait for me", "max_tokens": 480, "ignore_eos": True}

        async def scenario():
            async with httpx.AsyncClient(timeout=60) as client:
                waiting = [asyncio.create_task(client.post(url, json={**body, "n": 4}))
                           for _ in range(4)]
                async with client.stream("POST", url, json={**body, "stream": True}) as stream:
                    lines = stream.aiter_lines()
                    assert (await anext(lines)).startswith("data: ")  # the engine is busy
                    os.kill(server.engine_pid(), signal.SIGKILL)
                    killed_at = time.monotonic()
                    rest = [line async for line in lines if line]
                    responses = await asyncio.gather(*waiting)
                    return time.monotonic() - killed_at, responses, rest

        elapsed, responses, rest = asyncio.run(scenario())
        assert elapsed < DEATH_NOTICE_S
        for r in responses:
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "engine_dead"
        # The stream had already started with 200: it ends with an error event, then [DONE].
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == "engine_dead"
        health = httpx.get(f"{server.base_url}/health")
        assert health.status_code == 503 and "SIGKILL" in health.json()["error"]["message"]
        assert httpx.get(f"{server.base_url}/ready").status_code == 503
        late = httpx.post(url, json={"model": MODEL, "prompt": "anyone?", "max_tokens": 2})
        assert late.status_code == 503
        assert "killed by signal SIGKILL" in server.log()
    finally:
        server.stop()
