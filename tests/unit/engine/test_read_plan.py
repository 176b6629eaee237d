"""Properties of the pure read plan (engine/fetch/_plan.py) over random layouts: chunks back to
back, a gap apart, stored once and used twice, scattered; direct, placed and mapped blobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cryosnap._format.chunks import HASH_BYTES
from cryosnap.engine import ReadLimits, ResolvedBlob
from cryosnap.engine._resolved import PartChunks
from cryosnap.engine.fetch._plan import (
    _GATHER_WINDOW_BYTES,
    ReadPlan,
    gather_windows,
    plan_reads,
)

CB = 4096


@dataclass(frozen=True)
class Case:
    chunks: PartChunks
    view_bytes: list[int]
    direct: list[bool]
    placed: list[bool]
    mapped_files: list[int]
    limits: ReadLimits


@st.composite
def cases(draw: st.DrawFn) -> Case:
    nfiles = draw(st.integers(1, 3))
    ends = [0] * nfiles  # where each file's next fresh chunk goes
    stored: list[tuple[int, int]] = []  # whole chunks written so far: (file, offset)
    blobs = []
    for b in range(draw(st.integers(0, 7))):
        nbytes = draw(st.integers(0, 12 * CB))
        n = -(-nbytes // CB)
        files, offsets = np.zeros(n, np.int32), np.zeros(n, np.int64)
        f = draw(st.integers(0, nfiles - 1))
        for c in range(n):
            whole = c < n - 1 or nbytes % CB == 0
            how = draw(st.sampled_from(["next", "next", "next", "gap", "file", "dup"]))
            if how == "dup" and whole and stored:
                files[c], offsets[c] = draw(st.sampled_from(stored))
                continue
            if how == "file":
                f = draw(st.integers(0, nfiles - 1))
            if how == "gap":
                ends[f] += draw(st.sampled_from([1, 100, CB, 3 * CB, 20 * CB]))
            files[c], offsets[c] = f, ends[f]
            ends[f] += CB
            if whole:
                stored.append((f, int(offsets[c])))
        hashes = np.zeros((n, HASH_BYTES), np.uint8)
        blobs.append(ResolvedBlob(f"b{b}", nbytes, files, offsets, hashes))
    nb = len(blobs)
    views = [b.nbytes if draw(st.booleans()) else b.nbytes + 8 for b in blobs]
    return Case(
        chunks=PartChunks.of(blobs),
        view_bytes=views,
        direct=draw(st.lists(st.booleans(), min_size=nb, max_size=nb)),
        placed=draw(st.lists(st.booleans(), min_size=nb, max_size=nb)),
        mapped_files=draw(st.lists(st.integers(0, nfiles - 1), unique=True)),
        limits=ReadLimits(
            io_batch_bytes=draw(st.sampled_from([CB, 5 * CB, 64 * CB])),
            bounce_bytes=draw(st.sampled_from([1, CB, 3 * CB, 16 * CB])),
            gap_bytes=draw(st.sampled_from([0, 100, CB, 4 * CB])),
            fragmented_runs=draw(st.sampled_from([0, 1, 3, 256])),
        ),
    )


def _plan(case: Case) -> ReadPlan:
    return plan_reads(
        case.chunks,
        CB,
        view_bytes=case.view_bytes,
        direct=case.direct,
        placed=case.placed,
        mapped_files=case.mapped_files,
        limits=case.limits,
    )


def _runs(plan: ReadPlan, reads: Any) -> list[tuple[int, list[int], list[int]]]:
    return [run for _f, runs in reads.tasks(plan.pieces.offset) for run in runs]


@settings(max_examples=300, deadline=None)
@given(cases())
def test_every_chunk_asked_for_is_covered_exactly_once(case: Case) -> None:
    plan = _plan(case)
    c, p = case.chunks, plan.pieces
    covered = np.zeros(int(c.starts[-1]), np.int64)
    for blob, start, nbytes, file, offset in zip(
        p.blob.tolist(),
        p.start.tolist(),
        p.nbytes.tolist(),
        p.file.tolist(),
        p.offset.tolist(),
        strict=True,
    ):
        assert start % CB == 0 and nbytes > 0
        first, last = start // CB, -(-(start + nbytes) // CB)
        ids = c.starts[blob] + np.arange(first, last)
        covered[ids] += 1
        # The piece's chunks lie back to back in its file, from its offset.
        assert (c.files[ids] == file).all()
        assert (c.offsets[ids] == offset + CB * np.arange(last - first)).all()
        assert nbytes == min(last * CB, int(c.nbytes[blob])) - start
    for g in plan.gathers:
        ids = c.starts[g.blob] + g.chunks
        assert (c.files[ids] == g.file).all()
        covered[ids] += 1
    assert (covered == 1).all()


@settings(max_examples=300, deadline=None)
@given(cases())
def test_each_pass_reads_or_hashes_each_of_its_pieces_once(case: Case) -> None:
    plan = _plan(case)
    p = plan.pieces
    n = len(p.blob)
    first = np.concatenate([plan.first.pids, plan.first_mapped.pids])
    assert sorted(first.tolist()) == list(range(n))
    second = np.concatenate([plan.second.pids, plan.second_mapped.pids])
    assert sorted(second.tolist()) == np.flatnonzero(p.direct).tolist()
    mapped = np.isin(p.file, case.mapped_files)
    wanted = (np.array(case.placed, bool) | np.array(case.direct, bool))[p.blob] if n else p.direct
    assert (p.mapped == (wanted & mapped)).all()
    assert set(plan.staged) == {g.blob for g in plan.gathers if case.direct[g.blob]}


@settings(max_examples=300, deadline=None)
@given(cases())
def test_pieces_and_runs_are_sorted_by_file_then_offset(case: Case) -> None:
    plan = _plan(case)
    p = plan.pieces
    # Files in the order the blobs first use them (the order reads fail in), then offsets.
    order = list(dict.fromkeys(case.chunks.files.tolist()))
    keys = [(order.index(f), o) for f, o in zip(p.file.tolist(), p.offset.tolist(), strict=True)]
    assert keys == sorted(keys)
    for reads in (plan.first, plan.second):
        pids = reads.pids.tolist()
        assert [keys[i] for i in pids] == sorted(keys[i] for i in pids)
        for f, runs in reads.tasks(p.offset):
            assert all(p.file[pid] == f for _o, pids_, _g in runs for pid in pids_)


@settings(max_examples=300, deadline=None)
@given(cases())
def test_merged_gaps_never_exceed_the_limit_and_nothing_unclaimed_is_read(case: Case) -> None:
    plan = _plan(case)
    p, c = plan.pieces, case.chunks
    for reads in (plan.first, plan.second):
        for offset, pids, gaps in _runs(plan, reads):
            assert gaps[0] == 0 and offset == p.offset[pids[0]]
            at = offset
            for pid, gap in zip(pids, gaps, strict=True):
                assert 0 <= gap <= case.limits.gap_bytes
                at += gap
                assert at == p.offset[pid]  # every byte read is a piece's or a short gap's
                at += int(p.nbytes[pid])
            # The run stays inside what the part claims of its file.
            mine = c.files == p.file[pids[0]]
            assert offset >= c.offsets[mine].min()
            assert at <= max(
                int(p.offset[q] + p.nbytes[q])
                for q in range(len(p.blob))
                if p.file[q] == p.file[pids[0]]
            )


@settings(max_examples=300, deadline=None)
@given(cases())
def test_pieces_keep_to_the_bounce_size(case: Case) -> None:
    plan = _plan(case)
    p, lim = plan.pieces, case.limits
    per = max(lim.bounce_bytes // CB, 1) * CB
    assert (p.nbytes <= per).all()


@settings(max_examples=200, deadline=None)
@given(cases())
def test_hash_slices_whole_views_and_purity(case: Case) -> None:
    plan = _plan(case)
    p, c = plan.pieces, case.chunks
    assert (p.hash_lo == (c.starts[:-1][p.blob] + p.start // CB) * HASH_BYTES).all()
    assert (p.hash_hi - p.hash_lo == -(-p.nbytes // CB) * HASH_BYTES).all()
    views = np.asarray(case.view_bytes, np.int64)
    if len(p.blob):
        assert (p.whole == ((p.start == 0) & (p.nbytes == views[p.blob]))).all()
    again = _plan(case)
    for name in ("blob", "start", "nbytes", "file", "offset", "direct", "mapped"):
        assert np.array_equal(getattr(p, name), getattr(again.pieces, name))
    assert plan.first.tasks(p.offset) == again.first.tasks(p.offset)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 400), min_size=1, max_size=300),
    st.sampled_from([CB, 64 << 10]),
    st.sampled_from([0, CB, ReadLimits().gap_bytes]),
)
def test_gather_windows_cover_the_offsets_without_wide_gaps(
    slots: list[int], cb: int, gap_bytes: int
) -> None:
    offs = np.array(sorted(s * cb // 4 for s in slots), np.int64)
    windows = gather_windows(offs, cb, gap_bytes)
    assert windows[0][0] == 0 and windows[-1][1] == len(offs)
    for (a, z, lo, hi), nxt in zip(windows, [*windows[1:], None], strict=True):
        assert a < z and lo == offs[a] and hi == offs[z - 1] + cb
        assert nxt is None or nxt[0] == z
        assert (np.diff(offs[a:z]) - cb <= gap_bytes).all()
        assert hi - lo <= max(_GATHER_WINDOW_BYTES, cb) or z - a == 1
