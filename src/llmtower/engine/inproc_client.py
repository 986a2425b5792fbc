"""The synchronous engine client of the offline ``LLM``: an ``EngineCore`` in this process.

No sockets and no threads: ``get_output()`` runs one engine step in the caller's thread, and a
utility is a method call between two steps. Utilities go by the names a remote engine answers
(``core_messages.UTILITY_METHODS``), so offline and serving ask the engine the same things.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest
from llmtower.engine.core_messages import UTILITY_METHODS

if TYPE_CHECKING:  # the engine core pulls in torch and the executor; the caller built it
    from llmtower.engine.core import EngineCore

T = TypeVar("T")


class InprocEngineClient:
    """Owns one in-process ``EngineCore`` and is the ``SyncEngineClient`` over it."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any, result_type: type[T]) -> T:
        # ping and the data-parallel ones are answered by the engine process, which this is not.
        if method not in UTILITY_METHODS or method == "ping" or method.startswith("dp_"):
            known = sorted(m for m in UTILITY_METHODS if m != "ping" and not m.startswith("dp_"))
            raise ValueError(f"unknown utility method {method!r} for an in-process engine; "
                             f"known: {known}")
        result = getattr(self.engine_core, method)(*args)
        if not isinstance(result, result_type):
            raise TypeError(f"engine utility {method!r} answered a {type(result).__name__}, "
                            f"not a {result_type.__name__}")
        return result

    def shutdown(self) -> None:
        self.engine_core.shutdown()
