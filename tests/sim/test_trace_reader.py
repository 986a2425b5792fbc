"""The JSONL trace format: valid traces round-trip, a bad line is named precisely."""
from __future__ import annotations

import json

import pytest

from llmtower.sim.workload import TraceError, TraceRequest, read_trace, write_trace


def write(tmp_path, *lines):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return p


def test_a_valid_trace_is_read_sorted_with_defaults(tmp_path):
    p = write(tmp_path,
              {"arrival_time": 1.5, "prompt_len": 10, "output_len": 3, "priority": 2,
               "tenant": "a", "prefix_group": "sys"},
              "",
              {"arrival_time": 0.5, "prompt_token_ids": [5, 6, 7], "output_len": 1})
    t = read_trace(p)
    assert [r.arrival_time for r in t] == [0.5, 1.5]
    first = (t[0].prompt_len, t[0].prompt_token_ids, t[0].tenant, t[0].priority)
    assert first == (3, [5, 6, 7], "default", 0)
    assert (t[1].priority, t[1].tenant, t[1].prefix_group) == (2, "a", "sys")


def test_write_then_read_gives_the_same_trace(tmp_path):
    trace = [TraceRequest(0.0, 12, 4, 1, "x", "g1", 8, None, "a"),
             TraceRequest(0.25, 3, 2, prompt_token_ids=[1, 2, 3], request_id="b")]
    assert read_trace(write_trace(trace, tmp_path / "t.jsonl")) == trace


@pytest.mark.parametrize("line, field", [
    ({"arrival_time": 0, "prompt_len": 4, "output_len": "many"}, "output_len"),
    ({"arrival_time": 0, "prompt_len": 0, "output_len": 4}, "prompt_len"),
    ({"arrival_time": -1, "prompt_len": 4, "output_len": 4}, "arrival_time"),
    ({"prompt_len": 4, "output_len": 4}, "arrival_time"),
    ({"arrival_time": 0, "output_len": 4}, "prompt_len"),
    ({"arrival_time": 0, "prompt_len": 4}, "output_len"),
    ({"arrival_time": 0, "prompt_len": 4, "output_len": 4, "priority": "high"}, "priority"),
    ({"arrival_time": 0, "prompt_token_ids": [1, -2], "output_len": 4}, "prompt_token_ids"),
    ({"arrival_time": 0, "prompt_len": 4, "ouput_len": 4}, "ouput_len"),
    ({"arrival_time": 0, "prompt_len": 4, "output_len": True}, "output_len"),
])
def test_a_malformed_line_is_rejected_naming_its_line_and_field(tmp_path, line, field):
    ok = {"arrival_time": 0, "prompt_len": 4, "output_len": 4}
    p = write(tmp_path, ok, ok, line)
    with pytest.raises(TraceError) as e:
        read_trace(p)
    assert "trace.jsonl:3:" in str(e.value) and repr(field) in str(e.value)


def test_invalid_json_and_empty_traces_are_clear_errors(tmp_path):
    with pytest.raises(TraceError, match=r"trace.jsonl:2: not valid JSON"):
        read_trace(write(tmp_path, {"arrival_time": 0, "prompt_len": 4, "output_len": 4}, "{oops"))
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write(tmp_path, ""))
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "missing.jsonl")


def test_repeated_request_ids_are_rejected(tmp_path):
    line = {"arrival_time": 0, "prompt_len": 4, "output_len": 4, "request_id": "x"}
    with pytest.raises(TraceError, match=r":2: field 'request_id' 'x' repeats"):
        read_trace(write(tmp_path, line, line))
