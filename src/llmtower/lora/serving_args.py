"""The LoRA settings (--enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras,
--lora-modules, runtime updating): checked at start, with a message saying what to change."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoRAModulePath:
    """One --lora-modules entry: the name clients send as ``model``, the adapter's folder and
    the base model it was trained for (None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> list[LoRAModulePath]:
    """``name=path`` or vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``
    per entry; ValueError naming the bad entry."""
    out: list[LoRAModulePath] = []
    for v in values or []:
        text = v.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {v!r} is not valid JSON: {e}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) \
                    or not isinstance(obj.get("path"), str):
                raise ValueError(f"--lora-modules {v!r}: the JSON form needs string fields "
                                 "'name' and 'path' (and optionally 'base_model_name')")
            out.append(LoRAModulePath(obj["name"], obj["path"], obj.get("base_model_name")))
            continue
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {v!r} is invalid: write name=path (e.g. "
                             "sql-lora=/adapters/sql) or the JSON form")
        out.append(LoRAModulePath(name, path))
    names = [m.name for m in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules names {dup} more than once: give each adapter its "
                         "own name")
    return out


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


def check_lora_args(args: Any) -> None:
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora: add --enable-lora")
        return
    if args.max_cpu_loras and args.max_cpu_loras < args.max_loras:
        raise ValueError(f"max_cpu_loras={args.max_cpu_loras} is below max_loras="
                         f"{args.max_loras}: a step's adapters must all be in memory; raise "
                         "--max-cpu-loras or lower --max-loras")
    if args.speculative_config is not None:
        raise ValueError("--enable-lora with --speculative-config is not supported: the drafts "
                         "would not see the adapters; drop one of them")
    parse_lora_modules(args.lora_modules)


def max_cpu_loras(args: Any) -> int:
    return args.max_cpu_loras or args.max_loras
