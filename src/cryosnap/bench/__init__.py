"""``cryosnap bench``: cryosnap against its peers on the same state, beside the machine's limits.

:func:`run` measures what a :class:`BenchConfig` describes and returns a :class:`BenchResult`
(the method: :func:`run`'s docstring); the probes are shared with the scripts in ``bench/``.
Nothing here imports typer or rich; torch is imported lazily. Runs on the caller's thread.
"""

from cryosnap.bench._config import WORKLOADS, BenchConfig, BenchStep, parse_size, require_torch
from cryosnap.bench._plot import check_plot_available, plot
from cryosnap.bench._probes import (
    current_rss_bytes,
    drop_page_cache,
    fsync_path,
    iter_files,
    median,
    peak_rss_bytes,
    reset_peak_rss,
    settle_disk,
    tree_bytes,
    warm_page_cache,
)
from cryosnap.bench._rates import MachineRates, measure_rates
from cryosnap.bench._result import BenchResult
from cryosnap.bench._runner import run
from cryosnap.bench._scale import SCALE_RANKS, ScaleFigures, measure_scale, parse_ranks
from cryosnap.errors import BenchError, MissingDependencyError

__all__ = [
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "BenchStep",
    "MachineRates",
    "MissingDependencyError",
    "SCALE_RANKS",
    "ScaleFigures",
    "WORKLOADS",
    "check_plot_available",
    "current_rss_bytes",
    "drop_page_cache",
    "fsync_path",
    "iter_files",
    "measure_rates",
    "measure_scale",
    "median",
    "parse_ranks",
    "parse_size",
    "peak_rss_bytes",
    "plot",
    "require_torch",
    "reset_peak_rss",
    "run",
    "settle_disk",
    "tree_bytes",
    "warm_page_cache",
]
