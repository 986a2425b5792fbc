"""The scheduler's part in LoRA adapter loads: a request whose adapter is not in memory waits
outside ``waiting`` while the executor reads it on a background thread (it blocks nobody and
no step waits for the read), joins the queue when the adapter is in, and ends with the reason
(its client gets a 400) when the read failed, as a request waiting for its grammar does."""
from __future__ import annotations

from typing import Protocol

from llmtower.core.request import Request, RequestStatus
from llmtower.core.sched.scheduler_state import SchedulerState
from llmtower.lora.request import LoRARequest

# With only adapter-waiting requests, schedule() waits this long for a read to finish.
ADAPTER_WAIT_S = 0.01


class AdapterLoads(Protocol):
    """The executor's adapter reads (``executor/cpu_executor.py``)."""

    def start_lora_load(self, lora_request: LoRARequest) -> bool:
        """True when the adapter is in memory; else its read starts in the background."""
        ...

    def collect_lora_loads(self, wait_s: float = 0.0) -> bool:
        """Take in the reads finished by now; whether some are still under way."""
        ...

    def lora_load_state(self, lora_request: LoRARequest) -> bool | str | None:
        """True: in memory; a str: the read failed, why; None: still reading."""
        ...


class AdapterWaitMixin(SchedulerState):
    """Requests waiting for their adapter's read (``waiting_for_adapter``)."""

    def _start_adapter(self, request: Request) -> bool:
        """Start reading a request's adapter; True when no wait is needed."""
        loads = self.adapter_loads
        if request.lora_request is None or loads is None:
            return True
        return loads.start_lora_load(request.lora_request)

    def _admit_loaded_adapters(self) -> None:
        """Requests whose adapter is in join the waiting queue (or wait on for their
        grammar); those whose read failed end here with the reason. With nothing else to
        run, wait a little for a read rather than spin."""
        loads = self.adapter_loads
        assert loads is not None
        idle = not (self.running or self.waiting or self.swapped or self.waiting_for_grammar)
        loads.collect_lora_loads(ADAPTER_WAIT_S if idle and self.waiting_for_adapter else 0.0)
        for rid, req in list(self.waiting_for_adapter.items()):
            assert req.lora_request is not None
            state = loads.lora_load_state(req.lora_request)
            if state is None:
                continue
            del self.waiting_for_adapter[rid]
            if isinstance(state, str):
                self.num_rejected += 1
                self._request_errors.append((rid, state))
                self._finish(req, RequestStatus.FINISHED_REJECTED)
            elif req.sampling_params.structured_outputs is not None:
                # its grammar's compile started at admission: the grammar poll admits it
                req.status = RequestStatus.WAITING_FOR_GRAMMAR
                self.waiting_for_grammar[rid] = req
            else:
                req.status = RequestStatus.WAITING
                self.waiting.add(req)
