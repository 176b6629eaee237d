"""The read plan of one part: which bytes of which data file land in which leaf, in what runs
and tasks (docs/design/read-path.md). Pure: numpy over every chunk at once, no I/O, no
threads; runs on the caller's thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from cryosnap._format.chunks import HASH_BYTES
from cryosnap.engine._limits import ReadLimits
from cryosnap.engine._resolved import PartChunks

__all__ = [
    "Batches",
    "Gather",
    "PieceLists",
    "Pieces",
    "ReadPlan",
    "Reads",
    "Task",
    "gather_windows",
    "overlapping",
    "plan_reads",
    "window_batches",
    "wrong_chunk_count",
]

# Bytes of a gather's window, and of the windows read in one read_ranges call.
_GATHER_WINDOW_BYTES = 4 << 20

Array = np.ndarray[Any, Any]
# (file offset, piece ids, gap bytes before each piece): one contiguous preadv.
Run = tuple[int, list[int], list[int]]
Task = tuple[int, list[Run]]  # (file index, runs): one read_ranges call (one open)
Window = tuple[int, int, int, int]  # (first, end) chunks of a gather, (lo, hi) bytes


class PieceLists(NamedTuple):
    """:class:`Pieces` as Python lists: what the pool's threads index piece by piece."""

    blob: list[int]
    start: list[int]
    nbytes: list[int]
    file: list[int]
    offset: list[int]
    hash_lo: list[int]
    hash_hi: list[int]
    whole: list[bool]
    direct: list[bool]


@dataclass(frozen=True)
class Pieces:
    """Whole chunks of one blob back to back in one file (at most about ``bounce_bytes``
    each), in read order: files in the order the blobs first use them, then offsets. Columns:
    the blob, the piece's first byte in it, its bytes, its file and offset there, where its
    hashes lie in the part's hash bytes, whether it is its blob's whole view, whether its
    blob is direct (into='s own) and whether it is hashed where a file is mapped."""

    blob: Array
    start: Array
    nbytes: Array
    file: Array
    offset: Array
    hash_lo: Array
    hash_hi: Array
    whole: Array
    direct: Array
    mapped: Array

    def lists(self) -> PieceLists:
        return PieceLists(
            *(getattr(self, name).tolist() for name in PieceLists._fields),
        )


@dataclass(frozen=True)
class Reads:
    """Pieces grouped for reading: ``pids`` in order, ``gaps`` the bytes skipped before each
    in its run (0 at a run's first); runs (one preadv of many buffers) start at
    ``run_starts`` (positions in ``pids``), tasks (one read_ranges call) at ``task_starts``
    (positions in the runs), each of one file (``task_file``)."""

    pids: Array
    gaps: Array
    run_starts: Array
    task_starts: Array
    task_file: Array

    def tasks(self, offsets: Array) -> list[Task]:
        """As (file, [(offset, pids, gaps)...]) tuples, ``offsets`` each piece's offset."""
        n = len(self.pids)
        if not n:
            return []
        run_at = self.run_starts.tolist()
        pid_l, gap_l = self.pids.tolist(), self.gaps.tolist()
        off_l = offsets[self.pids[self.run_starts]].tolist()
        runs: list[Run] = [
            (off_l[r], pid_l[a:z], gap_l[a:z])
            for r, (a, z) in enumerate(itertools.pairwise([*run_at, n]))
        ]
        bounds = itertools.pairwise([*self.task_starts.tolist(), len(runs)])
        return [(f, runs[a:z]) for f, (a, z) in zip(self.task_file.tolist(), bounds, strict=True)]


@dataclass(frozen=True)
class Batches:
    """Pieces of mapped files hashed in place, in batches of about ``bounce_bytes``."""

    pids: Array
    starts: Array

    def lists(self) -> list[list[int]]:
        return [b.tolist() for b in np.split(self.pids, self.starts[1:])] if len(self.pids) else []


@dataclass(frozen=True)
class Gather:
    """The whole chunks (indices into the blob) of one scattered blob that lie in one file."""

    blob: int
    file: int
    chunks: Array


@dataclass(frozen=True)
class ReadPlan:
    """Every read of one part, for both passes. ``staged``: the scattered direct blobs, gathered
    into a private buffer the second pass copies into place."""

    pieces: Pieces
    gathers: tuple[Gather, ...]
    staged: tuple[int, ...]
    first: Reads
    first_mapped: Batches
    second: Reads
    second_mapped: Batches
    has_direct: bool


def wrong_chunk_count(chunks: PartChunks, chunk_bytes: int) -> int:
    """The first blob with more or fewer chunk hashes than its bytes make chunks, or -1
    (resolution makes it so; the plan relies on it)."""
    wrong = np.flatnonzero(np.diff(chunks.starts) != -(-chunks.nbytes // chunk_bytes))
    return int(wrong[0]) if len(wrong) else -1


def plan_reads(
    chunks: PartChunks,
    chunk_bytes: int,
    *,
    view_bytes: Sequence[int],
    direct: Sequence[bool] = (),
    placed: Sequence[bool] = (),
    mapped_files: Collection[int] = (),
    cold_files: Collection[int] = (),
    limits: ReadLimits,
) -> ReadPlan:
    """The plan that fills the leaves (of ``view_bytes`` bytes each) of the blobs ``chunks``
    describes. ``direct`` blobs are verified first and filled by a second pass; ``placed``
    ones (and direct ones) in ``mapped_files`` are hashed where those are mapped. The tasks of
    ``cold_files`` (read from the disk with direct I/O) are of about ``bounce_bytes``: a few
    in flight, each hashed as it lands. ``limits``: the read's, which the plan is cut to
    (io_batch_bytes, bounce_bytes, gap_bytes, fragmented_runs)."""
    nb = len(chunks.starts) - 1
    direct_b = np.array([bool(d) for d in direct] if direct else [False] * nb, bool)
    has_direct = bool(direct_b.any())
    pieces, scattered = _pieces(chunks, chunk_bytes, limits)
    gathers: list[Gather] = []
    for i in np.flatnonzero(scattered).tolist():
        extra = _plan_gathers(chunks, i, chunk_bytes, gathers)
        if extra is not None:  # the short last chunk of a scattered blob: a piece
            pieces = [np.append(col, v) for col, v in zip(pieces, (i, *extra), strict=True)]
    staged = tuple(g for g in np.flatnonzero(scattered & direct_b).tolist())
    p_blob, p_start, p_nbytes, p_file, p_offset = _read_order(chunks, pieces)
    p_direct = direct_b[p_blob]
    p_mapped = np.zeros(len(p_blob), bool)
    if len(mapped_files):
        use = np.array([bool(p) for p in placed] if placed else [False] * nb, bool) | direct_b
        in_map = np.isin(p_file, np.fromiter(mapped_files, np.int64, len(mapped_files)))
        p_mapped = use[p_blob] & in_map
    lo = (chunks.starts[:-1][p_blob] + p_start // chunk_bytes) * HASH_BYTES
    hi = lo + -(-p_nbytes // chunk_bytes) * HASH_BYTES
    viewed = np.asarray(view_bytes, np.int64).reshape(-1)
    whole = (p_start == 0) & (p_nbytes == viewed[p_blob])
    cols = (p_blob, p_start, p_nbytes, p_file, p_offset, lo, hi, whole, p_direct, p_mapped)
    table = Pieces(*cols)
    capped = p_direct if has_direct else None
    cold = np.fromiter(cold_files, np.int64, len(cold_files)) if len(cold_files) else None
    second = p_direct & ~p_mapped
    return ReadPlan(
        pieces=table,
        gathers=tuple(gathers),
        staged=staged,
        first=_reads(table, np.flatnonzero(~p_mapped), capped, limits, cold),
        first_mapped=_batches(p_nbytes, np.flatnonzero(p_mapped), limits),
        second=_reads(table, np.flatnonzero(second), capped, limits, cold),
        second_mapped=_batches(p_nbytes, np.flatnonzero(p_direct & p_mapped), limits),
        has_direct=has_direct,
    )


def _pieces(chunks: PartChunks, cb: int, lim: ReadLimits) -> tuple[list[Array], Array]:
    """Pieces (blob, start, nbytes, file, offset) from runs of chunks that lie back to back,
    vectorized over every chunk of the part, and which blobs are scattered (gathered
    instead)."""
    first = chunks.starts
    nb = len(first) - 1
    total = int(first[-1])
    empty = np.empty(0, np.int64)
    if not total:
        return [empty] * 5, np.zeros(nb, bool)
    files = chunks.files.astype(np.int64)
    offs = chunks.offsets.astype(np.int64)
    counts = first[1:] - first[:-1]
    blob_of = np.repeat(np.arange(nb, dtype=np.int64), counts)
    within = np.arange(total, dtype=np.int64) - np.repeat(first[:-1], counts)
    new = np.ones(total, bool)
    new[1:] = (
        (blob_of[1:] != blob_of[:-1]) | (files[1:] != files[:-1]) | (offs[1:] != offs[:-1] + cb)
    )
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], total)
    sizes = chunks.nbytes
    runs = np.bincount(blob_of[starts], minlength=nb)
    scattered = (runs - 1 > lim.fragmented_runs) & (sizes < runs * lim.gap_bytes)
    keep = ~scattered[blob_of[starts]]
    s, e = starts[keep], ends[keep]
    # Pieces of at most a task's worth of whole chunks: a large blob is read by several tasks
    # in parallel, each hashed while it is in the cache.
    per = max(lim.bounce_bytes // cb, 1)
    nsub = -(-(e - s) // per)
    sub = np.repeat(s, nsub) + per * (
        np.arange(int(nsub.sum()), dtype=np.int64) - np.repeat(np.cumsum(nsub) - nsub, nsub)
    )
    sub_end = np.minimum(sub + per, np.repeat(e, nsub))
    p_blob = blob_of[sub]
    p_start = within[sub] * cb
    p_nbytes = np.minimum(within[sub_end - 1] * cb + cb, sizes[p_blob]) - p_start
    return [p_blob, p_start, p_nbytes, files[sub], offs[sub]], scattered


def _plan_gathers(
    chunks: PartChunks, i: int, cb: int, out: list[Gather]
) -> tuple[int, int, int, int] | None:
    """Scattered chunks (the end of an incremental chain over sparse updates): one gather per
    file of blob ``i`` (appended to ``out``), each read in windows and copied out with one
    vectorized gather, instead of one piece per chunk. Returns the short last chunk, which
    goes the usual way, as (start, nbytes, file, offset), or None."""
    a, z = int(chunks.starts[i]), int(chunks.starts[i + 1])
    files, offsets, nbytes = chunks.files[a:z], chunks.offsets[a:z], int(chunks.nbytes[i])
    n = z - a
    whole = n if nbytes % cb == 0 else n - 1
    for f in np.unique(files[:whole]).tolist():
        out.append(Gather(i, f, np.flatnonzero(files[:whole] == f)))
    if whole == n:
        return None
    return whole * cb, nbytes - whole * cb, int(files[-1]), int(offsets[-1])


def _read_order(chunks: PartChunks, pieces: list[Array]) -> list[Array]:
    """The pieces sorted by file, files in the order the blobs first use them (the order reads
    fail in), then by offset; pieces at one offset (content stored once, used twice) keep
    their blob order."""
    files = chunks.files
    if not len(files):
        return pieces
    u, first_use = np.unique(files, return_index=True)
    rank = np.empty(int(files.max()) + 1, np.int64)
    rank[u] = np.argsort(np.argsort(first_use))
    order = np.lexsort((pieces[4], rank[pieces[3]]))
    return [col[order] for col in pieces]


def _reads(
    pieces: Pieces, pids: Array, direct: Array | None, lim: ReadLimits, cold: Array | None = None
) -> Reads:
    """Pieces (``pids``, in read order) that follow each other in a file join one run; so do
    pieces a small gap apart (the gap is read into scratch): a fragmented incremental chain
    reads its old data files in a few large reads instead of one per changed region. Runs of
    one file join tasks of about ``io_batch_bytes`` (a file some direct piece is read from, or
    one of the ``cold`` files: ``bounce_bytes``)."""
    n = len(pids)
    if not n:
        empty = np.empty(0, np.int64)
        return Reads(empty, empty, empty, empty, empty)
    files, offsets, sizes = pieces.file[pids], pieces.offset[pids], pieces.nbytes[pids]
    new_file = np.ones(n, bool)
    new_file[1:] = files[1:] != files[:-1]
    # Bytes of the file's pieces before each piece, and the task it starts in.
    before = np.cumsum(sizes) - sizes
    first = np.flatnonzero(new_file)
    segment = np.cumsum(new_file) - 1
    within = before - before[first][segment]
    cap = np.full(len(first), lim.io_batch_bytes, np.int64)
    if direct is not None:
        bounced = np.add.reduceat(direct[pids].astype(np.int64), first) > 0
        cap[bounced] = lim.bounce_bytes
    if cold is not None:
        cap[np.isin(files[first], cold)] = lim.bounce_bytes
    slot = within // cap[segment]
    new_task = new_file.copy()
    new_task[1:] |= slot[1:] != slot[:-1]
    # A new run at a new task, at a piece before the last one's end (content stored once, used
    # twice) or farther than a gap after it.
    gap = np.zeros(n, np.int64)
    gap[1:] = offsets[1:] - offsets[:-1] - sizes[:-1]
    new_run = new_task | (gap < 0) | (gap > lim.gap_bytes)
    gap[new_run] = 0
    run_starts = np.flatnonzero(new_run)
    task_starts = np.searchsorted(run_starts, np.flatnonzero(new_task))
    return Reads(np.asarray(pids, np.int64), gap, run_starts, task_starts, files[new_task])


def _batches(nbytes: Array, pids: Array, lim: ReadLimits) -> Batches:
    """Pieces of mapped files (``pids``, in read order) in batches of about ``bounce_bytes``:
    a large blob is hashed by every pool thread, a state of many small leaves in few calls."""
    if not len(pids):
        return Batches(np.empty(0, np.int64), np.empty(0, np.int64))
    sizes = nbytes[pids]
    slot = (np.cumsum(sizes) - sizes) // lim.bounce_bytes
    starts = np.concatenate([[0], np.flatnonzero(slot[1:] != slot[:-1]) + 1])
    return Batches(np.asarray(pids, np.int64), starts.astype(np.int64))


def overlapping(files: Array, lo: Array, nbytes: Array) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Which of the byte ranges ``[lo, lo + nbytes)`` of ``files`` overlap another one: content
    stored once and used by several leaves (two equal optimizer step counters, say). Such
    leaves must not be built over the same memory, or a write to one would change the
    other."""
    out = np.zeros(len(files), bool)
    hi = lo + nbytes
    order = np.lexsort((lo, files))
    f, a, b = files[order], lo[order], hi[order]
    bounds = [0, *(np.flatnonzero(np.diff(f)) + 1).tolist(), len(f)]
    for start, end in itertools.pairwise(bounds):
        ga, gb = a[start:end], b[start:end]
        if len(ga) < 2:
            continue
        before = np.maximum.accumulate(gb)[:-1]  # the furthest end of the ranges before each
        hit = np.zeros(len(ga), bool)
        hit[1:] = ga[1:] < before  # starts inside an earlier range
        hit[:-1] |= ga[1:] < gb[:-1]  # the next range starts inside this one
        out[order[start:end][hit]] = True
    return out


def gather_windows(offs: Array, cb: int, gap_bytes: int) -> list[Window]:
    """Windows over the sorted chunk offsets ``offs`` of one file: a window never spans a gap
    wider than ``gap_bytes`` (dead chunks of an old file are not read) nor more than
    _GATHER_WINDOW_BYTES."""
    cuts = np.flatnonzero(offs[1:] - offs[:-1] - cb > gap_bytes) + 1
    cluster_end = np.append(cuts, len(offs))
    windows: list[Window] = []
    lo_i = 0
    while lo_i < len(offs):
        lo = int(offs[lo_i])
        end_i = int(cluster_end[np.searchsorted(cluster_end, lo_i, side="right")])
        hi_i = int(np.searchsorted(offs, lo + _GATHER_WINDOW_BYTES - cb, side="right"))
        hi_i = max(min(hi_i, end_i), lo_i + 1)
        windows.append((lo_i, hi_i, lo, int(offs[hi_i - 1]) + cb))
        lo_i = hi_i
    return windows


def window_batches(windows: list[Window]) -> Iterator[tuple[list[Window], int]]:
    """Several windows per read_ranges call (one open), up to _GATHER_WINDOW_BYTES in all;
    with the bytes of each batch."""
    w = 0
    while w < len(windows):
        batch = [windows[w]]
        size = windows[w][3] - windows[w][2]
        w += 1
        while w < len(windows) and size + windows[w][3] - windows[w][2] <= _GATHER_WINDOW_BYTES:
            size += windows[w][3] - windows[w][2]
            batch.append(windows[w])
            w += 1
        yield batch, size
