"""Shared helpers for the benchmark scripts in bench/: timing, tables, the script's surroundings.

The measuring helpers (fsync, page cache, peak RSS, medians, the machine) live in
:mod:`cryosnap.bench`, which ``cryosnap bench`` runs; they are re-exported here for the scripts
that are not part of it. Here: a timed call, bytes and tables as text, PASS / FAIL lines, the
run's scratch folder, the load average, the environment line and JSON of a run, and the
environment of a rank launched as torchrun would. cryosnap is taken from the interpreter, or
else from the checkout's ``src/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any


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
from cryosnap.bench._probes import machine_info  # noqa: E402

__all__ = [
    "Check",
    "command_line",
    "current_rss_bytes",
    "environment",
    "framework_main",
    "format_bytes",
    "format_ms",
    "format_s",
    "format_table",
    "free_port",
    "fsync_path",
    "import_cryosnap",
    "iter_files",
    "load_average",
    "median",
    "peak_rss_bytes",
    "print_load",
    "reset_peak_rss",
    "rmtree",
    "scratch_dir",
    "settle_disk",
    "timed",
    "torchrun_env",
    "tree_bytes",
    "warm_page_cache",
    "warn_if_busy",
    "write_json",
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


def format_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def format_s(seconds: float) -> str:
    return f"{seconds:.3f} s"


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], left: Collection[int] = (0,)
) -> str:
    """A plain-text table: the columns numbered in ``left`` (the first one; a negative number
    counts from the end) left-aligned, the others right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lefts = {i % len(widths) for i in left} if widths else set()

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(widths[i]) if i in lefts else cell.rjust(widths[i])
            for i, cell in enumerate(cells)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


# -------------------------------------------------------------------- the script's surroundings


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def scratch_dir(prefix: str, base: str | Path | None = None) -> Iterator[Path]:
    """A fresh folder inside ``base`` (made if missing; default: the temp dir), removed with
    everything in it at the end, on an error or Ctrl-C too. ``base`` itself is never removed."""
    if base is not None:
        Path(base).mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield path
    finally:
        rmtree(path)


def command_line() -> str:
    return " ".join([sys.executable, *sys.argv])


def load_average() -> float:
    """The 1-minute load average now."""
    return os.getloadavg()[0]


def print_load(before: float, after: float | None = None) -> None:
    """The load average before and after (now, unless given), and a warning when it was high."""
    after = load_average() if after is None else after
    print(f"load average (1 min): {before:.2f} before, {after:.2f} after")
    warn_if_busy(before, after)


def _checkout_head() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        return done.stdout.strip() or None
    return None


def environment(**extra: Any) -> dict[str, Any]:
    """When, how and on what a script ran: the date (UTC), the command, the load average, the
    machine and the packages (``cryosnap bench``'s ``machine_info``: the cryosnap used, which
    may be a copy, and where it lies), and this checkout's commit; ``extra`` added."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "load_average": round(load_average(), 2),
        **machine_info(),
        "checkout_head": _checkout_head(),
        **extra,
    }


def write_json(path: Path | None, document: object) -> None:
    """``document`` as indented JSON into ``path`` (nothing when None)."""
    if path is not None:
        path.write_text(json.dumps(document, indent=2, default=str) + "\n")


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
        return f"[{verdict}] {self.name}" + (f": {self.detail}" if self.detail else "")


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


Ranks = list[dict[str, Any]]


def framework_main(
    args: argparse.Namespace,
    name: str,
    *,
    worker: Callable[[argparse.Namespace], None],
    launch: Callable[[argparse.Namespace, Path], Ranks],
    report: Callable[[Ranks], dict[str, Any]],
    describe: Callable[[Ranks], str],
) -> None:
    """The main of a framework script (bench_frameworks_*.py): a rank it launched runs
    ``worker``; the script itself launches the ranks in a scratch folder, prints
    ``describe(ranks)``, the report and the load, and writes ``--json``."""
    if args.worker is not None:
        worker(args)
        return
    before = load_average()
    with scratch_dir(f"bench-{name}-", args.dir) as folder:
        ranks = launch(args, folder)
    print(describe(ranks))
    summary = report(ranks)
    print_load(before)
    write_json(args.json, {"environment": environment(), "summary": summary, "ranks": ranks})


def launch_ranks(
    command: list[str],
    out: Path,
    *,
    world: int = 2,
    timeout_s: float = 3600.0,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``command`` as ``world`` gloo ranks (torchrun's environment plus ``env``), all killed
    if one fails or ``timeout_s`` passes; each rank's ``out/rank-<r>.json``, read back."""
    port = free_port()
    out.mkdir()
    procs = [
        subprocess.Popen(command, env={**torchrun_env(rank, world, port), **(env or {})}, cwd=cwd)
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout_s
    for p in procs:
        code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        if code != 0:
            for q in procs:
                q.kill()
            raise SystemExit(f"a rank exited {code}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]
