"""`llmtower diag memory`: what the KV cache of a running server holds right now.

It reads ``GET /v1/admin/kv_cache`` (or a saved answer, ``--input``; offline, the same
snapshot comes from ``LLM.kv_cache_snapshot()``) and prints, per engine: blocks by state, the
largest free run, internal and external fragmentation, the prefix cache, and each request's
block table; ``--visualize`` adds the block map in the terminal and as a PNG (``--output``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from llmtower.cli.admin_http import DEFAULT_URL, AdminError, get
from llmtower.core.kv_cache.snapshot import KVCacheSnapshot


class DiagError(Exception):
    """A failure to report in one line (server down, bad answer, bad flag)."""


class _Snapshots(msgspec.Struct):
    engines: list[KVCacheSnapshot]


def register(sub) -> None:
    p = sub.add_parser("diag", help="diagnostics of a running server: memory (the KV cache)")
    dsub = p.add_subparsers(dest="diag_command", required=True)
    m = dsub.add_parser(
        "memory", help="what the KV cache holds: block states, block tables, fragmentation",
        description="Show what the KV cache of a running server holds right now: every "
        "block's state, each request's block table, the largest free run, internal and "
        "external fragmentation and the prefix cache, per engine.")
    m.add_argument("--url", default=DEFAULT_URL, help=f"server address (default: {DEFAULT_URL})")
    m.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    m.add_argument("--engine-id", default="all",
                   help="'all' (default) or the index of one data-parallel engine")
    m.add_argument("--visualize", action="store_true",
                   help="draw the block map: in the terminal and as a PNG (--output)")
    m.add_argument("--output", default="kv.png",
                   help="PNG path for --visualize; with several engines ENGINE is inserted "
                   "before the suffix, e.g. kv.engine1.png (default: kv.png)")
    m.add_argument("--json", action="store_true",
                   help="print the raw snapshot as JSON instead of the report")
    m.add_argument("--input", default=None,
                   help="read a snapshot saved with --json instead of asking a server")
    m.add_argument("--max-requests", type=int, default=20,
                   help="block tables listed per engine, the largest first (default: 20)")
    m.add_argument("--timeout", type=float, default=15.0,
                   help="seconds to wait for the server (default: 15)")
    m.set_defaults(handler=run_memory)


def fetch_snapshots(url: str, api_key: str | None, engine_id: str,
                    timeout_s: float = 15.0) -> list[KVCacheSnapshot]:
    try:
        data = get(url, "kv_cache", api_key, timeout_s, {"engine_id": engine_id})
    except AdminError as e:
        raise DiagError(str(e)) from None
    return decode_snapshots(data)


def decode_snapshots(data: bytes) -> list[KVCacheSnapshot]:
    try:
        return msgspec.json.decode(data, type=_Snapshots).engines
    except msgspec.DecodeError as e:
        raise DiagError(f"not a KV-cache snapshot ({e}); --input takes what --json printed") \
            from None


def run_memory(args: argparse.Namespace) -> int:
    console = Console(highlight=False)
    try:
        if args.input:
            path = Path(args.input)
            if not path.is_file():
                raise DiagError(f"--input {path}: no such file")
            snapshots = decode_snapshots(path.read_bytes())
            if args.engine_id != "all":
                snapshots = [s for s in snapshots if str(s.engine_index) == args.engine_id]
        else:
            snapshots = fetch_snapshots(args.url, args.api_key, args.engine_id, args.timeout)
    except DiagError as e:
        print(f"llmtower diag memory: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(msgspec.json.encode({"engines": snapshots}).decode() + "\n")
        return 0
    for snap in snapshots:
        print_report(console, snap, args.max_requests)
        if args.visualize:
            from llmtower.cli.kv_picture import render_png, render_terminal
            console.print(render_terminal(snap, width=min(100, console.width - 2)))
            out = png_path(args.output, snap.engine_index, len(snapshots))
            layout = render_png(snap, out)
            console.print(f"wrote {out} ({layout.cols} x {layout.rows} cells of "
                          f"{layout.cell_px} px, one per block)")
    return 0


def png_path(output: str, engine_index: int, num_snapshots: int) -> Path:
    path = Path(output)
    if num_snapshots == 1:
        return path
    return path.with_name(f"{path.stem}.engine{engine_index}{path.suffix or '.png'}")


def format_runs(runs: list[tuple[int, int]], max_chars: int = 60) -> str:
    """``[(12, 8), (40, 1)]`` -> ``12-19,40``, cut at ``max_chars``."""
    parts = [str(s) if n == 1 else f"{s}-{s + n - 1}" for s, n in runs]
    text = ",".join(parts)
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"


def print_report(console: Console, snap: KVCacheSnapshot, max_requests: int = 20) -> None:
    n = snap.num_blocks or 1
    frag, pc = snap.fragmentation, snap.prefix_cache
    console.rule(f"engine {snap.engine_index}: {snap.num_blocks} blocks of {snap.block_size} "
                 "tokens")
    counts = snap.counts()
    console.print("blocks: " + " | ".join(f"{k} {v} ({v / n:.1%})" for k, v in counts.items())
                  + (f"; max ref count {max(snap.shared_ref_counts.values())}"
                     if snap.shared_ref_counts else ""))
    if snap.num_cpu_blocks:
        swapped = sum(1 for r in snap.requests if r.status == "swapped")
        console.print(f"CPU swap space: {snap.cpu_block_states.count('w')} of "
                      f"{snap.num_cpu_blocks} blocks hold {swapped} swapped request(s)")
    console.print(f"largest free run: {frag.largest_free_run} blocks; free runs: "
                  f"{frag.num_free_runs} (mean {frag.mean_free_run:.1f}); external "
                  f"fragmentation {frag.external:.1%}")
    console.print(f"internal fragmentation: {frag.internal:.1%} ({frag.unused_slots} unused "
                  f"slots of {frag.allocated_slots} allocated); block tables: mean run "
                  f"{frag.mean_block_table_run:.1f} blocks")
    console.print(f"prefix cache: {pc.num_cached_blocks} blocks ({pc.num_cached_blocks_in_use} "
                  f"in use, {pc.num_cached_blocks_free} free), hit rate {pc.hit_rate:.1%} "
                  f"({pc.hits} of {pc.queries} prompt tokens), {pc.evictions} evictions")
    console.print(f"requests: {len(snap.requests)} holding blocks, {snap.num_waiting} waiting; "
                  f"snapshot took {snap.build_seconds * 1e3:.2f} ms in the engine")
    if not snap.requests or max_requests <= 0:
        return
    table = Table("request", "status", "tokens", "computed", "blocks", "runs", "unused slots",
                  "block table", box=None, header_style="bold")
    largest = sorted(snap.requests, key=lambda r: (-r.num_blocks, r.request_id))
    for r in largest[:max_requests]:
        table.add_row(r.request_id, r.status, str(r.num_tokens), str(r.num_computed_tokens),
                      str(r.num_blocks or f"{r.num_cpu_blocks} (CPU)"), str(len(r.block_runs)),
                      str(r.unused_slots), format_runs(r.block_runs))
    console.print(table)
    if len(snap.requests) > max_requests:
        console.print(f"... and {len(snap.requests) - max_requests} more (--max-requests)")

