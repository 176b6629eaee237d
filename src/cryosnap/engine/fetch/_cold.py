"""Cold data files: which of a part's data files are out of the page cache (``mincore``
through the store), the fresh page-aligned memory their large blobs are read into with
``O_DIRECT``, and the private buffers into='s leaves wait in until every chunk verified.
Runs on the caller's thread; no I/O but the store's probe.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Callable, Collection, Iterator, Sequence

import numpy as np

from cryosnap import _native
from cryosnap.engine._resolved import ResolvedPart
from cryosnap.errors import CheckpointError
from cryosnap.storage import Store

__all__ = [
    "ColdFiles",
    "aligned_memory",
    "available_memory_bytes",
    "placer",
    "prefaulting",
]

# Blobs of a cold file at least this large get fresh page-aligned memory (one mapping each),
# read into straight from the disk; smaller ones go through the reader's bounce buffer.
ALIGNED_MIN_BYTES = 1 << 20


def aligned_memory(nbytes: int, skip: int = 0) -> memoryview:
    """``nbytes`` (> 0) of fresh, zeroed memory ``skip`` bytes (less than a page) past a page
    boundary, as a view that owns its mapping (asked for huge pages where the kernel has them:
    fewer faults as the reads land)."""
    m = mmap.mmap(-1, nbytes + skip)
    with contextlib.suppress(AttributeError, OSError):  # advice only
        m.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(m)[skip : skip + nbytes]


def available_memory_bytes() -> int | None:
    """The memory the kernel could give now (``MemAvailable``); None where it cannot be told."""
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open("/proc/meminfo", encoding="ascii") as f,
    ):
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


class ColdFiles:
    """The data files of ``part`` that are cold (less than ``cold_share`` of their pages in
    the page cache: the read's :class:`ReadLimits`), on a store that can tell
    (``cached_share``) and read them so (``read_ranges_cold``: a LocalStore, possibly in a
    TimeoutStore); none elsewhere.

    :meth:`place` hands out fresh memory for the large blobs with bytes in a cold file, placed
    within its pages as the blob's bytes lie within the file's: the leaf is built over it and
    the direct reads land there from the disk, no copy."""

    def __init__(self, store: Store, part: ResolvedPart, *, cold_share: float) -> None:
        self.files: frozenset[int] = frozenset()
        chunks = part.chunks()
        self._nbytes: list[int] = chunks.nbytes.tolist()
        # Where each blob's first chunk lies within a page of its file: its memory is placed
        # alike, so that direct reads land in it (the writer lays large blobs out so).
        first = np.minimum(chunks.starts[:-1], max(len(chunks.offsets) - 1, 0))
        heads = chunks.offsets[first] % mmap.PAGESIZE if len(chunks.offsets) else first * 0
        self._head: list[int] = heads.tolist()
        self._touches: list[bool] = [False] * len(part.blobs)
        self._chunk_files, self._starts = chunks.files, chunks.starts
        self.fresh: set[int] = set()  # blobs given memory by place()
        share: Callable[[str], float | None] | None = getattr(store, "cached_share", None)
        if share is None or getattr(store, "read_ranges_cold", None) is None:
            return
        cold: set[int] = set()
        for f in np.unique(chunks.files).tolist():
            with contextlib.suppress(CheckpointError):  # missing: the read names it
                s = share(part.files[f])
                if s is not None and s < cold_share:
                    cold.add(f)
        self.files = frozenset(cold)
        if not cold:
            return
        self._touches = self.touching(cold)

    def touching(self, files: Collection[int]) -> list[bool]:
        """For each blob, whether some chunk of it lies in one of ``files`` (indices into
        the part's files; the cold ones: :attr:`files`)."""
        inside = np.isin(self._chunk_files, np.fromiter(files, np.int64, len(files)))
        counts = np.cumsum(np.concatenate([[0], inside.astype(np.int64)]))
        touched: list[bool] = (counts[self._starts[1:]] > counts[self._starts[:-1]]).tolist()
        return touched

    def direct_files(self, direct: Sequence[bool]) -> list[int]:
        """The cold files that some chunk of a ``direct`` blob (into='s own leaf) lies in."""
        if not self.files or not any(direct):
            return []
        counts = np.diff(self._starts)
        of_direct = np.repeat(np.asarray(direct, bool), counts)
        used = np.unique(self._chunk_files[of_direct]).tolist()
        return [f for f in used if f in self.files]

    def memory(self, blob: int, alignment: int = 1) -> memoryview:
        """Fresh memory for ``blob``'s bytes, placed within its first page as its first chunk
        is within a page of its file (page-aligned if that breaks ``alignment``)."""
        head = self._head[blob]
        return aligned_memory(self._nbytes[blob], head if head % alignment == 0 else 0)

    def place(self, blob: int, alignment: int) -> memoryview | None:
        """Fresh memory (:meth:`memory`) for ``blob`` if it is large and some of its chunks lie
        in a cold file, else None."""
        nbytes = self._nbytes[blob]
        if not self._touches[blob] or nbytes < ALIGNED_MIN_BYTES or alignment > mmap.PAGESIZE:
            return None
        self.fresh.add(blob)
        return self.memory(blob, alignment)

    def staging_budget(self, share: float) -> int:
        """The bytes into='s cold leaves may be staged in (0: none, they are read twice):
        ``share`` (the read's ``staging_share``) of the memory available."""
        if not self.files:
            return 0
        available = available_memory_bytes()
        if available is None:
            with contextlib.suppress(ValueError, OSError, AttributeError):
                available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return int((available or 0) * share)


def placer(
    first: Callable[[int, int], memoryview | None], cold: ColdFiles
) -> Callable[[int, int], memoryview | None]:
    """``first``'s memory for a blob (the mapped files'), else ``cold``'s."""

    def place(blob: int, alignment: int) -> memoryview | None:
        view = first(blob, alignment)
        return view if view is not None else cold.place(blob, alignment)

    return place


# Bytes a prefault thread maps in one call, checking between calls whether to stop.
_PREFAULT_STEP_BYTES = 8 << 20


@contextlib.contextmanager
def prefaulting(
    ranges: Sequence[tuple[int, int]],
    touch: Callable[[int, int], object] = _native.populate,
) -> Iterator[None]:
    """Map the fresh pages of ``ranges`` ((address, bytes), in the order the reads reach
    them) on a thread of its own until the block ends: the kernel zeroes and maps them on one
    core while the direct reads that land there wait on the disk (a read that gets there first
    faults the rest in itself; mapping a page twice costs nothing). ``touch(address, bytes)``
    maps a step (``_native.zero`` where the pages are the caller's own and may be written)."""
    if not ranges:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        for address, nbytes in ranges:
            for lo in range(0, nbytes, _PREFAULT_STEP_BYTES):
                if stop.is_set():
                    return
                touch(address + lo, min(_PREFAULT_STEP_BYTES, nbytes - lo))

    thread = threading.Thread(target=run, name="cryosnap-prefault", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
