"""The scheduling admin routes and per-tenant fairness on a live server (issue 17): the tiny
model under `llmtower serve --policy priority` and `--policy fair`, behind --api-key."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from server_args import MODEL, TINY_SERVER_ARGS, start_servers

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def policy_servers(tmp_path_factory, tiny_llama_dir):
    """The priority and the fair server, started side by side."""
    # Two running slots on the fair one: the tenants compete for them.
    fair_args = [a for a in TINY_SERVER_ARGS]
    fair_args[fair_args.index("--max-num-seqs") + 1] = "2"
    servers = start_servers(tmp_path_factory, {
        "priority_server": ["--model", str(tiny_llama_dir), *TINY_SERVER_ARGS, "--api-key", KEY,
                            "--policy", "priority"],
        "fair_server": ["--model", str(tiny_llama_dir), *fair_args, "--api-key", KEY,
                        "--policy", "fair", "--tenant-weights", "light=1,heavy=1"]})
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="module")
def priority_server(policy_servers):
    return policy_servers["priority_server"]


@pytest.fixture(scope="module")
def fair_server(policy_servers):
    return policy_servers["fair_server"]


def test_priority_route_changes_a_request_in_flight(priority_server):
    url = priority_server.base_url
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 480, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            rid = httpx.Response(200, content=first[6:]).json()["id"]
            ok = c.post(f"/v1/admin/requests/{rid}/priority", json={"priority": -3})
            assert ok.status_code == 200, ok.text
            assert ok.json() == {"id": rid, "priority": -3, "num_sequences": 1}
            bad = c.post(f"/v1/admin/requests/{rid}/priority", json={"priority": "high"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
            for _ in lines:  # drain: the request finishes normally
                pass
        gone = c.post(f"/v1/admin/requests/{rid}/priority", json={"priority": 0})
        assert gone.status_code == 404 and "is in flight" in gone.json()["error"]["message"]
        assert c.post("/v1/admin/requests/nope/priority", json={"priority": 1}).status_code == 404
        assert c.post("/v1/admin/reset_prefix_cache").json() == {"reset": True}
    # Behind --api-key like every admin route.
    r = httpx.post(f"{url}/v1/admin/requests/x/priority", json={"priority": 1}, timeout=10)
    assert r.status_code == 401


def test_fair_server_accounts_tenants_from_header_and_user(fair_server):
    url = fair_server.base_url

    def ask(i: int, heavy: bool) -> dict:
        body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 12, "ignore_eos": True,
                "temperature": 0}
        headers = dict(AUTH)
        if heavy:
            headers["X-Tenant"] = "heavy"  # the header wins over the user field
            body["user"] = "light"
        else:
            body["user"] = "light"
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    with cf.ThreadPoolExecutor(12) as pool:
        heavy = [pool.submit(ask, i, True) for i in range(10)]
        light = [pool.submit(ask, 100 + i, False) for i in range(2)]
        used = {"heavy": [f.result() for f in heavy], "light": [f.result() for f in light]}
    stats = httpx.get(f"{url}/v1/admin/tenants", headers=AUTH, timeout=10).json()["tenants"]
    assert set(stats) == {"heavy", "light"}
    for t, usages in used.items():
        assert stats[t]["num_admitted"] == len(usages) and stats[t]["num_unfinished"] == 0
        # Every prompt and output token was charged to its tenant (no prefix-cache hits here).
        assert stats[t]["tokens_served"] >= sum(u["prompt_tokens"] + u["completion_tokens"] - 1
                                                for u in usages)
    # And in the Prometheus metrics, once the next stats snapshot (every 0.5 s) has arrived.
    import time
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
        if 'llmtower:tenant_requests_admitted_total{' in text and 'tenant="light"' in text:
            break
        time.sleep(0.3)
    lines = [x for x in text.splitlines()
             if x.startswith("llmtower:tenant_requests_admitted_total") and 'tenant="heavy"' in x]
    assert lines and float(lines[0].split()[-1]) == 10
