"""Thread CPU time of the default model's decode steps with one torch thread: robust to a busy
machine where wall time is not (the A/B of issue 30's one kernel library ran at load 6-10 on two
cores). Random prompts of ``--input-len`` tokens, ``--output-len`` greedy tokens each, EOS
ignored; per batch size and round, the median CPU time of the decode steps (ms). Run two trees
in turn (``PYTHONPATH=<tree>/src:.``) to compare them.

    .venv/bin/python benchmarks/decode_step_cpu.py --dtype bfloat16 --batches 1,16
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from llmtower.models.default_model import default_model_dir
from tests.executor.exactness_helpers import add_greedy, make_engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="1,16", help="requests per run, comma-separated")
    p.add_argument("--input-len", type=int, default=144)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    core = make_engine(Path(default_model_dir()), dtype=a.dtype, num_threads=1, block_size=16,
                       max_model_len=512, num_gpu_blocks=2048)
    rng = random.Random(0)
    res: dict[int, list[float]] = {}
    for batch in (int(b) for b in a.batches.split(",")):
        for rnd in range(a.rounds):
            prompts = [[rng.randrange(100, 40000) for _ in range(a.input_len)]
                       for _ in range(batch)]
            add_greedy(core, prompts, a.output_len, first_id=1000 * batch + 100 * rnd)
            times, step = [], 0
            while core.scheduler.has_unfinished_requests():
                t0 = time.thread_time()
                core.step()
                dt = time.thread_time() - t0
                step += 1
                if step > 2:  # past the prefill
                    times.append(dt)
            res.setdefault(batch, []).append(round(statistics.median(times) * 1000, 2))
    print(a.dtype, "ms per decode step (thread CPU time) by batch:", res)


if __name__ == "__main__":
    main()
