"""The write path's differ, pure over hashes: the segments of a part cover every chunk once and
in order, an unchanged blob is inherited whole, content stored before becomes a reference, and
new content is placed once, aligned as docs/FORMAT.md says."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cryosnap._format.blobs import INHERITED, STORED
from cryosnap._format.chunks import HASH_BYTES, chunk_count
from cryosnap._state import Blob
from cryosnap.engine import ResolvedBlob, ResolvedPart
from cryosnap.engine.write._differ import ALIGN_BYTES, ALIGN_MIN_BYTES, Cursor, Differ, FileTable
from cryosnap.storage._direct import BLOCK_BYTES, DIRECT_MIN_BYTES

CHUNK = 4096  # blobs of one chunk or more are aligned (ALIGN_MIN_BYTES)
OWN = "versions/2/data-own"  # the part's own data file
OLD = "versions/1/data-old"  # a kept version's data file, where the index points
assert CHUNK >= ALIGN_MIN_BYTES


def digest(content: int, nbytes: int) -> bytes:
    """The hash of a chunk of ``nbytes`` of content number ``content`` (equal contents of
    equal sizes, equal hashes)."""
    return (content << 32 | nbytes).to_bytes(HASH_BYTES, "little")


def chunk_hashes(contents: list[int], nbytes: int) -> list[bytes]:
    """The hashes of the chunks of a blob of ``nbytes`` with these contents."""
    return [digest(c, min(CHUNK, nbytes - k * CHUNK)) for k, c in enumerate(contents)]


@dataclass
class Case:
    sizes: list[int]  # bytes of each blob
    new: list[list[int]]  # per blob, the content of each chunk
    base: list[list[int] | None]  # per blob, the base blob's chunks (None: no such blob)
    indexed: list[int]  # contents stored in a kept version
    cuts: list[list[int]]  # per blob, the chunks where its pieces start (after the first)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    content = st.integers(0, 7)  # few contents: repeats within and across blobs
    nblobs = draw(st.integers(1, 6))
    sizes = [draw(st.integers(0, 5 * CHUNK)) for _ in range(nblobs)]
    new = [[draw(content) for _ in range(chunk_count(n, CHUNK))] for n in sizes]
    base: list[list[int] | None] = []
    for chunks in new:
        kind = draw(st.sampled_from(["none", "same", "edited"]))
        if kind == "none":
            base.append(None)
        elif kind == "same":
            base.append(list(chunks))
        else:
            base.append([draw(content) if draw(st.booleans()) else c for c in chunks])
    indexed = draw(st.lists(content, max_size=4, unique=True))
    cuts = [
        sorted(draw(st.sets(st.integers(1, max(len(c) - 1, 1)))) & set(range(1, len(c))))
        for c in new
    ]
    return Case(sizes, new, base, indexed, cuts)


def _blobs(case: Case) -> list[Blob]:
    return [Blob(("leaf", i), n, b"") for i, n in enumerate(case.sizes)]


def _base(case: Case) -> ResolvedPart:
    blobs = []
    for i, (n, chunks) in enumerate(zip(case.sizes, case.base, strict=True)):
        if chunks is None:
            continue
        raw = b"".join(chunk_hashes(chunks, n))
        hashes = np.frombuffer(raw, np.uint8).reshape(-1, HASH_BYTES)
        zeros = np.zeros(len(chunks), np.int64)
        blobs.append(ResolvedBlob(f"leaf/{i}", n, zeros.astype(np.int32), zeros, hashes))
    # The differ reads the base's blobs only (the manifest is the writer's concern).
    return ResolvedPart(None, "base.json", "", [OLD], blobs, (1,))  # type: ignore[arg-type]


def _diff(case: Case, *, with_base: bool) -> tuple[Differ, Cursor, dict[bytes, tuple[str, int]]]:
    sizes = {min(CHUNK, n - k * CHUNK) for n in case.sizes for k in range(chunk_count(n, CHUNK))}
    stored = [digest(c, s) for c in case.indexed for s in sorted(sizes)]
    index = {h: (OLD, 100 * CHUNK * (k + 1)) for k, h in enumerate(stored)}
    base = _base(case) if with_base else None
    differ = Differ(_blobs(case), chunk_bytes=CHUNK, base=base, index=index, files=FileTable([OWN]))
    at = Cursor(0, OWN)
    for i, (n, chunks) in enumerate(zip(case.sizes, case.new, strict=True)):
        hashes = chunk_hashes(chunks, n)
        if len(chunks) == 1 and not case.cuts[i] and i % 2:  # the path of whole small blobs
            differ.diff_ones([i], [hashes[0]], at)
            continue
        starts = [0, *case.cuts[i], len(chunks)]
        for a, b in itertools.pairwise(starts):
            nbytes = min(b * CHUNK, n) - a * CHUNK
            differ.diff(i, a, b"".join(hashes[a:b]), nbytes, at)
    return differ, at, index


def _chunks_of(row: list[int], hashes: bytes, base: ResolvedPart | None) -> list[bytes]:
    """The chunk hashes a segment row covers (``hashes``: those of a stored row)."""
    kind, a, b, c = row
    if kind == STORED:
        return [hashes[k : k + HASH_BYTES] for k in range(0, len(hashes), HASH_BYTES)]
    assert kind == INHERITED and base is not None
    return [h.tobytes() for h in base.blobs[a].hashes[b : b + c]]


@settings(max_examples=300, deadline=None)
@given(cases(), st.booleans())
def test_segments_cover_every_chunk_once_in_order(case: Case, with_base: bool) -> None:
    differ, _at, _index = _diff(case, with_base=with_base)
    segments = differ.segments()
    assert differ.incomplete() is None
    for i, entry in enumerate(segments.entries):
        covered: list[bytes] = []
        stored_bytes = 0
        for seg, row in zip(entry.segments, entry.table.tolist(), strict=True):
            hashes = seg.hashes if row[0] == STORED else b""
            covered += _chunks_of(row, hashes, differ.base)
            stored_bytes += row[3] if row[0] == STORED else 0
            if row[0] == STORED:  # whole chunks, but the blob's last
                assert row[3] == min(len(hashes) // HASH_BYTES * CHUNK, row[3])
        assert covered == chunk_hashes(case.new[i], case.sizes[i])
        assert entry.nbytes == case.sizes[i]
        assert differ.root(i) == entry.root


@settings(max_examples=200, deadline=None)
@given(cases())
def test_an_unchanged_blob_is_inherited_whole(case: Case) -> None:
    differ, _at, _index = _diff(case, with_base=True)
    assert differ.base is not None
    for i, entry in enumerate(differ.segments().entries):
        if case.base[i] == case.new[i] and case.new[i]:
            j = differ.base.blob_index(f"leaf/{i}")
            assert entry.table.tolist() == [[INHERITED, j, 0, len(case.new[i])]]


@settings(max_examples=300, deadline=None)
@given(cases(), st.booleans())
def test_stored_chunks_lie_where_their_content_is_and_new_content_is_stored_once(
    case: Case, with_base: bool
) -> None:
    differ, at, index = _diff(case, with_base=with_base)
    segments = differ.segments()
    # Where each content lies: the kept versions' (the index), and what this part placed.
    placed = {loc: h for h, loc in differ.new_index.items()}
    lies = {**{loc: h for h, loc in index.items()}, **placed}
    for entry in segments.entries:
        for seg, row in zip(entry.segments, entry.table.tolist(), strict=True):
            if row[0] != STORED:
                continue
            key = segments.data_files[row[1]]
            for k in range(len(seg.hashes) // HASH_BYTES):
                h = seg.hashes[k * HASH_BYTES : (k + 1) * HASH_BYTES]
                assert lies[(key, row[2] + k * CHUNK)] == h
                if h in index:  # content seen before: a reference, never a second copy
                    assert (key, row[2] + k * CHUNK) == index[h]
    # Each new content placed once, in the part's own file, without overlap; the part's
    # bytes are those chunks, plus the padding that aligns blobs of at least ALIGN_MIN_BYTES.
    assert set(differ.new_index).isdisjoint(index)
    assert all(key == OWN for key, _o in differ.new_index.values())
    sizes = _new_sizes(case, differ)
    assert set(sizes) == set(differ.new_index)
    assert at.offset - differ.padding == sum(sizes.values()) == _written(differ)
    ends = sorted((o, o + sizes[h]) for h, (_k, o) in differ.new_index.items())
    assert all(b <= c for (_a, b), (c, _d) in itertools.pairwise(ends))
    assert differ.new_chunks == len(differ.new_index)


def _new_sizes(case: Case, differ: Differ) -> dict[bytes, int]:
    """The bytes of each content this part had to store: not inherited at its place, not in
    the index; the size of its first occurrence."""
    out: dict[bytes, int] = {}
    base = differ.base
    for i, (n, chunks) in enumerate(zip(case.sizes, case.new, strict=True)):
        old = case.base[i] if base is not None else None
        for k, (c, h) in enumerate(zip(chunks, chunk_hashes(chunks, n), strict=True)):
            if (old is not None and old[k] == c) or h in differ.index or h in out:
                continue
            out[h] = min(CHUNK, n - k * CHUNK)
    return out


def _written(differ: Differ) -> int:
    """Bytes of the stored rows into the own file at distinct offsets."""
    seen: dict[int, int] = {}
    for entry in differ.segments().entries:
        for kind, f, offset, nbytes in entry.table.tolist():
            if kind == STORED and differ.segments().data_files[f] == OWN:
                seen[offset] = max(seen.get(offset, 0), nbytes)
    return _union_bytes(seen)


def _union_bytes(runs: dict[int, int]) -> int:
    total, end = 0, -1
    for start, n in sorted(runs.items()):
        lo = max(start, end)
        if start + n > lo:
            total += start + n - lo
            end = start + n
    return total


@settings(max_examples=200, deadline=None)
@given(cases())
def test_new_blobs_of_a_chunk_or_more_start_aligned(case: Case) -> None:
    differ, _at, _index = _diff(case, with_base=False)
    earlier: set[bytes] = set()  # chunks of the blobs before: a reference to one is no new blob
    for i, entry in enumerate(differ.segments().entries):
        rows: list[Any] = entry.table.tolist()
        first = entry.hashes[:HASH_BYTES]
        if rows and case.sizes[i] >= ALIGN_MIN_BYTES and rows[0][0] == STORED:
            key = differ.segments().data_files[rows[0][1]]
            written_here = first not in earlier
            if key == OWN and written_here and differ.new_index[first] == (key, rows[0][2]):
                assert rows[0][2] % ALIGN_BYTES == 0
        earlier.update(
            entry.hashes[j : j + HASH_BYTES] for j in range(0, len(entry.hashes), HASH_BYTES)
        )


def test_large_runs_start_where_direct_writes_take_them_from_memory() -> None:
    """A new run of DIRECT_MIN_BYTES or more starts at an offset congruent to its memory
    address modulo BLOCK_BYTES (a cache-line-aligned address: the blob stays ALIGN_BYTES
    aligned); a piece that continues its blob's run stays contiguous; memory that is not
    cache-line aligned keeps the ALIGN_BYTES rule."""
    cb = DIRECT_MIN_BYTES
    sizes = [100, 4 * cb, 2 * cb, cb]
    blobs = [Blob(("leaf", i), n, b"") for i, n in enumerate(sizes)]
    referenced = digest(9, cb)
    differ = Differ(
        blobs, chunk_bytes=cb, base=None, index={referenced: (OLD, 0)}, files=FileTable([OWN])
    )
    at = Cursor(0, OWN)
    assert differ.diff_ones([0], [digest(1, 100)], at, [0]) == [0]
    pads = []
    a = (1 << 30) + 3 * ALIGN_BYTES  # blob 1's memory: 192 bytes past a page
    two = b"".join(digest(c, cb) for c in (2, 3))
    writes = differ.diff(1, 0, two, 2 * cb, at, a)
    assert writes == [((a - 100) % BLOCK_BYTES, 0, 2 * cb)]
    pads.append(writes[0][0])
    start = 100 + writes[0][0]
    assert start % BLOCK_BYTES == a % BLOCK_BYTES and start % ALIGN_BYTES == 0
    # The next piece of blob 1 (elsewhere in memory: another slab) continues its run.
    more = b"".join(digest(c, cb) for c in (4, 5))
    assert differ.diff(1, 2, more, 2 * cb, at, 1 << 31) == [(0, 0, 2 * cb)]
    # Blob 2: its first chunk is stored before, its second starts a run of its own.
    b = (1 << 32) + 5 * BLOCK_BYTES
    end = at.offset
    writes = differ.diff(2, 0, referenced + digest(6, cb), 2 * cb, at, b)
    assert writes == [((b + cb - end) % BLOCK_BYTES, cb, 2 * cb)]
    pads.append(writes[0][0])
    assert (end + writes[0][0]) % BLOCK_BYTES == 0
    # Blob 3: memory 16 bytes past a cache line (numpy's) is placed as before.
    end = at.offset
    writes = differ.diff(3, 0, digest(7, cb), cb, at, (1 << 33) + 16)
    assert writes == [(-end % ALIGN_BYTES, 0, cb)]
    pads.append(writes[0][0])
    rows = [e.table.tolist() for e in differ.segments().entries]
    assert len(rows[1]) == 1 and rows[1][0][2] == start and rows[1][0][3] == 4 * cb
    assert differ.padding == sum(pads)
