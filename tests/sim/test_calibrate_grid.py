"""The calibration grid drives an engine through the intended batch shapes, and the CLI writes
a loadable profile (with a model-free engine standing in for the CPU executor)."""
from __future__ import annotations

import json

import pytest

from llmtower.cli.main import main
from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.core import EngineCore
from llmtower.executor.fake_executor import FakeExecutor
from llmtower.sim.calibrate import TimedExecutor, measure_grid
from llmtower.sim.profiles import load_device


def fake_engine(*_args, **_kw) -> EngineCore:
    cache = CacheConfig(block_size=16, num_blocks=512, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024), cache)
    return EngineCore(sched, FakeExecutor(512, 16, vocab_size=256, verify_kv=False))


def test_the_grid_measures_decode_and_mixed_steps_of_each_cell():
    engine = fake_engine()
    engine.executor = TimedExecutor(engine.executor)
    samples = measure_grid(engine, contexts=(32, 200), decode_batches=(2, 8), prefills=(16, 100),
                           steps_per_sample=3)
    shapes = {(s.num_tokens, s.num_seqs) for s in samples}
    for d in (2, 8):
        assert (d, d) in shapes  # pure decode: one token per request
        assert (d + 16, d + 1) in shapes and (d + 100, d + 1) in shapes  # mixed steps
    assert (64, 2) in shapes and (400, 2) in shapes  # prefill steps of the cells
    decode_200_8 = [s for s in samples if (s.num_tokens, s.num_seqs) == (8, 8)
                    and s.kv_tokens > 8 * 200]
    assert decode_200_8 and all(s.seconds > 0 for s in samples)
    assert not engine.has_unfinished_requests()


def test_cells_over_the_prefill_limit_are_skipped():
    engine = fake_engine()
    engine.executor = TimedExecutor(engine.executor)
    samples = measure_grid(engine, contexts=(200,), decode_batches=(2, 8), prefills=(16,),
                           steps_per_sample=1, max_prefill_tokens=1000)
    assert {s.num_seqs for s in samples} <= {2, 3}


def test_calibrate_cli_writes_a_device_profile(tmp_path, monkeypatch, capsys):
    import llmtower.engine.factory as factory
    monkeypatch.setattr(factory, "create_engine_core", fake_engine)
    out, raw = tmp_path / "cpu.json", tmp_path / "samples.json"
    assert main(["simulate", "calibrate", "--model", "fake", "--model-profile", "w1",
                 "--contexts", "32,128", "--decode-batches", "1,4,16", "--prefills", "16,64",
                 "--repeats", "1", "--output", str(out), "--save-samples", str(raw)]) == 0
    assert "effective compute" in capsys.readouterr().out
    prof = load_device(str(out))
    assert prof.name == "cpu" and prof.calibration["model"] == "w1" and "w1" in prof.source
    assert len(json.loads(raw.read_text())) == prof.calibration["points"]


def test_calibrate_needs_to_know_the_model_shapes(capsys):
    assert main(["simulate", "calibrate", "--model", "/nonexistent/model"]) == 2
    assert "--model-profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "calibrate", "--contexts"])
