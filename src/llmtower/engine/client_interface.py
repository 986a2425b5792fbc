"""EngineClient: what the serving front end (``AsyncLLM``) may ask of its engine client.

``EngineCoreClient`` (one engine process) and ``DPEngineCoreClient`` (several, data parallel)
both provide it, so ``AsyncLLM`` never needs to know which it holds, and never reaches into
either one's private state.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest
from llmtower.engine.core_messages import EngineReady, RequestError


@runtime_checkable
class EngineClient(Protocol):
    """The engine-client interface: start, send, abort, receive, utilities, death, shutdown."""

    @property
    def is_dead(self) -> bool:
        """True once the engine (any engine, for data parallelism) is known to be gone."""
        ...

    @property
    def dead_reason(self) -> str | None:
        ...

    async def start(self, timeout_s: float | None = None) -> EngineReady:
        """Start the engine process(es); their handshake (one merged view for DP)."""
        ...

    async def add_request(self, request: EngineCoreRequest) -> None:
        ...

    async def abort_requests(self, request_ids: list[str]) -> None:
        ...

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """Abort without awaiting (from synchronous code such as a generator's finally)."""
        ...

    async def get_output(self) -> EngineCoreOutputs | RequestError | Any:
        """The next outputs in engine order; raises EngineDeadError once the engine is gone.
        (A data-parallel engine's own events may come through too: callers skip them.)"""
        ...

    async def call_utility(self, method: str, *args: Any, result_type: Any = Any,
                           timeout_s: float | None = None) -> Any:
        """``method(*args)`` on the engine between two steps (merged over DP engines)."""
        ...

    def engine_of(self, request_id: str) -> int | None:
        """The data-parallel rank serving a request (None: not known)."""
        ...

    def mark_dead(self, reason: str) -> None:
        """Declare the engine unusable (e.g. the front end's output handler failed): every
        waiting caller fails with EngineDeadError."""
        ...

    def shutdown(self, timeout_s: float = 5.0) -> None:
        ...
