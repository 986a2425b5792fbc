"""`llmtower bench serve` building blocks: prompts, SLO parsing and the figures of a run."""
from __future__ import annotations

import json

import pytest

from llmtower.bench.serve_client import RequestResult
from llmtower.bench.serve_dataset import load_jsonl_requests, sample_random_requests
from llmtower.bench.serve_metrics import compute_metrics, format_report, parse_goodput


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from llmtower.models.tokenizer import load_tokenizer
    from tests.fixtures.tiny_models import write_tiny_tokenizer
    return load_tokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def test_random_prompts_have_the_asked_lengths_and_a_shared_prefix(tokenizer):
    reqs = sample_random_requests(tokenizer, 20, input_len=40, output_len=10, range_ratio=0.5,
                                  prefix_len=8, seed=0)
    assert len(reqs) == 20
    for r in reqs:
        assert 8 + 20 <= r.prompt_len <= 8 + 60 and 5 <= r.output_len <= 15
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) >= r.prompt_len - 2
    prefixes = {tokenizer.encode(r.prompt, add_special_tokens=False)[:4].__repr__() for r in reqs}
    assert len(prefixes) == 1
    again = sample_random_requests(tokenizer, 20, 40, 10, 0.5, 8, seed=0)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_jsonl_prompts_cycle_and_bad_lines_say_where(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hello world", "output_len": 7}) + "\n"
                    + json.dumps({"prompt": "the fox"}) + "\n")
    reqs = load_jsonl_requests(path, 5, 32, tokenizer)
    assert [r.output_len for r in reqs] == [7, 32, 7, 32, 7]
    assert reqs[0].prompt_len == len(tokenizer.encode("hello world", add_special_tokens=False))
    path.write_text('{"text_missing": 1}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1"):
        load_jsonl_requests(path, 1, 32, None)


def test_goodput_slos_parse_and_reject_typos():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["ttft=500"], ["latency:5"], ["tpot:fast"], ["e2el:0"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_figures_of_a_run():
    ok = RequestResult(success=True, prompt_len=10, output_tokens=11, ttft=0.1, latency=1.1,
                       itl=[0.1] * 10)
    slow = RequestResult(success=True, prompt_len=10, output_tokens=11, ttft=0.5, latency=2.5,
                         itl=[0.2] * 10)
    failed = RequestResult(error="HTTP 500: boom")
    m = compute_metrics([ok, slow, failed], duration_s=2.0, tokenizer=None,
                        goodput_slos={"ttft": 200})
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 20 and m.total_output_tokens == 22
    assert m.request_throughput == 1.0 and m.output_throughput == 11.0
    assert m.request_goodput == 0.5  # only `ok` meets ttft <= 200 ms
    assert m.ttft_ms["mean"] == pytest.approx(300.0)
    assert m.tpot_ms["mean"] == pytest.approx(150.0)  # (1.0 / 10 + 2.0 / 10) / 2 s
    assert m.itl_ms["median"] == pytest.approx(150.0)
    assert m.errors == ["HTTP 500: boom"]
    report = format_report(m, max_concurrency=4, request_rate=float("inf"))
    assert "Successful requests:" in report and "Mean TTFT (ms):" in report
    assert "P99 E2EL (ms):" in report and "Request goodput (req/s):" in report
