"""The machine under the figures: files and their sizes, fsync, syncing the disk, warming and
dropping the page cache (machine-wide, or one folder's files), peak RSS (``/proc`` VmHWM, a
sampling thread or ``ru_maxrss``) and the machine and software versions. Runs on the
caller's thread (the sampler on its own).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import importlib
import importlib.util
import os
import platform
import resource
import statistics
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

_KIB = 1024
_READ_BLOCK_BYTES = 8 << 20


# --------------------------------------------------------------- files, page cache, the disk


def median(samples: Sequence[float]) -> float:
    """Median of the samples; NaN when there are none (a peer that failed or was skipped)."""
    return statistics.median(samples) if samples else float("nan")


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
    """Bytes (apparent size) of every file under ``root``."""
    return sum(file_sizes(root).values())


def file_sizes(root: Path) -> dict[Path, int]:
    """Every file's size under ``root``; a file deleted during the walk is left out (a
    Checkpointer deletes what its retention drops after reporting the version)."""
    sizes: dict[Path, int] = {}
    if root.exists():
        for path in iter_files(root):
            with contextlib.suppress(FileNotFoundError):
                sizes[path] = path.stat().st_size
    return sizes


def written_between(before: Mapping[Path, int], after: Mapping[Path, int]) -> int:
    """Bytes of the files created or grown between two :func:`file_sizes` (deletions: 0)."""
    return sum(max(0, size - before.get(path, 0)) for path, size in after.items())


def settle_disk() -> None:
    """Flush every file system (untimed) so that the next timed save starts on a quiet disk.

    Removing a checkpoint leaves journal work behind (and, on a file system mounted with
    ``discard``, TRIMs) that would otherwise land in the next peer's fsync.
    """
    os.sync()


def warm_page_cache(root: Path) -> int:
    """Read every file under ``root`` once, so that every peer's timed loads start warm."""
    buffer = bytearray(_READ_BLOCK_BYTES)
    view = memoryview(buffer)
    total = 0
    for path in iter_files(root):
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115
        except FileNotFoundError:
            continue  # retired by the run's writer meanwhile (see file_sizes)
        with f:
            while n := f.readinto(view):
                total += n
    return total


def drop_file_cache(root: Path) -> tuple[int, int] | None:
    """fsync every file under ``root`` and drop its pages from the page cache
    (``POSIX_FADV_DONTNEED``): a cold read of this folder's files only, no root needed, the
    rest of the machine's cache untouched. Returns ``(pages still cached, pages)`` of those files
    after the drop (``mincore``; None where it cannot be told). Raises :class:`OSError` (ENOTSUP)
    where this platform has no ``posix_fadvise``."""
    from cryosnap import _native

    if not hasattr(os, "posix_fadvise"):
        raise OSError(errno.ENOTSUP, "this platform has no posix_fadvise: nothing can be evicted")
    cached = total = 0
    told = False
    for path in iter_files(root):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # retired by the run's writer meanwhile (see file_sizes)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            counts = _native.cached_pages(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if counts is not None:  # None: an empty file, or no mincore here
            cached, total, told = cached + counts[0], total + counts[1], True
    return (cached, total) if told else None


_DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache() -> bool:
    """Write back dirty pages, then drop the clean page cache (every file's, machine-wide).

    True when the kernel took it: needs root and a writable ``/proc/sys/vm/drop_caches``.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    os.sync()
    try:
        with open(_DROP_CACHES, "w") as f:
            f.write("1")
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------- peak memory


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise LookupError(f"{field_name} not in /proc/self/status")


def current_rss_bytes() -> int:
    """Resident set size of this process now (VmRSS)."""
    return _proc_status_kib("VmRSS") * _KIB


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where the kernel cannot.

    Writing 5 to /proc/self/clear_refs (Linux >= 4.0) resets the high-water mark, so the peak read
    afterwards belongs to what ran afterwards.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since the last :func:`reset_peak_rss` (VmHWM)."""
    return _proc_status_kib("VmHWM") * _KIB


def _malloc_trim() -> None:
    """Return freed heap pages to the kernel (glibc), so a later allocation shows in RSS."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


class MemoryMeter:
    """Peak RSS of one call minus RSS before it, by the best method this machine offers."""

    def __init__(self) -> None:
        self.method = self._choose()
        self._before = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._sampled = 0

    @staticmethod
    def _choose() -> str:
        try:
            current_rss_bytes()
            if reset_peak_rss():
                return "vmhwm"
        except (OSError, LookupError):
            pass
        if importlib.util.find_spec("psutil") is not None:
            return "psutil"
        return "ru_maxrss"

    @property
    def description(self) -> str:
        return {
            "vmhwm": "VmHWM reset through /proc/self/clear_refs before each call: peak RSS "
            "during the call minus RSS just before it",
            "psutil": "RSS sampled every 5 ms (psutil) during the call minus RSS just before it",
            "ru_maxrss": "growth of getrusage ru_maxrss over the call (a lower bound: only what "
            "exceeds the process's earlier peak)",
        }[self.method]

    def start(self) -> None:
        _malloc_trim()
        if self.method == "vmhwm":
            self._before = current_rss_bytes()
            reset_peak_rss()
        elif self.method == "psutil":
            import psutil

            process = psutil.Process()
            self._before = self._sampled = int(process.memory_info().rss)
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample, args=(process,), daemon=True)
            self._sampler.start()
        else:
            self._before = _maxrss_bytes()

    def _sample(self, process: Any) -> None:
        while not self._stop.wait(0.005):
            self._sampled = max(self._sampled, int(process.memory_info().rss))

    def stop(self) -> int:
        if self.method == "vmhwm":
            return max(0, peak_rss_bytes() - self._before)
        if self.method == "psutil" and self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None
            return max(0, self._sampled - self._before)
        return max(0, _maxrss_bytes() - self._before)


def _maxrss_bytes() -> int:
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else _KIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def machine_info() -> dict[str, Any]:
    """The machine and the software the figures belong to."""
    import numpy

    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    for name in ("safetensors", "torchsnapshot", "torch_checkpointing"):
        try:
            info[name] = importlib.import_module(name).__version__
        except (ImportError, AttributeError):
            info[name] = None
    from cryosnap import __version__

    info["cryosnap"] = f"{__version__} ({Path(__file__).resolve().parent.parent})"
    return info


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or None


def _memory_bytes() -> int | None:
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None
