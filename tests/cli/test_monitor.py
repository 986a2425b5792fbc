"""`llmtower monitor` without a model: the dotted-name table, the Prometheus arithmetic (rates,
interval quantiles), and a /metrics endpoint that goes down and comes back (a stub server
serving a real ServingMetrics registry). The live-server runs are in
test_operator_tools_live.py."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmtower.cli.main import main
from llmtower.cli.monitor import Poller, compute, parse_interval, sparkline
from llmtower.core.outputs import SchedulerStats
from llmtower.metrics.names import SEED_METRICS, resolve
from llmtower.metrics.prometheus import ServingMetrics
from llmtower.metrics.scrape import (
    histogram_quantile,
    interval_quantile,
    parse_metrics,
    rate,
)
from tests.server.server_process import free_port


def test_the_seeds_dotted_names_map_to_exposed_series():
    assert resolve("scheduler.queue_depth").prom == "vllm:num_requests_waiting"
    assert resolve("input_queue.size").prom == "llmtower:input_queue_size"
    assert resolve("scheduler.preempt_count").prom == "vllm:num_preemptions_total"
    # The design's dashboard spelling and a plain Prometheus name work too.
    assert resolve("scheduler/step_delay_ms").dotted == "scheduler.step_delay"
    assert resolve("kv_cache/fragmentation_ratio").labels == {"kind": "internal"}
    assert resolve("vllm:num_requests_running").dotted == "scheduler.running"
    with pytest.raises(ValueError, match="scheduler.queue_depth"):
        resolve("scheduler.nonsense")
    # Every series in the table is one the server exports.
    m = ServingMetrics("m")
    exposed = set(parse_metrics(m.render().decode(), 0).samples)
    for metric in SEED_METRICS:
        wanted = metric.prom + ("_bucket" if metric.kind == "histogram" else "")
        assert wanted in exposed, metric.dotted


def test_health_rules_follow_the_design_thresholds():
    assert not resolve("scheduler.step_delay").healthy(0.08)
    assert resolve("scheduler.step_delay").healthy(0.01)
    assert not resolve("batch.utilization").healthy(0.5)
    assert not resolve("kv_cache.fragmentation_ratio").healthy(0.3)
    assert not resolve("requests.queue_time_p99").healthy(1.5)


def test_histogram_quantile_interpolates_like_prometheus():
    # 10 observations <= 0.1, 10 more <= 0.2: the median is the top of the first bucket.
    cumulative = {0.1: 10.0, 0.2: 20.0, float("inf"): 20.0}
    assert histogram_quantile(0.5, cumulative) == pytest.approx(0.1)
    assert histogram_quantile(0.75, cumulative) == pytest.approx(0.15)
    assert histogram_quantile(0.99, {0.1: 0.0, float("inf"): 5.0}) == 0.1  # +Inf: highest bound
    assert histogram_quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


def _scrape(m: ServingMetrics, t: float):
    return parse_metrics(m.render().decode(), t)


def test_rates_and_quantiles_cover_only_the_interval():
    m = ServingMetrics("m", num_engines=2)
    m.record_scheduler_stats(SchedulerStats(num_preemptions_total=10,
                                            step_schedule_seconds=[0.2] * 50), 0)
    first = _scrape(m, 100.0)
    m.record_scheduler_stats(SchedulerStats(num_preemptions_total=14,
                                            step_schedule_seconds=[0.0002] * 10), 0)
    m.record_scheduler_stats(SchedulerStats(num_preemptions_total=2), 1)
    second = _scrape(m, 102.0)
    assert rate(first, second, "vllm:num_preemptions_total", "0") == 2.0
    assert rate(first, second, "vllm:num_preemptions_total") == 3.0  # both engines
    assert rate(None, second, "vllm:num_preemptions_total") is None
    # The slow steps were before the interval: its p99 is sub-millisecond.
    p99 = interval_quantile(first, second, "llmtower:scheduler_step_delay_seconds", 0.99, "0")
    assert p99 is not None and p99 <= 0.00025
    assert interval_quantile(None, second, "llmtower:scheduler_step_delay_seconds", 0.99) > 0.1
    view = compute(list(SEED_METRICS), first, second, None, ["0", "1"])
    assert view["scheduler.preempt_count"] == 16 and view["scheduler.preempt_count.per_s"] == 3
    # A restarted server's counter starts again from zero: counted from zero, never negative.
    restarted = _scrape(ServingMetrics("m"), 104.0)
    assert rate(second, restarted, "vllm:num_preemptions_total") == 0.0


class _Stub(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def _serve(port: int) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer(("127.0.0.1", port), _Stub)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_a_server_that_goes_down_and_comes_back_is_shown_not_fatal():
    m = ServingMetrics("m")
    m.record_scheduler_stats(SchedulerStats(num_waiting_reqs=3, num_running_reqs=2))
    _Stub.body = m.render()
    port = free_port()
    httpd = _serve(port)
    poller = Poller(f"http://127.0.0.1:{port}", None, list(SEED_METRICS), timeout_s=2)
    try:
        up = poller.poll()
        assert up.up and up.view["total"]["scheduler.queue_depth"] == 3
        httpd.shutdown()
        httpd.server_close()
        down = poller.poll()  # no exception: a sample that says why
        assert not down.up and "refused" in down.error
        httpd = _serve(port)
        back = poller.poll()
        assert back.up and back.view["total"]["scheduler.running"] == 2
        assert list(poller.history["total"]) == [3, 3]
    finally:
        poller.close()
        httpd.shutdown()
        httpd.server_close()


def test_the_command_keeps_polling_a_dead_server_and_says_so():
    port = free_port()  # nothing listens there
    done = subprocess.run([sys.executable, "-m", "llmtower.cli.main", "monitor", "--url",
                           f"http://127.0.0.1:{port}", "--json", "--interval", "100ms",
                           "--count", "3"], capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 3 and not any(line["up"] for line in lines)
    assert all("refused" in line["error"] for line in lines)


def test_bad_flags_are_refused_with_a_clear_message(capsys):
    assert main(["monitor", "--metric", "scheduler.nonsense", "--once"]) == 2
    assert "unknown metric" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError):
        parse_interval("soon")
    assert parse_interval("500ms") == 0.5 and parse_interval("2") == 2.0
    assert parse_interval("1m") == 60.0


def test_sparklines_scale_to_the_history():
    assert sparkline([]) == ""
    assert sparkline([0, 4, 8]) == "▁▅█"
    assert sparkline([0, 0]) == "▁▁"


@pytest.mark.parametrize("command", [["monitor"], ["diag", "memory"]])
def test_every_option_of_the_operator_commands_has_a_help_line(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in (["--url", "--api-key", "--interval", "--metric", "--once", "--json"]
                 if command == ["monitor"] else
                 ["--url", "--api-key", "--engine-id", "--visualize", "--output", "--input"]):
        assert flag in out, flag
    from llmtower.cli.main import build_parser
    parser = build_parser()
    for name in command:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.option_strings
