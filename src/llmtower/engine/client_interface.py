"""The engine-client interfaces: what a front end may ask of the engine it drives.

- ``EngineClient`` (asynchronous, the serving front end ``AsyncLLM`` and the server's routes):
  ``EngineCoreClient`` (one engine process) and ``DPEngineCoreClient`` (several, data parallel)
  both provide it, so neither ``AsyncLLM`` nor the server needs to know which it holds, and
  neither reaches into a client's private state.
- ``SyncEngineClient`` (synchronous, the offline ``LLM``): the same operations on an engine in
  this process, each done when it returns; ``get_output`` runs one engine step.
  ``InprocEngineClient`` (``engine/inproc_client.py``) provides it.
"""
from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest
from llmtower.engine.core_messages import EngineReady, RequestError

T = TypeVar("T")


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

    async def call_utility_on(self, engine_index: int, method: str, *args: Any,
                              result_type: Any = Any, timeout_s: float | None = None) -> Any:
        """``method(*args)`` on one engine (``0 .. data-parallel size - 1``) and its answer
        alone, unmerged; ValueError for an engine that does not exist."""
        ...

    def engine_of(self, request_id: str) -> int | None:
        """The data-parallel rank serving a request (None: not known)."""
        ...

    def health(self) -> dict[str, Any] | None:
        """What ``/health`` shows of a live engine set: for data parallelism which ranks serve
        and which are gone; None for one engine (alive says it all)."""
        ...

    async def data_parallel_view(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The data-parallel state (health, routing counters, each live engine's sync
        counters); None for one engine."""
        ...

    def set_draining(self, engine_index: int, draining: bool) -> dict[str, Any] | None:
        """Drain data-parallel engine ``engine_index`` (no new requests, its un-started ones
        moved to the others) or route to it again; its drain status. ValueError when that
        engine does not exist or no other engine would serve; None for one engine."""
        ...

    def mark_dead(self, reason: str) -> None:
        """Declare the engine unusable (e.g. the front end's output handler failed): every
        waiting caller fails with EngineDeadError."""
        ...

    def shutdown(self, timeout_s: float = 5.0) -> None:
        ...


@runtime_checkable
class SyncEngineClient(Protocol):
    """The synchronous engine-client interface: send, abort, step for outputs, utilities,
    shutdown; for an engine that runs in the caller's process and thread."""

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; raises AdmissionError / QueueFullError / ValueError and then
        queues nothing."""
        ...

    def abort_requests(self, request_ids: list[str]) -> None:
        ...

    def has_unfinished_requests(self) -> bool:
        ...

    def get_output(self) -> EngineCoreOutputs:
        """Run one engine step and return its outputs."""
        ...

    def call_utility(self, method: str, *args: Any, result_type: type[T]) -> T:
        """``method(*args)`` on the engine (one of ``core_messages.UTILITY_METHODS``, as for a
        remote engine); TypeError when it does not answer a ``result_type``."""
        ...

    def shutdown(self) -> None:
        ...
