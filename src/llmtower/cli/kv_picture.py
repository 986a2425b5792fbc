"""Pictures of a KV-cache snapshot: a PNG with one cell per block coloured by its state (the
blocks of each request outlined when cells are large enough), and a compact coloured rendering
for the terminal.

  PNG layout (top to bottom): a header (engine, counts, legend), the device blocks row-major
  (block 0 top left), then the CPU swap blocks when there are any.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rich.text import Text

from llmtower.core.kv_cache.snapshot import (
    CACHED,
    CPU_FREE,
    CPU_SWAPPED,
    FREE,
    SHARED,
    USED,
    KVCacheSnapshot,
)

# RGB per state character; CPU states are drawn in the swap strip.
DEVICE_COLOURS: dict[str, tuple[int, int, int]] = {
    FREE: (232, 232, 232), CACHED: (161, 217, 155), USED: (49, 130, 189), SHARED: (230, 85, 13)}
# Blocks in use take one of these blues per request (cycling), so that interleaved block
# tables, the external fragmentation of the tables, show as a mosaic rather than one blue.
USED_SHADES: tuple[tuple[int, int, int], ...] = (
    (49, 130, 189), (107, 174, 214), (8, 81, 156), (66, 146, 198), (33, 113, 181),
    (158, 202, 225))
CPU_COLOURS: dict[str, tuple[int, int, int]] = {
    CPU_FREE: (242, 240, 247), CPU_SWAPPED: (117, 107, 177)}
STATE_NAMES = {FREE: "free", CACHED: "free, cached prefix", USED: "in use",
               SHARED: "shared (ref > 1)"}
BACKGROUND = (255, 255, 255)
OUTLINE = (20, 20, 20)
TARGET_WIDTH_PX = 1200
MAX_CELL_PX = 24
MIN_OUTLINE_CELL_PX = 6  # below this an outline would hide the cell's colour
HEADER_PX = 44
MIN_WIDTH_PX = 760


@dataclass(frozen=True)
class GridLayout:
    """Where each block's cell lies in the PNG."""

    num_blocks: int
    cols: int
    cell_px: int
    top_px: int

    @property
    def rows(self) -> int:
        return -(-self.num_blocks // self.cols)

    @property
    def height_px(self) -> int:
        return self.rows * self.cell_px

    def cell_box(self, block_id: int) -> tuple[int, int, int, int]:
        """(x0, y0, x1, y1) of the block's cell, x1/y1 exclusive."""
        r, c = divmod(block_id, self.cols)
        x0, y0 = c * self.cell_px, self.top_px + r * self.cell_px
        return x0, y0, x0 + self.cell_px, y0 + self.cell_px


def grid_layout(num_blocks: int, top_px: int = HEADER_PX) -> GridLayout:
    """About twice as wide as tall, cells as large as fit ``TARGET_WIDTH_PX`` (at least 1 px)."""
    cols = max(1, min(num_blocks, math.ceil(math.sqrt(2 * max(1, num_blocks)))))
    cell = max(1, min(MAX_CELL_PX, TARGET_WIDTH_PX // cols))
    return GridLayout(num_blocks, cols, cell, top_px)


def cpu_grid_layout(snap: KVCacheSnapshot, device: GridLayout) -> GridLayout | None:
    """The CPU swap strip, below the device grid (None without swap space)."""
    if not snap.num_cpu_blocks:
        return None
    return grid_layout(snap.num_cpu_blocks, top_px=device.top_px + device.height_px + 18)


def _outline_edges(layout: GridLayout, owner: dict[int, int]) -> list[tuple[int, int, int, int]]:
    """Line segments around each request's cells: an edge is drawn where the neighbour cell
    belongs to another request (or to none)."""
    lines = []
    cols = layout.cols
    for b, who in owner.items():
        x0, y0, x1, y1 = layout.cell_box(b)
        r, c = divmod(b, cols)
        if c == 0 or owner.get(b - 1) != who:
            lines.append((x0, y0, x0, y1 - 1))
        if c == cols - 1 or owner.get(b + 1) != who:
            lines.append((x1 - 1, y0, x1 - 1, y1 - 1))
        if r == 0 or owner.get(b - cols) != who:
            lines.append((x0, y0, x1 - 1, y0))
        if owner.get(b + cols) != who:
            lines.append((x0, y1 - 1, x1 - 1, y1 - 1))
    return lines


def render_png(snap: KVCacheSnapshot, path: str | Path) -> GridLayout:
    """Draw ``snap`` into a PNG at ``path``; returns the device grid's layout."""
    from PIL import Image, ImageDraw  # Pillow ships with matplotlib, a dependency

    layout = grid_layout(snap.num_blocks)
    cpu = cpu_grid_layout(snap, layout)
    width = max(layout.cols * layout.cell_px, MIN_WIDTH_PX)  # room for the header's legend
    height = (cpu.top_px + cpu.height_px if cpu else layout.top_px + layout.height_px) + 4
    img = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(img)
    gap = 1 if layout.cell_px >= MIN_OUTLINE_CELL_PX else 0
    owner: dict[int, int] = {}
    for i, req in enumerate(snap.requests):
        for start, n in req.block_runs:
            for b in range(start, start + n):
                owner.setdefault(b, i)  # a shared block belongs to its first holder
    for b, state in enumerate(snap.block_states):
        x0, y0, x1, y1 = layout.cell_box(b)
        colour = DEVICE_COLOURS[state]
        if state == USED and b in owner:
            colour = USED_SHADES[owner[b] % len(USED_SHADES)]
        draw.rectangle((x0, y0, x1 - 1 - gap, y1 - 1 - gap), fill=colour)
    if layout.cell_px >= MIN_OUTLINE_CELL_PX:
        for line in _outline_edges(layout, owner):
            draw.line(line, fill=OUTLINE)
    if cpu is not None:
        swapped = snap.cpu_block_states.count(CPU_SWAPPED)
        draw.rectangle((2, cpu.top_px - 13, 12, cpu.top_px - 3),
                       fill=CPU_COLOURS[CPU_SWAPPED], outline=OUTLINE)
        draw.text((16, cpu.top_px - 14), f"CPU swap space: {swapped} of {snap.num_cpu_blocks} "
                  "blocks hold swapped-out requests", fill=OUTLINE)
        for b, state in enumerate(snap.cpu_block_states):
            x0, y0, x1, y1 = cpu.cell_box(b)
            draw.rectangle((x0, y0, x1 - 1 - gap, y1 - 1 - gap), fill=CPU_COLOURS[state])
    _draw_header(draw, snap)
    img.save(path, format="PNG")
    return layout


def _draw_header(draw, snap: KVCacheSnapshot) -> None:
    frag = snap.fragmentation
    draw.text((2, 2), f"engine {snap.engine_index}: {snap.num_blocks} blocks of "
              f"{snap.block_size} tokens, {len(snap.requests)} requests; largest free run "
              f"{frag.largest_free_run}, fragmentation internal {frag.internal:.1%} / external "
              f"{frag.external:.1%}", fill=OUTLINE)
    x = 2
    counts = {FREE: snap.num_free, CACHED: snap.num_cached_free, USED: snap.num_used,
              SHARED: snap.num_shared}
    for state, name in STATE_NAMES.items():
        draw.rectangle((x, 20, x + 10, 30), fill=DEVICE_COLOURS[state], outline=OUTLINE)
        label = f"{name}{' (a blue per request)' if state == USED else ''}: {counts[state]}"
        draw.text((x + 14, 19), label, fill=OUTLINE)
        x += 14 + 6 * len(label) + 14


# ---------------------------------------------------------------------- terminal rendering
TERMINAL_STYLES = {FREE: "grey35", CACHED: "green", USED: "blue", SHARED: "dark_orange"}
# When one character stands for several blocks it takes the colour of the busiest of them.
_SEVERITY = {FREE: 0, CACHED: 1, USED: 2, SHARED: 3}


def render_terminal(snap: KVCacheSnapshot, width: int = 80, max_rows: int = 16) -> Text:
    """The block map in at most ``max_rows`` lines of ``width`` coloured characters."""
    width = max(8, width)
    states = snap.block_states
    per_char = max(1, -(-len(states) // (width * max_rows)))
    text = Text()
    for i in range(0, len(states), per_char):
        group = states[i:i + per_char]
        state = max(group, key=_SEVERITY.__getitem__)
        text.append("█", style=TERMINAL_STYLES[state])
        if (i // per_char + 1) % width == 0:
            text.append("\n")
    if not text.plain.endswith("\n"):
        text.append("\n")
    scale = "1 character = 1 block" if per_char == 1 else \
        f"1 character = {per_char} blocks (coloured by the busiest)"
    text.append(f"{scale}; ")
    for state, name in STATE_NAMES.items():
        text.append("█", style=TERMINAL_STYLES[state])
        text.append(f" {name}  ")
    return text
