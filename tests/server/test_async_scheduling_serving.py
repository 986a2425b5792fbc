"""`llmtower serve --async-scheduling`: the same completions as the serial session server,
streamed or not, with stop strings and client disconnects; structured outputs refused with a
400 that names the flag."""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_args import MODEL, TINY_SERVER_ARGS, launch_server


def test_async_scheduling_serves_the_serial_servers_tokens(tmp_path_factory, tiny_llama_dir,
                                                           client):
    # Started first: it comes up while the serial server computes the expected outputs.
    server = launch_server(tmp_path_factory, "async_server",
                           ["--model", str(tiny_llama_dir), *TINY_SERVER_ARGS,
                            "--async-scheduling"])
    try:
        prompts = [f"request {i} of an async scheduling test" for i in range(10)]
        body = dict(model=MODEL, max_tokens=14, temperature=0.0, extra_body={"ignore_eos": True})
        expected = [client.completions.create(prompt=p, **body).choices[0].text for p in prompts]
        stop = expected[0][6:8]
        expected_stop = client.completions.create(prompt=prompts[0], stop=[stop], **body)
        server.wait_ready()
        aclient = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                max_retries=0, timeout=60)
        with ThreadPoolExecutor(10) as pool:
            got = list(pool.map(
                lambda p: aclient.completions.create(prompt=p, **body).choices[0].text, prompts))
        assert got == expected
        # Streamed, and cut by a stop string in the server (the engine hears an abort).
        chunks = aclient.completions.create(prompt=prompts[0], stop=[stop], stream=True, **body)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == expected_stop.choices[0].text == expected[0][:expected[0].index(stop)]
        # A client that goes away mid-stream: its request is aborted with a step in flight.
        with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=30, json=dict(
                model=MODEL, prompt=prompts[1], max_tokens=200, stream=True, ignore_eos=True,
                temperature=0.0)) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    break
        # Structured outputs cannot run one step late: refused, naming the flag to drop.
        with pytest.raises(openai.BadRequestError, match="--async-scheduling"):
            aclient.completions.create(prompt="x", model=MODEL, max_tokens=4,
                                       extra_body={"guided_regex": "[ab]+"})
        # Every KV block is free again once the aborted request has left the engine.
        deadline = time.monotonic() + 20
        while True:
            metrics = httpx.get(f"{server.base_url}/metrics").text
            usage = re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)", metrics, re.M)
            running = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)", metrics, re.M)
            if usage and running and float(usage.group(1)) == 0 and float(running.group(1)) == 0:
                break
            assert time.monotonic() < deadline, metrics
            time.sleep(0.2)
        assert aclient.completions.create(prompt=prompts[2], **body).choices[0].text == expected[2]
    finally:
        server.stop()
