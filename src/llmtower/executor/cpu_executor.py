"""The CPU executor: the real model behind the ``Executor`` protocol."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from llmtower.core.config import CacheConfig
from llmtower.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmtower.executor.cpu_threads import ThreadGovernor
from llmtower.executor.kv_cache import KVCache
from llmtower.kernels.kv_quant import resolve_kv_cache_dtype
from llmtower.executor.model_runner import ModelRunner
from llmtower.lora.adapter import LoRAModelShape
from llmtower.lora.model_manager import LoRAModelManager
from llmtower.lora.request import LoRARequest
from llmtower.models.config import ModelConfig
from llmtower.models.registry import model_class
from llmtower.models.quant import QuantizedTensor
from llmtower.models.quant_block import GGUFMatrix


class CPUExecutor:
    """Owns the model, its paged KV cache (and swap space) and the model runner. Each step it
    performs the scheduler's block moves, in the order swap-out, swap-in, copy, and then the
    forward pass and sampling."""

    def __init__(self, model_config: ModelConfig,
                 state_dict: Mapping[str, torch.Tensor | QuantizedTensor | GGUFMatrix],
                 cache_config: CacheConfig, dtype: torch.dtype, max_model_len: int,
                 seed: int = 0, attention_backend: str = "auto",
                 quantization: str = "none", adaptive_threads: int = 0,
                 cpu_bind: tuple[int, ...] = ()) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len} must be at least 1")
        self.model_config = model_config
        self.dtype = dtype
        self.model = model_class(model_config.architecture)(
            model_config, state_dict, dtype, max_model_len, quantization)
        self.kv_cache = KVCache(model_config, cache_config.num_blocks, cache_config.num_cpu_blocks,
                                cache_config.block_size, dtype,
                                resolve_kv_cache_dtype(cache_config.cache_dtype, dtype),
                                swap_layout=cache_config.swap_layout)
        self.runner = ModelRunner(self.model, self.kv_cache, max_model_len, seed,
                                  attention_backend)
        self.num_steps = 0
        # --num-threads left to the engine: up to this many threads, fewer under contention;
        # --cpu-bind: those threads pinned, one CPU each (a fixed count is pinned too).
        self.thread_governor: ThreadGovernor | None = None
        if adaptive_threads or cpu_bind:
            self.thread_governor = ThreadGovernor(adaptive_threads or len(cpu_bind),
                                                  adaptive=bool(adaptive_threads), bind=cpu_bind)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        if self.thread_governor is not None:
            self.thread_governor.before_step()
        so = scheduler_output
        self.kv_cache.swap_out(so.blocks_to_swap_out, so.swap_out_compressed)
        self.kv_cache.swap_in(so.blocks_to_swap_in, so.swap_in_compressed)
        self.kv_cache.move(so.blocks_to_move)  # block tables: remapped by the runner
        return self.runner.execute_model(so)

    def enable_lora(self, max_loras: int, max_cpu_loras: int, max_lora_rank: int) -> None:
        """--enable-lora: the runner gets an adapter manager (lora/model_manager.py)."""
        if not self.model.supports_lora:
            raise ValueError(f"--enable-lora is not supported for {self.model_config.architecture} "
                             "models yet: LoRA adapters run on the Llama-family models "
                             "(Llama, Qwen2, Qwen3, Mistral, Phi-3)")
        self.runner.lora = LoRAModelManager(LoRAModelShape.from_config(self.model_config),
                                            self.dtype, max_loras, max_cpu_loras, max_lora_rank)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load (and check) an adapter now; False where it was held already. Raises
        ValueError when LoRA is off or the adapter cannot be served."""
        mgr = self._lora_manager()
        held = lora_request.lora_int_id in mgr.adapters
        mgr.load(lora_request)
        return not held

    def start_lora_load(self, lora_request: LoRARequest) -> bool:
        """True when the adapter is in memory; else it is read in the background (the
        scheduler's ``AdapterLoads``, core/sched/adapter_wait.py)."""
        return self._lora_manager().start_load(lora_request)

    def collect_lora_loads(self, wait_s: float = 0.0) -> bool:
        return self._lora_manager().collect_loads(wait_s)

    def lora_load_state(self, lora_request: LoRARequest) -> bool | str | None:
        return self._lora_manager().load_state(lora_request)

    def _lora_manager(self) -> LoRAModelManager:
        mgr = self.runner.lora
        if mgr is None:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora "
                             "(enable_lora=True) to serve adapters")
        return mgr

    def remove_lora(self, lora_id: int) -> bool:
        mgr = self.runner.lora
        return mgr.remove(lora_id) if mgr is not None else False

    def list_loras(self) -> list[int]:
        mgr = self.runner.lora
        return list(mgr.adapters) if mgr is not None else []

    def apply_block_moves(self, moves: list[tuple[int, int]]) -> None:
        """An on-demand defragmentation between two steps: move the K/V, remap the tables."""
        self.kv_cache.move(moves)
        self.runner.batch.remap_block_ids(moves)

    def shutdown(self) -> None:
        if self.runner.lora is not None:  # reads in flight are dropped
            self.runner.lora.loader.shutdown()
