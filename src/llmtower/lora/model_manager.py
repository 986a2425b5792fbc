"""The executor's adapters: read on a background thread when a request first names them
(``lora/loader.py``), kept LRU up to ``max_cpu_loras``, and stacked for the step's active
set."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from llmtower.lora.adapter import LoRAAdapter, LoRAModelShape
from llmtower.lora.loader import AdapterLoader
from llmtower.lora import peft_loader
from llmtower.lora.punica import LoRAStep, StackedLoRA
from llmtower.lora.request import LoRARequest


class LoRAModelManager:
    """Owns the loaded adapters (by ``lora_int_id``, least recently used first) and the
    stacked matrices of the last step's active set."""

    def __init__(self, shape: LoRAModelShape, dtype: torch.dtype, max_loras: int,
                 max_cpu_loras: int, max_lora_rank: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras={max_cpu_loras} must be at least "
                             f"max_loras={max_loras}: a step's adapters must all be in memory")
        self.shape = shape
        self.dtype = dtype
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._users: dict[int, int] = {}  # lora_int_id -> requests in the runner using it
        self._doomed: set[int] = set()  # removed while in use: dropped when released
        self._stack: StackedLoRA | None = None
        self.loader = AdapterLoader(self.read)
        self._failed: dict[int, str] = {}  # reads that failed in the last collect_loads

    def read(self, req: LoRARequest) -> LoRAAdapter:
        """Read and check ``req``'s adapter (any thread: touches nothing of the manager)."""
        return peft_loader.load_peft_adapter(req.lora_path, req.lora_name, req.lora_int_id,
                                             self.shape, self.dtype, self.max_lora_rank)

    def start_load(self, req: LoRARequest) -> bool:
        """True when ``req``'s adapter is held (now marked recently used); else its read
        starts in the background (once however many requests ask) and ``load_state`` tells
        when it is done."""
        if req.lora_int_id in self.adapters:
            self.adapters.move_to_end(req.lora_int_id)
            return True
        self.loader.start(req)
        return False

    def collect_loads(self, wait_s: float = 0.0) -> bool:
        """Take in the background reads finished by now (waiting up to ``wait_s`` for one):
        the adapters join the held ones; failures are kept for ``load_state`` until the next
        call. Returns whether reads are still under way."""
        done, self._failed = self.loader.collect(wait_s)
        for adapter in done:
            self.add(adapter)
        return self.loader.busy

    def load_state(self, req: LoRARequest) -> bool | str | None:
        """After ``collect_loads``: True when the adapter is held, the reason when its read
        failed, None while it is read (started again if it was evicted meanwhile)."""
        if req.lora_int_id in self.adapters:
            return True
        failed = self._failed.get(req.lora_int_id)
        if failed is not None:
            return failed
        self.loader.start(req)
        return None

    def load(self, req: LoRARequest) -> LoRAAdapter:
        """The adapter of ``req``, read from its folder unless held (then marked recently
        used); evicts the least recently used past ``max_cpu_loras``. Raises
        ``LoRAAdapterError`` for an adapter this model cannot serve."""
        held = self.adapters.get(req.lora_int_id)
        if held is not None:
            self.adapters.move_to_end(req.lora_int_id)
            return held
        adapter = self.read(req)
        self.add(adapter)
        return adapter

    def add(self, adapter: LoRAAdapter) -> None:
        self.adapters[adapter.int_id] = adapter
        self.adapters.move_to_end(adapter.int_id)
        self._evict()

    def _evict(self) -> None:
        """Least recently used first, never one a held request runs with (a step's adapters
        must all be here): past max_cpu_loras only while every held adapter is in use."""
        while len(self.adapters) > self.max_cpu_loras:
            victim = next((i for i in self.adapters if not self._users.get(i)), None)
            if victim is None:
                break
            del self.adapters[victim]
            if self._stack is not None and victim in self._stack.ids:
                self._stack = None

    def hold(self, req: LoRARequest) -> None:
        """A request with this adapter joined the runner: load it (if evicted) and keep it."""
        self.load(req)
        self._doomed.discard(req.lora_int_id)
        self._users[req.lora_int_id] = self._users.get(req.lora_int_id, 0) + 1

    def release(self, int_id: int) -> None:
        """A request with this adapter left the runner."""
        left = self._users.get(int_id, 0) - 1
        if left > 0:
            self._users[int_id] = left
        else:
            self._users.pop(int_id, None)
            if int_id in self._doomed:
                self._doomed.discard(int_id)
                self.remove(int_id)
            self._evict()

    def in_use(self, int_id: int) -> bool:
        return bool(self._users.get(int_id))

    def remove(self, int_id: int) -> bool:
        """Forget an adapter (False: not held). Requests the runner still holds (finished
        ones whose release comes with the next step) keep it until they leave."""
        if self._users.get(int_id):
            self._doomed.add(int_id)
            return True
        if self._stack is not None and int_id in self._stack.ids:
            self._stack = None
        return self.adapters.pop(int_id, None) is not None

    def step(self, token_lora_ids: np.ndarray) -> LoRAStep | None:
        """The step's LoRA rows from each token row's ``lora_int_id`` (0: none); None when no
        row has an adapter (the model's plain path, fused decode kernel included)."""
        if not token_lora_ids.any():
            return None
        active = np.unique(token_lora_ids[token_lora_ids > 0])
        if len(active) > self.max_loras:
            raise RuntimeError(f"a step holds {len(active)} adapters, more than "
                               f"max_loras={self.max_loras}: the scheduler must cap them")
        ids = tuple(int(i) for i in active)
        missing = [i for i in ids if i not in self.adapters]
        if missing:
            raise RuntimeError(f"adapters {missing} are scheduled but not loaded")
        for i in ids:
            self.adapters.move_to_end(i)
        if self._stack is None or self._stack.ids != ids:
            self._stack = StackedLoRA([self.adapters[i] for i in ids], self.shape.num_layers,
                                      self.dtype, self.shape.dims)
        slot = np.searchsorted(active, token_lora_ids)
        slot[token_lora_ids <= 0] = -1
        return LoRAStep(self._stack, slot.astype(np.int64))
