"""Shared helpers for the benchmark scripts in bench/: timing, fsync, page cache, peak RSS, tables.

Runs in the benchmark's own process (and in the small child processes it starts to measure peak
memory). Imports nothing heavy: no torch, no numpy, no cryosnap, so that a child process pays only
for what it measures.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

_READ_BLOCK_BYTES = 8 << 20
_KIB = 1024


# --------------------------------------------------------------------------------------- timing


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """Call ``fn`` once and return (seconds, its result).

    Garbage is collected before the clock starts so that one peer does not pay for the garbage
    another one left behind.
    """
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def median(samples: Sequence[float]) -> float:
    """Median of the samples; NaN when there are none (a peer that failed or was skipped)."""
    return statistics.median(samples) if samples else float("nan")


# ---------------------------------------------------------------------------- files, page cache


def fsync_path(path: Path) -> None:
    """fsync one file (or directory) by path; on Linux an fsync on a read-only fd is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def iter_files(root: Path) -> Iterator[Path]:
    """Every regular file under ``root`` (or ``root`` itself when it is a file), sorted."""
    if root.is_file():
        yield root
        return
    for dirpath, _dirnames, filenames in sorted(os.walk(root)):
        for name in sorted(filenames):
            yield Path(dirpath) / name


def tree_bytes(root: Path) -> int:
    """Bytes on disk (apparent size) of every file under ``root``."""
    return sum(path.stat().st_size for path in iter_files(root))


def settle_disk() -> None:
    """Flush every file system (untimed) so that the next peer starts on a quiet disk.

    Removing a checkpoint leaves journal work behind (and, on a file system mounted with
    ``discard``, TRIMs) that would otherwise land in the next peer's fsync.
    """
    os.sync()


def warm_page_cache(root: Path) -> int:
    """Read every file under ``root`` once so that later timed loads all start warm.

    We cannot drop the page cache here (no root in general, and other tenants share the disk), so
    instead every peer's files are made equally warm: read once, after the save and before the
    timed loads. Returns the bytes read.
    """
    buffer = bytearray(_READ_BLOCK_BYTES)
    view = memoryview(buffer)
    total = 0
    for path in iter_files(root):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total


# ------------------------------------------------------------------------------------ peak RSS


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(f"{field} not in /proc/self/status")


def current_rss_bytes() -> int:
    """Resident set size of this process now (VmRSS)."""
    return _proc_status_kib("VmRSS") * _KIB


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where the kernel cannot.

    Writing 5 to /proc/self/clear_refs (Linux >= 4.0) resets the high-water mark, so the peak read
    afterwards belongs to what ran afterwards and not to the imports before it.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM).

    Not ``getrusage().ru_maxrss``: a child started from a process that holds gigabytes inherits
    that process's high-water mark across fork and exec (ru_maxrss is the max over the signal
    struct, which exec fills from the old address space), so a fresh child would report the
    benchmark's own footprint. VmHWM belongs to the child's own address space only.
    """
    return _proc_status_kib("VmHWM") * _KIB


@dataclass(frozen=True, slots=True)
class PeakRss:
    """Peak memory of one call, measured in a fresh child process."""

    rss_before_bytes: int
    peak_rss_bytes: int
    loaded_bytes: int
    hwm_reset: bool

    @property
    def peak_delta_bytes(self) -> int:
        """Peak RSS during the call minus the RSS just before it: what the call itself cost."""
        return self.peak_rss_bytes - self.rss_before_bytes


def run_peak_rss_child(argv: Sequence[str], *, timeout_seconds: float = 600.0) -> PeakRss:
    """Run ``python argv...`` in a fresh process that prints one JSON line of PeakRss fields last.

    The child must measure itself (current_rss_bytes / reset_peak_rss / peak_rss_bytes around the
    call) and print ``json.dumps(dataclasses.asdict(PeakRss(...)))`` as its last line of stdout.
    """
    completed = subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout_seconds,
        check=False,
    )
    if completed.returncode != 0:
        raise ChildProcessError(
            f"peak-RSS child {list(argv)} exited {completed.returncode}:\n{completed.stderr}"
        )
    last_line = completed.stdout.strip().splitlines()[-1]
    fields = json.loads(last_line)
    return PeakRss(**fields)


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


def import_cryosnap() -> ModuleType:
    """cryosnap, from the interpreter or else from the checkout's src/ (imported on call only:
    child processes that measure peak memory do not pay for it)."""
    try:
        import cryosnap
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
        import cryosnap
    return cryosnap


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
