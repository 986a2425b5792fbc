"""Figures of one or more simulation results (matplotlib, Agg backend: no display needed):
TTFT and E2E latency CDFs, and the cluster's queue depth and KV-cache usage over time."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from llmtower.sim.report import SimResult


_STYLES = ["-", "--", ":", "-."]


def _cdf(ax, values_s: np.ndarray, label: str, color, style: str = "-") -> None:
    if len(values_s) == 0:
        return
    x = np.sort(values_s) * 1000.0
    y = np.arange(1, len(x) + 1) / len(x)
    ax.plot(x, y, label=label, drawstyle="steps-post", color=color, linestyle=style)


def plot_results(results: list[tuple[str, SimResult]], path: str | os.PathLike,
                 by_priority: bool = True) -> Path:
    """One 2x2 figure: TTFT CDF (per priority class too, when there are several), E2E CDF,
    waiting requests and mean KV usage over time, one line per result."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    ax_ttft, ax_e2e, ax_queue, ax_kv = axes.flat
    for i, (label, res) in enumerate(results):
        color = f"C{i % 10}"  # one color per result; one line style per priority class
        req = res.requests
        prios = np.unique(req["priority"])
        if by_priority and len(prios) > 1:
            for j, p in enumerate(prios):
                _cdf(ax_ttft, req["ttft"][req["priority"] == p], f"{label}, priority {p}",
                     color, _STYLES[j % len(_STYLES)])
        else:
            _cdf(ax_ttft, req["ttft"], label, color)
        _cdf(ax_e2e, req["e2e"], label, color)
        tl = res.timeline
        ax_queue.plot(tl["t"], tl["waiting"], label=label, color=color)
        ax_kv.plot(tl["t"], 100 * tl["kv_usage"], label=label, color=color)
    ax_ttft.set(title="Time to first token", xlabel="ms", ylabel="fraction of requests",
                xscale="log")
    ax_e2e.set(title="End-to-end latency", xlabel="ms", ylabel="fraction of requests",
               xscale="log")
    ax_queue.set(title="Waiting requests (all replicas)", xlabel="simulated time (s)",
                 ylabel="requests")
    ax_kv.set(title="KV-cache usage (mean over replicas)", xlabel="simulated time (s)",
              ylabel="% of blocks", ylim=(0, 105))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    first = results[0][1].config
    tp = first["tensor_parallel_size"]
    fig.suptitle(f"{first['model']} on {first['num_replicas']} x {first['device']}"
                 f"{f' (TP {tp})' if tp > 1 else ''}, {first['num_requests']} requests")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
