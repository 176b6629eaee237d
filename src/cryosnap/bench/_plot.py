"""The bar chart of a :class:`BenchResult` (matplotlib, the ``demo`` extra; imported only here,
when a plot is asked for). Runs on the caller's thread.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from pathlib import Path
from typing import Any

from cryosnap.bench._config import TRAIN_EVERY
from cryosnap.bench._result import BenchResult
from cryosnap.errors import MissingDependencyError

# -------------------------------------------------------------------------------------- plot


def check_plot_available() -> None:
    """Raise :class:`MissingDependencyError` when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError("--plot needs matplotlib (pip install cryosnap[demo])")


def plot(result: BenchResult, out: str | Path) -> None:
    """A bar chart of ``result`` to ``out`` (any format matplotlib writes, by its extension)."""
    check_plot_available()
    from matplotlib.figure import Figure

    if result.config.workload == "training":
        fig = _plot_training(Figure(figsize=(8.0, 4.5), layout="constrained"), result)
    else:
        fig = _plot_save_load(Figure(figsize=(11.0, 5.5), layout="constrained"), result)
    fig.savefig(out)


def _plot_save_load(fig: Any, result: BenchResult) -> Any:
    panels = [
        ("stall_seconds", "stall (s)", "memcpy_seconds", "memcpy"),
        ("durable_seconds", "time to durable (s)", "write_fsync_seconds", "raw write+fsync"),
        ("restore_seconds", "restore (s), fresh load", "read_warm_seconds", "raw readinto"),
        ("restore_into_seconds", "restore into (s)", "read_warm_seconds", "raw readinto"),
    ]
    axes = fig.subplots(1, len(panels), sharey=True)
    peers = [p for p in result.peers if p.error is None and not p.limit]
    labels = [p.label for p in peers]
    positions = list(range(len(peers)))
    limits = result.limits
    for ax, (metric, title, limit_key, limit_label) in zip(axes, panels, strict=True):
        values = [p.median(metric) for p in peers]
        colors = ["tab:blue" if p.key.startswith("cryosnap") else "tab:gray" for p in peers]
        ax.barh(positions, [0 if math.isnan(v) else v for v in values], color=colors)
        limit = limits[limit_key]
        if not math.isnan(limit):
            ax.axvline(limit, ls="--", c="black", lw=1, label=f"limit: {limit_label}")
            ax.legend(loc="lower right", fontsize="small")
        ax.set_title(title, fontsize="medium")
        ax.set_yticks(positions, labels, fontsize="small")
        ax.invert_yaxis()
    fig.suptitle(f"cryosnap bench {result.config.workload} ({result.date})\n{result.title}")
    return fig


def _plot_training(fig: Any, result: BenchResult) -> Any:
    ax = fig.subplots()
    methods = [f for f in result.training if f.key != "none"]
    keys = list(dict.fromkeys(f.key for f in methods))
    width = 0.8 / max(1, len(TRAIN_EVERY))
    for j, every in enumerate(TRAIN_EVERY):
        values = []
        for key in keys:
            match = next((f for f in methods if f.key == key and f.every == every), None)
            overhead = float("nan") if match is None else result.overhead_percent(match)
            values.append(0.0 if math.isnan(overhead) else overhead)
        ax.bar([i + j * width for i in range(len(keys))], values, width, label=f"every {every}")
    labels = [next(f.label for f in methods if f.key == key) for key in keys]
    ax.set_xticks([i + width * (len(TRAIN_EVERY) - 1) / 2 for i in range(len(keys))], labels)
    ax.tick_params(axis="x", labelsize="small", labelrotation=15)
    ax.axhline(0, c="black", lw=0.8)
    ax.set_ylabel("training-step overhead vs no checkpoint (%)")
    ax.legend()
    ax.set_title(f"cryosnap bench training ({result.date})\n{result.title}", fontsize="medium")
    return fig
