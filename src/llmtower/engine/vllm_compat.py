"""vLLM's engine settings that have no counterpart in this CPU engine, judged once.

Someone coming from vLLM types ``vllm serve`` flags (or ``LLM(...)`` keyword arguments) at
llmtower. Every such setting is either honoured (it is an ``EngineArgs`` field with vLLM's
meaning), accepted with one warning line saying why it changes nothing here (only where the
behaviour asked for is what this engine does anyway), or refused with an error that says what
to use instead. None is ignored silently.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llmtower.engine.args import EngineArgs

logger = logging.getLogger("llmtower.engine.args")

# The EngineArgs fields that exist for vLLM command lines and LLM(...) calls only (the
# simulator, which has its own --tensor-parallel-size and --gpu-memory-utilization, skips them).
VLLM_ONLY_FIELDS = ("kv_cache_memory_bytes", "max_logprobs", "tensor_parallel_size",
                    "pipeline_parallel_size", "gpu_memory_utilization", "enforce_eager",
                    "trust_remote_code", "load_format", "tokenizer_mode", "revision",
                    "code_revision", "tokenizer_revision", "download_dir",
                    "override_generation_config")
# The weight formats this engine reads (vLLM's --load-format names).
LOAD_FORMATS = ("auto", "safetensors", "gguf")
# The tokenizer modes it has: 'auto' (vLLM's default; newer vLLM calls it 'hf').
TOKENIZER_MODES = ("auto", "hf")
# The most logprobs one token may carry (OpenAI's cap, SamplingParams' and vLLM's default
# --max-logprobs).
LOGPROBS_CAP = 20


def check_max_logprobs(sp: Any, max_logprobs: int) -> None:
    """ValueError (HTTP 400) for a request asking for more logprobs than --max-logprobs, in
    vLLM's words; the same check offline (LLM) and served."""
    for name, value in (("logprobs", sp.logprobs), ("prompt_logprobs", sp.prompt_logprobs)):
        if value is not None and value > max_logprobs:
            raise ValueError(f"requested {name}={value}, more than this server's max_logprobs "
                             f"of {max_logprobs} (--max-logprobs): ask for at most "
                             f"{max_logprobs}")

_HUB = ("llmtower loads models from local disk only and never downloads: fetch it first "
        "(e.g. `huggingface-cli download MODEL --revision REV --local-dir DIR`) and pass DIR "
        "as the model")


def check_vllm_settings(args: EngineArgs) -> None:
    """ValueError for a vLLM setting this engine cannot honour, naming what to use instead."""
    if args.tensor_parallel_size != 1:
        raise ValueError(
            f"tensor_parallel_size={args.tensor_parallel_size} (-tp) is not supported: this CPU "
            "engine runs the whole model in one process, with --num-threads threads; to run "
            "several model copies use --data-parallel-size N (-dp N)")
    if args.pipeline_parallel_size != 1:
        raise ValueError(
            f"pipeline_parallel_size={args.pipeline_parallel_size} (-pp) is not supported: this "
            "CPU engine runs every layer in one process; to run several model copies use "
            "--data-parallel-size N (-dp N)")
    if args.gpu_memory_utilization is not None:
        raise ValueError(
            f"gpu_memory_utilization={args.gpu_memory_utilization} does not apply: there is no "
            "GPU, and host memory is shared with everything else on the machine; size the KV "
            "cache with --kv-cache-memory (e.g. 4GiB; vLLM's --kv-cache-memory-bytes works too) "
            "or --num-gpu-blocks")
    for name in ("revision", "code_revision", "tokenizer_revision", "download_dir"):
        value = getattr(args, name)
        if value is not None:
            raise ValueError(f"{name}={value!r} (--{name.replace('_', '-')}) picks what to "
                             f"download from the Hugging Face hub; {_HUB}")
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(
            f"load_format={args.load_format!r} is not supported: llmtower reads 'safetensors' "
            "(a Hugging Face directory) and 'gguf' (a .gguf file); 'auto' (the default) picks "
            "the one the model is. Convert other checkpoints to safetensors first")
    is_gguf = str(args.model).lower().endswith(".gguf")
    if args.load_format == "gguf" and not is_gguf:
        raise ValueError(f"load_format='gguf' needs a .gguf file as the model, not "
                         f"{args.model!r}: pass the .gguf file, or --load-format auto")
    if args.load_format == "safetensors" and is_gguf:
        raise ValueError(f"load_format='safetensors' but the model {args.model!r} is a .gguf "
                         "file: use --load-format gguf or auto")
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(
            f"tokenizer_mode={args.tokenizer_mode!r} is not supported: llmtower always uses "
            "the model's own Hugging Face tokenizer (tokenizer.json where it has one); use "
            "--tokenizer-mode auto or leave it out")
    if not (isinstance(args.max_logprobs, int) and 0 <= args.max_logprobs <= LOGPROBS_CAP):
        extra = " (vLLM's 'the whole vocabulary')" if args.max_logprobs == -1 else ""
        raise ValueError(
            f"max_logprobs={args.max_logprobs!r}{extra} is invalid: this engine returns at most "
            f"{LOGPROBS_CAP} logprobs per token; use 0..{LOGPROBS_CAP}")


def ignored_vllm_settings(args: EngineArgs) -> list[str]:
    """One line per vLLM setting that was given but changes nothing on this engine."""
    lines = []
    if args.enforce_eager:
        lines.append("--enforce-eager changes nothing here: this CPU engine always runs the "
                     "model eagerly (there are no CUDA graphs and no torch.compile to turn off)")
    if args.trust_remote_code:
        lines.append("--trust-remote-code changes nothing here: llmtower runs only its own "
                     "model code (the Llama family) and its tokenizers' files, never Python code "
                     "from a model directory; a model that needs such code is refused when it "
                     "loads")
    return lines


def log_ignored_vllm_settings(args: EngineArgs) -> None:
    """Warn once, at start, for each setting ``ignored_vllm_settings`` finds."""
    for line in ignored_vllm_settings(args):
        logger.warning("%s", line)
