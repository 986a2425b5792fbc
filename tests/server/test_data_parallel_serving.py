"""`llmtower serve --data-parallel-size 2`: two engine processes behind one server, and
`llmtower ctl drain` of one of them under load."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx

from llmtower.cli.main import main as cli_main
from server_args import MODEL, TINY_SERVER_ARGS, launch_server


def test_two_engines_serve_like_one_and_one_drains_under_load(tmp_path_factory, tiny_llama_dir,
                                                              client, tiny_server, capsys):
    # Started first: it comes up while the single-engine session server gives the
    # reference outputs.
    server = launch_server(tmp_path_factory, "dp_server",
                           ["--model", str(tiny_llama_dir), *TINY_SERVER_ARGS,
                            "--data-parallel-size", "2"])
    try:
        prompts = [f"request {i} of a data parallel test" for i in range(8)]
        body = dict(model=MODEL, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
        expected = [client.completions.create(prompt=p, **body).choices[0].text for p in prompts]
        server.wait_ready()
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
        _drain_under_load(server.base_url, prompts, expected, body, capsys)
        # A server of one engine has nothing to drain.
        r = httpx.post(f"{tiny_server.base_url}/v1/admin/drain", params={"engine_id": "0"})
        assert r.status_code == 404 and "--data-parallel-size" in r.json()["error"]["message"]
    finally:
        server.stop()


def _drain_under_load(url: str, prompts, expected, body, capsys) -> None:
    """`llmtower ctl drain --engine-id 0 --wait` while 32 requests run: none fails, the
    engine ends drained, the other one refuses to drain too, undrain routes to it again."""
    import openai
    dp = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    load = [prompts[i % len(prompts)] for i in range(32)]
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(lambda p: dp.completions.create(prompt=p, **body).choices[0].text,
                               p) for p in load]
        rc = cli_main(["ctl", "drain", "--engine-id", "0", "--wait", "--url", url,
                       "--timeout", "120"])
        out = capsys.readouterr().out
        got = [f.result() for f in futures]  # raises if any request failed
    assert rc == 0 and "engine 0: drained" in out, out
    assert got == [expected[i % len(prompts)] for i in range(32)]
    view = httpx.get(f"{url}/v1/admin/data_parallel", timeout=10).json()
    assert view["draining"]["0"]["drained"] and view["draining_ranks"] == [0]
    r = httpx.post(f"{url}/v1/admin/drain", params={"engine_id": "1"})
    assert r.status_code == 409 and "no other engine would serve" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/admin/drain", params={"engine_id": "7"})
    assert r.status_code == 400 and "0..1" in r.json()["error"]["message"]
    assert cli_main(["ctl", "undrain", "--engine-id", "0", "--url", url]) == 0
    assert "engine 0: serving" in capsys.readouterr().out
    assert httpx.get(f"{url}/v1/admin/data_parallel", timeout=10).json()["draining"] == {}
