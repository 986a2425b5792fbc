"""Adapter reads off the engine's loop: reading an adapter's safetensors and checking it
against the model takes tens to hundreds of milliseconds, which the loop would otherwise
spend with every running request stalled. One background thread reads them in turn."""
from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

from llmtower.lora.adapter import LoRAAdapter
from llmtower.lora.request import LoRARequest


def load_error(req: LoRARequest, exc: BaseException) -> str:
    """What a failed read tells the request's client (the reason, naming the adapter)."""
    if isinstance(exc, OSError):
        return (f"LoRA adapter {req.lora_name!r}: cannot read {req.lora_path!r}: {exc}")
    return str(exc) or f"LoRA adapter {req.lora_name!r}: {type(exc).__name__}"


class AdapterLoader:
    """Owns the adapter reads in flight (by ``lora_int_id``) on one background thread, and the
    reads finished since the last ``collect``: the adapters read and the failures (reasons)."""

    def __init__(self, read: Callable[[LoRARequest], LoRAAdapter]) -> None:
        self.read = read
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pending: dict[int, tuple[LoRARequest, cf.Future[LoRAAdapter]]] = {}

    def start(self, req: LoRARequest) -> None:
        """Read ``req``'s adapter in the background, unless its read is under way."""
        if req.lora_int_id in self._pending:
            return
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self._pending[req.lora_int_id] = (req, self._pool.submit(self.read, req))

    def loading(self, int_id: int) -> bool:
        return int_id in self._pending

    @property
    def busy(self) -> bool:
        """Whether some read has not been collected yet."""
        return bool(self._pending)

    def collect(self, wait_s: float = 0.0) -> tuple[list[LoRAAdapter], dict[int, str]]:
        """The reads finished by now (waiting up to ``wait_s`` for one when none has): the
        adapters read and, by id, the reasons of those that failed."""
        if wait_s > 0 and self._pending:
            cf.wait([f for _, f in self._pending.values()], timeout=wait_s,
                    return_when=cf.FIRST_COMPLETED)
        done: list[LoRAAdapter] = []
        failed: dict[int, str] = {}
        for int_id, (req, fut) in list(self._pending.items()):
            if not fut.done():
                continue
            del self._pending[int_id]
            exc = fut.exception()
            if exc is None:
                done.append(fut.result())
            else:
                failed[int_id] = load_error(req, exc)
        return done, failed

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._pending.clear()
