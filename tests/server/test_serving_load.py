"""Load and disconnects: 200 concurrent streams, 50 of which hang up midway. Every other
stream must get exactly what its prompt gets alone (greedy), and afterwards the engine must
hold no KV block."""
from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai

from server_args import MODEL

NUM_REQUESTS = 200
NUM_PROMPTS = 20
WORDS = ["fox", "cache", "block", "token", "Paris", "scheduler", "dog", "sun", "model", "world"]


def _prompt(i: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(3 + i % 9))


def _max_tokens(i: int) -> int:
    return 16 + (i * 5) % 24


def _metric(text: str, name: str) -> float:
    m = re.search(rf'^{re.escape(name)}{{engine="0",model_name="{MODEL}"}} (\S+)$', text,
                  re.MULTILINE)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_concurrent_streams_with_disconnects(client, tiny_server):
    expected = {}
    for i in range(NUM_PROMPTS):  # each prompt alone, greedy
        r = client.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=_max_tokens(i),
                                      temperature=0.0, extra_body={"ignore_eos": True})
        expected[i] = r.choices[0].text

    async def one(aclient: openai.AsyncOpenAI, j: int):
        i = j % NUM_PROMPTS
        hang_up = j % 4 == 1  # 50 of the 200
        # Those that hang up ask for long outputs, so they are still running when they do.
        stream = await aclient.completions.create(
            model=MODEL, prompt=_prompt(i), max_tokens=400 if hang_up else _max_tokens(i),
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
            if hang_up and len(parts) == 3:
                await stream.close()  # the client goes away midway
                return j, None, None
        return j, "".join(parts), finish

    async def run_all():
        aclient = openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                                     max_retries=0, timeout=120)
        async with aclient:
            return await asyncio.gather(*(one(aclient, j) for j in range(NUM_REQUESTS)))

    results = asyncio.run(run_all())
    completed = [(j, text, finish) for j, text, finish in results if text is not None]
    assert len(completed) == NUM_REQUESTS - NUM_REQUESTS // 4
    for j, text, finish in completed:
        assert finish == "length"
        assert text == expected[j % NUM_PROMPTS], f"request {j} differs from its prompt alone"

    # Aborted streams free their blocks: once the engine is idle its last snapshot shows an
    # empty cache (polled, because snapshots are sent a moment after the last step).
    deadline = time.monotonic() + 30
    while True:
        text = httpx.get(f"{tiny_server.base_url}/metrics").text
        usage = _metric(text, "vllm:kv_cache_usage_perc")
        running = _metric(text, "vllm:num_requests_running")
        if (usage, running) == (0.0, 0.0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert usage == 0.0 and running == 0.0
    assert _metric(text, "vllm:num_requests_waiting") == 0.0
    assert httpx.get(f"{tiny_server.base_url}/ready").status_code == 200


def _num_aborted(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    m = re.search(r'vllm:request_success_total\{engine="0",finished_reason="abort",'
                  rf'model_name="{MODEL}"}} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def _wait_for_aborts(server, count: float) -> float:
    deadline = time.monotonic() + 30
    while _num_aborted(server) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return _num_aborted(server)


def test_a_stream_that_hangs_up_is_aborted(tiny_server):
    before = _num_aborted(tiny_server)
    body = {"model": MODEL, "prompt": "hang up", "max_tokens": 480, "n": 4, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{tiny_server.base_url}/v1/completions", json=body,
                      timeout=60) as r:
        next(r.iter_lines())  # the first token is there; leave without reading the rest
    assert _wait_for_aborts(tiny_server, before + 1) > before


def test_a_plain_request_whose_client_gives_up_is_aborted(tiny_server):
    before = _num_aborted(tiny_server)
    # 4 prompts x 16 samples (--max-n) of 480 tokens: 480 steps of a batch of 64, about a
    # second on the tiny model. The client hangs up once /metrics shows it running (a fixed
    # client timeout raced the request: alone, 16 samples finish in ~0.3 s).
    body = {"model": MODEL, "prompt": ["give up", "give in", "let go", "walk away"],
            "max_tokens": 480, "n": 16, "ignore_eos": True}

    async def give_up() -> None:
        async with httpx.AsyncClient(timeout=60) as aclient:
            post = asyncio.create_task(
                aclient.post(f"{tiny_server.base_url}/v1/completions", json=body))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not post.done():
                text = (await aclient.get(f"{tiny_server.base_url}/metrics")).text
                if _metric(text, "vllm:num_requests_running") > 0:
                    break
                await asyncio.sleep(0.01)
            assert not post.done(), "the request ended before the client could give up"
            post.cancel()  # closes the connection: the server sees the client go away
            try:
                await post
            except asyncio.CancelledError:
                pass

    asyncio.run(give_up())
    assert _wait_for_aborts(tiny_server, before + 1) > before
