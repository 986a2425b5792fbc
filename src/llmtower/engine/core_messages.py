"""The wire protocol between the API process (``EngineCoreClient``) and the engine process
(``EngineCoreProc``): message tags and the msgspec structs that travel next to the core's own
``EngineCoreRequest`` / ``EngineCoreOutputs``.

Every ZMQ message is two frames: a one-byte tag saying what the payload is, then the payload
encoded with msgpack. Input (client -> engine): ADD, ABORT, UTILITY, SHUTDOWN. Output
(engine -> client): OUTPUTS, REQUEST_ERROR, UTILITY_RESULT, READY (the start-up handshake)
and DEAD (the engine failed; the process exits right after).
"""
from __future__ import annotations

import msgspec


class InputTag:
    """First frame of a client -> engine message."""

    ADD = b"a"  # EngineCoreRequest
    ABORT = b"x"  # list[str] of request ids
    UTILITY = b"u"  # UtilityCall
    SHUTDOWN = b"q"  # empty payload


class OutputTag:
    """First frame of an engine -> client message."""

    OUTPUTS = b"o"  # EngineCoreOutputs
    REQUEST_ERROR = b"e"  # RequestError
    UTILITY_RESULT = b"u"  # UtilityResult
    READY = b"r"  # EngineReady
    DEAD = b"d"  # EngineDead
    HEARTBEAT = b"h"  # empty payload: the engine is alive (sent when nothing else was)
    DP_EVENT = b"w"  # distributed.dp_group.DPEvent: a wave started, the DP group broke


# The engine methods a client may call by name; anything else is refused, so a utility call
# can never reach into the engine's internals.
# One name per line: several features add theirs.
UTILITY_METHODS = frozenset({
    "get_stats",
    "reset_prefix_cache",
    "update_priority",
    "ping",
    "kv_cache_snapshot",
    "defragment",
    "preload",
    "preload_status",
    "unpin",
    # LoRA adapters (lora/engine_ops.py)
    "add_lora",
    "remove_lora",
    "list_loras",
    # data parallelism, answered by the engine process itself (distributed/dp_group.py)
    "dp_set_membership",
    "dp_start_wave",
    "dp_status",
    "dp_handshake",
    "dp_coordinated",
})


class UtilityCall(msgspec.Struct, array_like=True):
    """Call ``method(*args)`` on the engine between two steps; answered by a UtilityResult."""

    call_id: int
    method: str
    args: list = []


class UtilityResult(msgspec.Struct, array_like=True):
    """The answer to one UtilityCall. ``result`` stays msgpack-encoded until the caller, who
    knows its type, decodes it; ``error`` is set instead when the call raised."""

    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str | None = None


class RequestError(msgspec.Struct, array_like=True):
    """The engine refused a request at admission. ``kind`` maps to an HTTP status:
    ``admission`` (can never run) -> 400, ``queue_full`` -> 429, ``invalid`` -> 400."""

    request_id: str
    kind: str
    message: str


class PingResult(msgspec.Struct):
    """Proof that the busy loop turns: it answers between steps."""

    num_steps: int
    num_unfinished_requests: int


class EngineReady(msgspec.Struct):
    """The start-up handshake: what the client needs to know about the engine it talks to."""

    pid: int
    model_name: str
    model_path: str
    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: list[int] = []
    vocab_size: int = 0  # the model's (embedding rows); 0 when the engine does not say
    max_model_len_reason: str = ""  # e.g. the model's sliding window capped it


class EngineDead(msgspec.Struct):
    """The engine failed (start-up or busy loop) and is exiting; ``reason`` says why."""

    reason: str
