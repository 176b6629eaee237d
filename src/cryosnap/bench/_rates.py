"""This machine's rates as a Checkpointer spends them, for ``cryosnap plan --measure DIR`` and
``bench/bench_plan_model.py``: one thread's memory copy (numpy ``copyto``, what the capture
does), one thread's xxh3-128 over 1 MiB chunks (the writer's hashing), an ``O_DIRECT`` write +
fsync of a file in a folder and its ``O_DIRECT`` read back (what the scratch level writes and a
flush reads; buffered where the file system refuses O_DIRECT), and the latency of one
collective of an :class:`~cryosnap.dist.InProcessGroup` (threads of this process: a floor, not
a network's). Each the median of a few runs; runs on the caller's thread (the collective's
ranks on threads it starts and joins).
"""

from __future__ import annotations

import mmap
import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cryosnap._native import hash_chunks
from cryosnap.dist import InProcessGroup
from cryosnap.errors import BenchError

__all__ = ["MachineRates", "measure_rates"]

_MIB = 1 << 20
_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class MachineRates:
    """Measured rates, in bytes per second (``latency_seconds``: one collective)."""

    memcpy_bytes_per_second: float
    hash_bytes_per_second: float
    write_bytes_per_second: float
    read_bytes_per_second: float
    latency_seconds: float
    folder: str


def measure_rates(folder: str | os.PathLike[str], *, nbytes: int = 256 * _MIB) -> MachineRates:
    """Measure this machine's rates, the disk's in ``folder`` (an existing, writable folder:
    a :class:`~cryosnap.errors.BenchError` naming it otherwise). Leaves nothing behind."""
    where = Path(folder)
    if not where.is_dir():
        raise BenchError(f"cannot measure the disk at {where}: not a folder")
    if not os.access(where, os.W_OK):
        raise BenchError(f"cannot measure the disk at {where}: not writable")
    write, read = disk_rates(where, nbytes)
    return MachineRates(
        memcpy_bytes_per_second=memcpy_rate(nbytes),
        hash_bytes_per_second=hash_rate(nbytes),
        write_bytes_per_second=write,
        read_bytes_per_second=read,
        latency_seconds=collective_latency(),
        folder=str(where),
    )


def memcpy_rate(nbytes: int = 256 * _MIB) -> float:
    """One thread's copy into warm memory (numpy ``copyto``), the median of 5."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - t0)
    return nbytes / statistics.median(samples)


def hash_rate(nbytes: int = 256 * _MIB) -> float:
    """One thread's xxh3-128 of 1 MiB chunks (the writer's own hashing), the median of 5."""
    data = memoryview(np.random.default_rng(0).bytes(nbytes))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        hash_chunks(data, _CHUNK_BYTES, 0)
        samples.append(time.perf_counter() - t0)
    return nbytes / statistics.median(samples)


def _open_direct(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError:  # the file system refuses O_DIRECT: buffered
        return os.open(path, flags, 0o600)


def disk_rates(folder: Path, nbytes: int = 256 * _MIB) -> tuple[float, float]:
    """``(write, read)``: an O_DIRECT write + fsync of ``nbytes`` from a page-aligned buffer,
    then its O_DIRECT read back (the medians of 3); the files removed."""
    buf = mmap.mmap(-1, nbytes)
    buf.write(np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8).tobytes())
    view = memoryview(buf)
    writes, reads = [], []
    try:
        for i in range(3):
            path = folder / f".cryosnap-rate-{os.getpid()}-{i}.bin"
            try:
                writes.append(_timed_write(path, view))
                reads.append(_timed_read(path, view))
            except OSError as exc:
                raise BenchError(f"cannot measure the disk at {folder}: {exc}") from exc
            finally:
                path.unlink(missing_ok=True)
    finally:
        view.release()
        buf.close()
    return nbytes / statistics.median(writes), nbytes / statistics.median(reads)


def _timed_write(path: Path, view: memoryview) -> float:
    fd = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < view.nbytes:
            done += os.write(fd, view[done : done + 64 * _MIB])
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _timed_read(path: Path, view: memoryview) -> float:
    fd = _open_direct(path, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        done = 0
        while done < view.nbytes:
            got = os.readv(fd, [view[done : done + 64 * _MIB]])
            if got == 0:
                raise OSError(f"{path} ended after {done} bytes")
            done += got
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def collective_latency(ranks: int = 2, rounds: int = 200) -> float:
    """One all_gather of ``ranks`` thread ranks (rank 0's median of ``rounds``)."""
    group = InProcessGroup(ranks)
    times: list[float] = []
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            coord = group.coordinator(rank)
            for _ in range(rounds):
                t0 = time.perf_counter()
                coord.all_gather(rank)
                if rank == 0:
                    times.append(time.perf_counter() - t0)
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return statistics.median(times)
