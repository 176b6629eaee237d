"""Shared helpers for the benchmark scripts in bench/: timing, tables, the script's surroundings.

The measuring helpers (fsync, page cache, peak RSS, medians) live in :mod:`cryosnap.bench`,
which ``cryosnap bench`` runs; they are re-exported here for the scripts that are not (yet) part
of it. cryosnap is taken from the interpreter, or else from the checkout's ``src/``.
"""

from __future__ import annotations

import gc
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType


def import_cryosnap() -> ModuleType:
    """cryosnap, from the interpreter or else from the checkout's src/."""
    try:
        import cryosnap
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
        import cryosnap
    return cryosnap


import_cryosnap()

from cryosnap.bench import (  # noqa: E402  (after the src/ fallback above)
    current_rss_bytes,
    fsync_path,
    iter_files,
    median,
    peak_rss_bytes,
    reset_peak_rss,
    settle_disk,
    tree_bytes,
    warm_page_cache,
)

__all__ = [
    "Check",
    "current_rss_bytes",
    "format_bytes",
    "format_table",
    "fsync_path",
    "import_cryosnap",
    "iter_files",
    "median",
    "peak_rss_bytes",
    "reset_peak_rss",
    "rmtree",
    "settle_disk",
    "timed",
    "tree_bytes",
    "warm_page_cache",
    "warn_if_busy",
]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """Call ``fn`` once and return (seconds, its result).

    Garbage is collected before the clock starts so that one peer does not pay for the garbage
    another one left behind.
    """
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


# ---------------------------------------------------------------------------------- formatting


def format_bytes(n: float) -> str:
    """Bytes in binary units, e.g. ``1.00 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i])
            for i, cell in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


# -------------------------------------------------------------------- the script's surroundings


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def warn_if_busy(*load_averages: float) -> None:
    cpus = os.cpu_count() or 1
    busiest = max(load_averages)
    if busiest > cpus:
        print(
            f"warning: the machine was busy (load average up to {busiest:.1f} on {cpus} CPUs): "
            "these figures carry other programs' load; compare quiet runs only"
        )


@dataclass(slots=True)
class Check:
    """One target of a benchmark: passed (True / False) or skipped (None)."""

    name: str
    passed: bool | None
    detail: str

    def line(self) -> str:
        verdict = {True: "PASS", False: "FAIL", None: "SKIP"}[self.passed]
        return f"[{verdict}] {self.name}: {self.detail}"


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The environment torchrun gives rank ``rank`` of ``world`` (gloo on 127.0.0.1, one
    OpenMP thread per rank: the ranks share this machine's cores)."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
