"""The import graph of src/llmtower points down the layers only.

A newcomer should be able to read the tree bottom-up: every module may import modules of its own
layer or of a lower one, never of a higher one. The order (bottom -> top):

    utils < kernels < lora < models < structured_output
      < core (core/*.py < core/kv_cache < core/sched) < spec_decode < executor < metrics
      < distributed < engine < bench < sim < server < cli

``llmtower/__init__.py`` (the package's front door) may import anything, and anything may import
the bare package ``llmtower`` (for ``__version__``). Every import statement counts, wherever it
stands (module top, inside a function, under ``TYPE_CHECKING``): a lazy import is still an arrow.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "llmtower"

# Bottom -> top; a subpackage named here ranks on its own, otherwise a module ranks with its
# top-level package. core's three tiers: its plain modules, then the KV cache, then the scheduler.
LAYERS: list[str] = [
    "utils", "kernels", "lora", "models", "structured_output",
    "core", "core.kv_cache", "core.sched",
    "spec_decode", "executor", "metrics", "distributed", "engine", "bench", "sim", "server", "cli",
]
RANK = {name: i for i, name in enumerate(LAYERS)}


def layer_of(module: str) -> str | None:
    """The layer of a dotted module name under llmtower (``None``: the package root)."""
    parts = module.split(".")
    assert parts[0] == "llmtower", module
    rest = parts[1:]
    if not rest:
        return None
    if len(rest) >= 2 and ".".join(rest[:2]) in RANK:
        return ".".join(rest[:2])
    if rest[0] not in RANK:
        raise AssertionError(f"llmtower.{rest[0]} is in no layer: add it to LAYERS in "
                             f"{Path(__file__).name} (and to docs/architecture.md)")
    return rest[0]


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.AST, this_module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted llmtower module) for every import in a module, relative ones resolved."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name == "llmtower" or a.name.startswith("llmtower.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = this_module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "llmtower":
                # `from llmtower import x`: x may be a subpackage, which is what is imported.
                found += [(node.lineno, f"llmtower.{a.name}") for a in node.names
                          if a.name in RANK]
                found += [(node.lineno, "llmtower") for a in node.names if a.name not in RANK]
            elif target.startswith("llmtower."):
                found.append((node.lineno, target))
    return found


def upward_imports() -> list[str]:
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        if path == SRC / "__init__.py":
            continue
        this = module_name(path)
        here = layer_of(this)
        assert here is not None
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, target in imported_modules(tree, this, path.name == "__init__.py"):
            there = layer_of(target)
            if there is not None and RANK[there] > RANK[here]:
                problems.append(f"src/{path.relative_to(SRC.parent)}:{line}: {here} imports "
                                f"{target} ({there} is above {here})")
    return problems


def test_imports_point_down_the_layers() -> None:
    problems = upward_imports()
    assert not problems, (
        f"{len(problems)} import(s) point up the layers ({' < '.join(LAYERS)}):\n"
        + "\n".join(problems))


@pytest.mark.parametrize("module, layer", [
    ("llmtower.utils", "utils"),
    ("llmtower.core.outputs", "core"),
    ("llmtower.core.kv_cache.block_pool", "core.kv_cache"),
    ("llmtower.core.sched", "core.sched"),
    ("llmtower.server.tool_parsers.base", "server"),
    ("llmtower", None),
])
def test_layer_of(module: str, layer: str | None) -> None:
    assert layer_of(module) == layer


def test_scan_sees_relative_lazy_and_type_checking_imports() -> None:
    src = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from . import sibling\n"
        "from ..kv_cache import block_pool\n"
        "if TYPE_CHECKING:\n"
        "    from llmtower.server.protocol import X\n"
        "def f():\n"
        "    import llmtower.cli.main\n"
    )
    found = imported_modules(ast.parse(src), "llmtower.core.sched.scheduler", is_package=False)
    assert sorted(found) == [(3, "llmtower.core.sched"), (4, "llmtower.core.kv_cache"),
                             (6, "llmtower.server.protocol"), (8, "llmtower.cli.main")]


def test_every_package_has_a_layer() -> None:
    for path in SRC.iterdir():
        name = path.stem if path.suffix == ".py" else path.name
        if name.startswith("__") or path.name == "py.typed" or not (
                path.suffix == ".py" or (path / "__init__.py").exists()):
            continue
        assert name in RANK, f"llmtower.{name} is in no layer of {Path(__file__).name}"
