"""Build a ready EngineCore (scheduler + CPU executor over a real model) from EngineArgs."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from llmtower.core.sched.async_scheduler import AsyncScheduler
from llmtower.core.sched.scheduler import Scheduler
from llmtower.core.sched.degradation import check_host_memory
from llmtower.executor.memory_bounds import working_memory_bytes
from llmtower.executor.memory_plan import estimate_weight_bytes, make_plan, rss_bytes
from llmtower.engine.arg_values import parse_bytes, parse_swap_space
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.engine.model_info import ModelInfo
from llmtower.executor.cpu_executor import CPUExecutor
from llmtower.executor.dtype_support import ALLOW_ENV, dtype_refusal
from llmtower.executor.kv_cache import bytes_per_block
from llmtower.kernels.kv_quant import resolve_kv_cache_dtype
from llmtower.executor.swap_space import swap_layout_for, swap_slot_bytes
from llmtower.lora.serving_args import max_cpu_loras
from llmtower.core.swap_layout import SwapLayout
from llmtower.models.config import ModelConfig
from llmtower.models.gguf_weights import gguf_source
from llmtower.models.loader import load_model_config, resolve_model_path
from llmtower.models.quant_loader import load_model_weights
from llmtower.models.weights import resolve_dtype
from llmtower.structured_output.manager import make_xgrammar_manager

# The default context length when the model's own is longer: KV memory and the rotary tables
# grow with it, and few CPU workloads need more.
DEFAULT_MAX_MODEL_LEN_CAP = 8192

logger = logging.getLogger(__name__)


def resolve_max_model_len(requested: int, config: ModelConfig) -> int:
    """``requested`` (0: the model's own, capped at 8192), checked against the model. A
    sliding window does not limit it: windowed layers attend to their window at any length."""
    limit = config.max_position_embeddings
    if requested == 0:
        return min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
    if requested > limit:
        raise ValueError(f"max_model_len={requested} is longer than the model allows "
                         f"(max_position_embeddings is {limit}): use --max-model-len {limit} "
                         "or less")
    return requested


def kv_cache_blocks(args: EngineArgs, config: ModelConfig, dtype: torch.dtype,
                    weights: int = 0) -> tuple[int, int]:
    """(device KV blocks, CPU swap blocks) from --num-gpu-blocks / --kv-cache-memory and
    --swap-space (swap space only under preemption_mode=swap); ``weights``: the model's
    estimated bytes, planned with them (executor/memory_plan.py)."""
    # --kv-cache-dtype: a smaller element (and int8's scales) sizes more blocks.
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    per_block = bytes_per_block(config, args.block_size, kv_dtype)
    if args.num_gpu_blocks:
        num_blocks = args.num_gpu_blocks
    else:
        num_blocks = parse_bytes(args.kv_cache_memory) // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={args.kv_cache_memory!r} holds no KV block (one block "
                             f"of {args.block_size} tokens takes {per_block} bytes for this model): "
                             "give the KV cache more memory")
    num_cpu_blocks = 0  # swap slots: one per block, or several where swaps may be int8
    slot_bytes = swap_slot_bytes(config, args.block_size, kv_dtype,
                                 swap_layout(args, config, dtype))
    if args.preemption_mode == "swap":
        num_cpu_blocks = parse_swap_space(args.swap_space) // slot_bytes
    # Never into the OOM killer: the pool, the model's working memory (memory_bounds.py) and
    # swap space must fit the host's memory.
    working = working_memory_bytes(
        config.hidden_size, config.intermediate_size, config.num_attention_heads,
        config.num_key_value_heads, config.head_dim, config.vocab_size,
        args.max_num_batched_tokens, args.max_num_seqs,
        args.max_model_len or DEFAULT_MAX_MODEL_LEN_CAP, torch.empty((), dtype=dtype).element_size())
    plan = make_plan(weights, working, num_blocks * per_block, num_cpu_blocks * slot_bytes)
    logger.info("memory plan: %s (working memory: one step's activations, scores and "
                "logits; bounded oneDNN caches)", plan.describe())
    if weights:
        plan.check()
    else:
        check_host_memory(num_blocks * per_block + working, num_cpu_blocks * slot_bytes)
    return num_blocks, num_cpu_blocks


def swap_layout(args: EngineArgs, config: ModelConfig, dtype: torch.dtype) -> SwapLayout:
    """Int8 slots in the swap space when swap-outs may be compressed: --swap-space-dtype int8,
    or degradation level 2 (executor/swap_space.py)."""
    may_compress = args.preemption_mode == "swap" and (
        args.swap_space_dtype == "int8" or args.enable_degradation)
    return swap_layout_for(config, args.block_size,
                           resolve_kv_cache_dtype(args.kv_cache_dtype, dtype), may_compress)


def create_engine_core(args: EngineArgs) -> EngineCore:
    """Resolve and load the model, size the KV cache, and wire Scheduler + CPUExecutor into an
    EngineCore whose ``model_info`` tells its front ends about the model."""
    torch.set_num_threads(args.threads)
    path: Path = resolve_model_path(args.model)
    config = load_model_config(path)
    dtype = resolve_dtype(args.resolved_dtype())
    refusal = dtype_refusal(dtype, os.environ.get(ALLOW_ENV) == "1")
    if refusal:
        raise ValueError(refusal)
    max_model_len = resolve_max_model_len(args.max_model_len, config)
    weights = estimate_weight_bytes(path, gguf_source(path), dtype, args.quantization)
    num_blocks, num_cpu_blocks = kv_cache_blocks(args, config, dtype, weights)
    cache_config = args.create_cache_config(num_blocks, num_cpu_blocks,
                                            swap_layout(args, config, dtype))
    # Every layer windowed: a request keeps only its window's blocks (one global layer reads
    # the whole context, so then every block stays).
    cache_config.sliding_window = config.sliding_window if config.all_layers_windowed else None
    scheduler_config = args.create_scheduler_config(max_model_len)
    state_dict = load_model_weights(args.model, path, dtype, args.quantization)
    executor = CPUExecutor(config, state_dict, cache_config, dtype, max_model_len, seed=args.seed,
                           attention_backend=args.attention_backend,
                           quantization=args.quantization,
                           adaptive_threads=0 if args.num_threads else args.threads,
                           cpu_bind=args.cpu_bind_cpus())
    del state_dict
    rss, peak = rss_bytes()
    logger.info("model loaded: RSS %.2f GiB (peak %.2f GiB; weights planned at %.2f GiB)",
                rss / 2**30, peak / 2**30, weights / 2**30)
    if args.enable_lora:
        executor.enable_lora(args.max_loras, max_cpu_loras(args), args.max_lora_rank)
    if args.speculative is not None:
        from llmtower.executor.spec_decode_setup import attach_spec_decode
        attach_spec_decode(executor, args.speculative, dtype=dtype)
    info = ModelInfo(model_config=config, model_path=path, max_model_len=max_model_len,
                     dtype=dtype, num_threads=args.threads,
                     eos_token_ids=list(config.eos_token_ids))
    grammars = make_xgrammar_manager(  # structured outputs: compiles off the busy loop
        args.create_structured_outputs_config(),
        args.tokenizer or path, config.vocab_size,
        list(config.eos_token_ids))
    # --async-scheduling: the AsyncScheduler's placeholders, and EngineCore's batch queue.
    scheduler_cls = AsyncScheduler if args.async_scheduling else Scheduler
    return EngineCore(scheduler_cls(scheduler_config, cache_config, structured_output=grammars),
                      executor, model_info=info)
