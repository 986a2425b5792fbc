"""Streamed chunks without pydantic on the hot path: a stream's fixed fields (id, object,
created, model, system_fingerprint) are JSON-encoded once, and each token's chunk is that
head, its one choice as a plain dict through orjson, and the tail. The bytes are exactly
what ``Chunk(...).model_dump_json(exclude_none=True)`` writes for a chunk without usage,
metrics or token ids (tests/server/test_stream_chunks.py holds them equal); the endpoints
keep the pydantic models for every other chunk."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from llmtower.engine.request_output import RequestOutput
from llmtower.server.protocol import SYSTEM_FINGERPRINT


class StreamChunkEncoder:
    """Owns one stream's pre-encoded head and tail of a ``data: {...}`` SSE event."""

    def __init__(self, object_name: str, request_id: str, created: int, model: str) -> None:
        head = orjson.dumps({"id": request_id, "object": object_name, "created": created,
                             "model": model})
        self._head = b"data: " + head[:-1] + b',"choices":['
        self._tail = b'],"system_fingerprint":' + orjson.dumps(SYSTEM_FINGERPRINT) + b"}\n\n"

    def event(self, choice: dict[str, Any]) -> bytes:
        """The SSE event of a chunk that carries ``choice`` alone."""
        return self._head + orjson.dumps(choice) + self._tail


def completion_choice(index: int, text: str, finish_reason: str | None,
                      stop_reason: int | str | None) -> dict[str, Any]:
    """A /v1/completions stream choice without logprobs or token ids."""
    return _with_nulls({"index": index, "text": text}, finish_reason, stop_reason)


def chat_choice(index: int, content: str | None, finish_reason: str | None,
                stop_reason: int | str | None) -> dict[str, Any]:
    """A /v1/chat/completions stream choice whose delta is plain content (or nothing)."""
    return _with_nulls({"index": index,
                        "delta": {} if content is None else {"content": content}},
                       finish_reason, stop_reason)


def _with_nulls(choice: dict[str, Any], finish_reason: str | None,
                stop_reason: int | str | None) -> dict[str, Any]:
    # The models' order: set fields in declaration order, then the nulls clients index
    # (protocol.keep_null_keys appends them).
    if finish_reason is not None:
        choice["finish_reason"] = finish_reason
    if stop_reason is not None:
        choice["stop_reason"] = stop_reason
    choice["logprobs"] = None
    if finish_reason is None:
        choice["finish_reason"] = None
    return choice


def plain_events(ro: RequestOutput, encoder: StreamChunkEncoder,
                 make_choice: Callable[[int, str, None, Any], dict[str, Any]],
                 choice_tokens: list[int]) -> tuple[bytes, int] | None:
    """A middle output of a plain stream as the direct lane writes it (direct_lane.py): its
    events (one per choice with text) and its token count, the choices' counts in
    ``choice_tokens`` updated; None, counting nothing, for an output with a finish or logprobs
    (the endpoint's own loop makes those)."""
    if any(c.finish_reason is not None or c.logprobs for c in ro.outputs):
        return None
    body = b""
    num_tokens = 0
    for c in ro.outputs:
        num_tokens += len(c.token_ids)
        choice_tokens[c.index] += len(c.token_ids)
        if c.text:
            body += encoder.event(make_choice(c.index, c.text, None, c.stop_reason))
    return body, num_tokens
