"""Traces: the requests a simulation replays, and their JSONL file format.

One JSON object per line::

    {"arrival_time": 0.125, "prompt_len": 512, "output_len": 128,
     "priority": 0, "tenant": "acme", "prefix_group": "system-prompt-1", "prefix_len": 256}

- ``arrival_time`` (seconds, >= 0) and ``output_len`` (>= 1) are required;
- exactly one of ``prompt_len`` (>= 1) or ``prompt_token_ids`` (a list of token ids);
- optional: ``priority`` (int, lower is more important; default 0), ``tenant`` (string),
  ``prefix_group`` (string: requests of a group share their first ``prefix_len`` prompt tokens,
  so prefix caching matters), ``prefix_len`` (default: the run's ``--prefix-len``),
  ``request_id`` (string; default: the line's index).

Lines are sorted by arrival time on reading (stable); blank lines are skipped.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterable


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace: when it arrives, how long its prompt and output are, and the
    attributes that scheduling and the metrics break results down by."""

    arrival_time: float
    prompt_len: int
    output_len: int
    priority: int = 0
    tenant: str = "default"
    prefix_group: str | None = None
    prefix_len: int | None = None  # None: the run's default
    prompt_token_ids: list[int] | None = None
    request_id: str = ""


_ALLOWED = ("arrival_time", "prompt_len", "prompt_token_ids", "output_len", "priority", "tenant",
            "prefix_group", "prefix_len", "request_id")


class TraceError(ValueError):
    """A trace line that cannot be read; the message names the file, the line and the field."""


def _int(where: str, obj: dict, key: str, minimum: int, default=None, required=False):
    if key not in obj:
        if required:
            raise TraceError(f"{where}: field {key!r} is missing (required)")
        return default
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceError(f"{where}: field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def parse_trace_line(obj: object, where: str, index: int) -> TraceRequest:
    """Validate one decoded JSON line; ``where`` ('file:line') prefixes every error."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_ALLOWED))
    if unknown:
        raise TraceError(f"{where}: unknown field {unknown[0]!r}; allowed fields: "
                         f"{', '.join(_ALLOWED)}")
    if "arrival_time" not in obj:
        raise TraceError(f"{where}: field 'arrival_time' is missing (required)")
    t = obj["arrival_time"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):
        raise TraceError(f"{where}: field 'arrival_time' must be a finite number >= 0 (seconds), "
                         f"got {t!r}")
    ids = obj.get("prompt_token_ids")
    if ids is not None:
        if "prompt_len" in obj:
            raise TraceError(f"{where}: give either 'prompt_len' or 'prompt_token_ids', not both")
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ids)):
            raise TraceError(f"{where}: field 'prompt_token_ids' must be a non-empty list of "
                             "token ids (integers >= 0)")
        prompt_len = len(ids)
    else:
        if "prompt_len" not in obj:
            raise TraceError(f"{where}: field 'prompt_len' is missing: give 'prompt_len' or "
                             "'prompt_token_ids'")
        prompt_len = _int(where, obj, "prompt_len", 1)
    output_len = _int(where, obj, "output_len", 1, required=True)
    priority = obj.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TraceError(f"{where}: field 'priority' must be an integer, got {priority!r}")
    tenant = obj.get("tenant", "default")
    if not isinstance(tenant, str) or not tenant:
        raise TraceError(f"{where}: field 'tenant' must be a non-empty string, got {tenant!r}")
    group = obj.get("prefix_group")
    if group is not None and not isinstance(group, (str, int)):
        raise TraceError(f"{where}: field 'prefix_group' must be a string, got {group!r}")
    rid = obj.get("request_id", str(index))
    if not isinstance(rid, str) or not rid:
        raise TraceError(f"{where}: field 'request_id' must be a non-empty string, got {rid!r}")
    return TraceRequest(float(t), prompt_len, output_len, priority, tenant,
                        None if group is None else str(group),
                        _int(where, obj, "prefix_len", 0), ids, rid)


def read_trace(path: str | os.PathLike) -> list[TraceRequest]:
    """Read a JSONL trace, validating every line; sorted by arrival time."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"trace file {p} does not exist")
    out: list[TraceRequest] = []
    seen: set[str] = set()
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise TraceError(f"{where}: not valid JSON ({e})") from None
            tr = parse_trace_line(obj, where, len(out))
            if tr.request_id in seen:
                raise TraceError(f"{where}: field 'request_id' {tr.request_id!r} repeats an "
                                 "earlier line; request ids must be unique")
            seen.add(tr.request_id)
            out.append(tr)
    if not out:
        raise TraceError(f"{p}: the trace has no requests")
    out.sort(key=lambda r: r.arrival_time)
    return out


def write_trace(trace: Iterable[TraceRequest], path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for r in trace:
            obj: dict = {"request_id": r.request_id, "arrival_time": r.arrival_time}
            if r.prompt_token_ids is not None:
                obj["prompt_token_ids"] = r.prompt_token_ids
            else:
                obj["prompt_len"] = r.prompt_len
            obj["output_len"] = r.output_len
            if r.priority:
                obj["priority"] = r.priority
            if r.tenant != "default":
                obj["tenant"] = r.tenant
            if r.prefix_group is not None:
                obj["prefix_group"] = r.prefix_group
                if r.prefix_len is not None:
                    obj["prefix_len"] = r.prefix_len
            f.write(json.dumps(obj) + "\n")
    return p
