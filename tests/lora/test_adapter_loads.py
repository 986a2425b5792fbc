"""Adapters read off the engine's loop: while a request's adapter is read (a read held back
on an Event here, never timing), the other requests' steps go on and the request waits outside
the queue; it runs with its adapter once the read is in; a failed read ends that request alone
with the reason, and an abort while it waits leaves nothing behind."""
from __future__ import annotations

import threading

import pytest

from llmtower import LLM, LoRARequest, SamplingParams
from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.request import RequestStatus
from tests.fixtures.lora_adapters import merged_greedy

PROMPT, OTHER = [5, 77, 300, 12, 9, 450, 8, 9, 10], [33, 1, 101, 222, 333]
TOKENS = 5


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    # max_lora_rank 8: the "mlp" adapter (rank 16) fails its checks
    return LLM(model=str(tiny_llama_dir), num_threads=1, block_size=4, max_model_len=128,
               num_gpu_blocks=128, seed=0, enable_lora=True, max_loras=2, max_cpu_loras=2,
               max_lora_rank=8)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)


class HeldRead:
    """Wraps the manager's adapter read: each read announces itself, then waits for
    ``release`` (a read the test never releases fails the test after 60 s, not hangs it)."""

    def __init__(self, llm: LLM) -> None:
        self.loader = llm.engine_core.executor.runner.lora.loader
        self.real = self.loader.read
        self.started, self.gate = threading.Event(), threading.Event()

    def __enter__(self) -> HeldRead:
        self.loader.read = self.read
        return self

    def __exit__(self, *exc) -> None:
        self.gate.set()
        self.loader.read = self.real

    def read(self, req):
        self.started.set()
        if not self.gate.wait(60):
            raise RuntimeError("the test never released the read")
        return self.real(req)


def _run(core, outs: dict[str, list[int]], errors: dict[str, str], steps: int | None = None
         ) -> None:
    """Step ``steps`` times (None: until nothing is left), gathering tokens and errors."""
    n = 0
    while core.has_unfinished_requests() and (steps is None or n < steps):
        result = core.step()
        for o in result.outputs:
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        errors.update(dict(result.request_errors))
        n += 1


def _assert_nothing_left(core) -> None:
    sched = core.scheduler
    assert not sched.requests and not sched.waiting_for_adapter
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
    assert not core.executor.runner.lora.loader.busy


def test_slow_read_stalls_no_other_request(llm, tiny_llama_dir, tiny_adapters):
    core = llm.engine_core
    lora = LoRARequest("all", 1, str(tiny_adapters["all"]))
    outs: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    with HeldRead(llm) as held:
        core.add_request(EngineCoreRequest("base", OTHER, _greedy()))
        core.add_request(EngineCoreRequest("lora", PROMPT, _greedy(), lora_request=lora))
        assert held.started.wait(30)
        # The read is held: the base request's steps run all the same, to its end.
        _run(core, outs, errors, steps=TOKENS + 2)
        assert len(outs["base"]) == TOKENS
        assert "lora" not in outs
        assert core.scheduler.requests["lora"].status == RequestStatus.WAITING_FOR_ADAPTER
        held.gate.set()
        _run(core, outs, errors)
    assert not errors
    assert outs["lora"] == merged_greedy(tiny_llama_dir, tiny_adapters["all"], [PROMPT],
                                         TOKENS)[0]
    assert outs["base"] == merged_greedy(tiny_llama_dir, None, [OTHER], TOKENS)[0]
    _assert_nothing_left(core)


def test_failed_read_ends_that_request_with_the_reason(llm, tiny_adapters):
    core = llm.engine_core
    outs: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    core.add_request(EngineCoreRequest("base2", OTHER, _greedy()))
    core.add_request(EngineCoreRequest(
        "bad", PROMPT, _greedy(), lora_request=LoRARequest("mlp", 3, str(tiny_adapters["mlp"]))))
    _run(core, outs, errors)
    assert "rank 16 is above --max-lora-rank=8" in errors["bad"]
    assert "bad" not in outs and len(outs["base2"]) == TOKENS
    _assert_nothing_left(core)
    # Offline, the reason is raised as the request's error (the server's 400).
    with pytest.raises(ValueError, match="rank 16 is above --max-lora-rank=8"):
        llm.generate([PROMPT], _greedy(), use_tqdm=False,
                     lora_request=LoRARequest("mlp", 3, str(tiny_adapters["mlp"])))


def test_abort_while_the_adapter_is_read(llm, tiny_adapters):
    core = llm.engine_core
    lora = LoRARequest("attn", 2, str(tiny_adapters["attn"]))
    with HeldRead(llm) as held:
        core.add_request(EngineCoreRequest("gone", PROMPT, _greedy(), lora_request=lora))
        assert held.started.wait(30)
        core.step()
        assert core.abort_requests(["gone"]) == ["gone"]
        assert not core.has_unfinished_requests()
    # The read finishes into the adapter cache, where the next request finds it.
    outs: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    core.add_request(EngineCoreRequest("next", PROMPT, _greedy(), lora_request=lora))
    _run(core, outs, errors)
    assert len(outs["next"]) == TOKENS and not errors
    _assert_nothing_left(core)
