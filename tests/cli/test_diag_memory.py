"""`llmtower diag memory` offline: the report and the pictures of a snapshot taken from a real
scheduler (the live-server path is in test_operator_tools_live.py)."""
from __future__ import annotations

import msgspec
import pytest
from PIL import Image

from llmtower.cli.diag import format_runs, png_path
from llmtower.cli.kv_picture import (
    CPU_COLOURS,
    DEVICE_COLOURS,
    USED_SHADES,
    cpu_grid_layout,
    grid_layout,
    render_png,
    render_terminal,
)
from llmtower.cli.main import main
from llmtower.core.kv_cache.snapshot import take_kv_cache_snapshot
from tests.core.sched_helpers import make_engine, make_request, run_to_completion


@pytest.fixture
def snapshot():
    """A 24-block cache holding a finished request's cached block, two requests sharing a
    prefix, and a swapped-out request."""
    engine = make_engine(block_size=4, num_blocks=24, num_cpu_blocks=16,
                         preemption_mode="swap")
    sched = engine.scheduler
    sched.add_request(make_request("old", [40, 41, 42, 43, 44], max_tokens=2))
    run_to_completion(engine)
    prefix = list(range(1, 9))
    sched.add_request(make_request("a", prefix + [20], max_tokens=60, ignore_eos=True))
    engine.step()
    sched.add_request(make_request("b", prefix + [21], max_tokens=60, ignore_eos=True))
    sched.add_request(make_request("c", list(range(50, 60)), max_tokens=60, ignore_eos=True))
    for _ in range(300):
        engine.step()
        if sched.swapped:
            break
    assert sched.swapped
    return take_kv_cache_snapshot(sched)


def test_the_png_has_one_cell_per_block_coloured_by_state(snapshot, tmp_path):
    out = tmp_path / "kv.png"
    layout = render_png(snapshot, out)
    img = Image.open(out).convert("RGB")
    assert layout == grid_layout(snapshot.num_blocks)
    assert layout.cols * layout.rows >= snapshot.num_blocks > layout.cols * (layout.rows - 1)
    assert img.width >= layout.cols * layout.cell_px
    assert img.height > layout.top_px + layout.height_px  # the CPU strip lies below
    seen = set()
    for b, state in enumerate(snapshot.block_states):
        x0, y0, x1, y1 = layout.cell_box(b)
        colours = USED_SHADES if state == "u" else (DEVICE_COLOURS[state],)
        assert img.getpixel(((x0 + x1) // 2, (y0 + y1) // 2)) in colours, b
        seen.add(state)
    assert {"u", "s", "c"} <= seen  # in use, shared (the common prefix), cached
    # Each running request's own blocks get their own shade: a and b are told apart.
    shade = {}
    for r in snapshot.requests:
        own = [b for s, n in r.block_runs for b in range(s, s + n)
               if snapshot.block_states[b] == "u"]
        if own:
            x0, y0, x1, y1 = layout.cell_box(own[0])
            shade[r.request_id] = img.getpixel(((x0 + x1) // 2, (y0 + y1) // 2))
    assert len(shade) >= 2 and len(set(shade.values())) == len(shade)
    cpu = cpu_grid_layout(snapshot, layout)
    for b, state in enumerate(snapshot.cpu_block_states):
        x0, y0, x1, y1 = cpu.cell_box(b)
        assert img.getpixel(((x0 + x1) // 2, (y0 + y1) // 2)) == CPU_COLOURS[state]
    assert "w" in snapshot.cpu_block_states
    # Requests are outlined: the left edge of a request's first cell is dark.
    first = snapshot.requests[0].block_runs[0][0]
    x0, y0, _, y1 = layout.cell_box(first)
    assert img.getpixel((x0, (y0 + y1) // 2)) == (20, 20, 20)


def test_a_100k_block_cache_still_gets_one_cell_per_block():
    layout = grid_layout(100_000)
    assert layout.cols * layout.rows >= 100_000 and layout.cell_px >= 1
    assert layout.cols * layout.cell_px <= 1200  # a picture a screen shows whole


def test_the_terminal_rendering_is_compact_and_coloured(snapshot):
    text = render_terminal(snapshot, width=10, max_rows=2)
    lines = text.plain.splitlines()
    assert all(len(line) == 10 for line in lines[:-2])  # full rows of blocks
    assert "1 character = 2 blocks" in text.plain  # 24 blocks in at most 20 characters
    assert {span.style for span in text.spans} >= {"blue", "dark_orange"}


def test_the_command_reads_a_saved_snapshot_and_draws_it(snapshot, tmp_path, capsys):
    saved = tmp_path / "snap.json"
    saved.write_bytes(msgspec.json.encode({"engines": [snapshot]}))
    png = tmp_path / "out.png"
    assert main(["diag", "memory", "--input", str(saved), "--visualize",
                 "--output", str(png)]) == 0
    out = capsys.readouterr().out
    assert "largest free run" in out and "internal fragmentation" in out
    assert "swapped" in out and "prefix cache" in out
    assert png.is_file() and Image.open(png).format == "PNG"
    assert main(["diag", "memory", "--input", str(saved), "--json"]) == 0
    assert msgspec.json.decode(capsys.readouterr().out)["engines"][0]["num_blocks"] == 24


def test_bad_input_and_an_unreachable_server_fail_with_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"engines": 3}')
    assert main(["diag", "memory", "--input", str(bad)]) == 1
    assert "not a KV-cache snapshot" in capsys.readouterr().err
    assert main(["diag", "memory", "--url", "http://127.0.0.1:9", "--timeout", "2"]) == 1
    assert "cannot reach the server" in capsys.readouterr().err


def test_helpers_name_files_per_engine_and_shorten_block_tables():
    assert str(png_path("kv.png", 1, 2)) == "kv.engine1.png"
    assert str(png_path("kv.png", 0, 1)) == "kv.png"
    assert format_runs([(12, 8), (40, 1)]) == "12-19,40"
    assert format_runs([(i * 2, 1) for i in range(100)], max_chars=10).endswith("…")
