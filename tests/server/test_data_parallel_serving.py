"""`llmtower serve --data-parallel-size 2`: two engine processes behind one server."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx

from server_args import MODEL, TINY_SERVER_ARGS, start_server


def test_two_engines_serve_like_one(tmp_path_factory, tiny_llama_dir, client):
    prompts = [f"request {i} of a data parallel test" for i in range(8)]
    body = dict(model=MODEL, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
    # the single-engine session server gives the reference outputs
    expected = [client.completions.create(prompt=p, **body).choices[0].text for p in prompts]

    server = start_server(tmp_path_factory, "dp_server",
                          ["--model", str(tiny_llama_dir), *TINY_SERVER_ARGS,
                           "--data-parallel-size", "2"])
    try:
        import openai
        dp = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                           timeout=60)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: dp.completions.create(prompt=p, **body).choices[0].text,
                                prompts))
        assert got == expected
        pids = re.findall(r"engine core process started \(pid (\d+)\)", server.log())
        assert len(set(pids)) == 2
        metrics = httpx.get(f"{server.base_url}/metrics").text
        # One series per engine (label engine="0" / "1"): both served, together all 8.
        per_engine = re.findall(r'vllm:request_success_total\{engine="(\d)",'
                                r'finished_reason="length"[^}]*\} (\S+)', metrics)
        assert sorted(e for e, _ in per_engine) == ["0", "1"]
        assert sum(float(v) for _, v in per_engine) == 8
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    finally:
        server.stop()
