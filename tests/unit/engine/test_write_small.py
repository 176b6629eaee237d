"""The writer's path for whole blobs of one chunk (most small leaves: PartWriter._diff_ones):
the same part, byte for byte, as the general chunk-by-chunk path."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cryosnap import engine
from cryosnap._format.blobs import INHERITED, STORED
from cryosnap._format.chunks import hash_bytes, merkle_root
from cryosnap._run.capture.staging import direct_batches
from cryosnap._state import flatten
from cryosnap.engine.items import Batch, Item, Piece
from cryosnap.errors import CheckpointError
from cryosnap.storage import LocalStore

CHUNK = 4096


@dataclass(slots=True)
class _Slow(Piece):
    """A piece the writer does not recognise as a plain one: it takes the general path."""


def _batches(flat: Any, slow: bool, batch_bytes: int) -> list[Batch]:
    out = []
    for b in direct_batches(flat, batch_bytes=batch_bytes, chunk_bytes=CHUNK):
        pieces: list[Item] = [
            _Slow(p.blob, p.offset, p.view) if slow and isinstance(p, Piece) else p
            for p in b.pieces
        ]
        out.append(Batch(pieces))
    return out


def _write_part(
    root: Path,
    state: dict[str, Any],
    step: int,
    *,
    slow: bool,
    base: engine.PartResult | None = None,
    batch_bytes: int = 3 * CHUNK,
) -> engine.PartResult:
    flat = flatten(state)
    writer = engine.PartWriter(
        LocalStore(root),
        step,
        flat,
        chunk_bytes=CHUNK,
        base=None if base is None else base.resolved(),
        index=None if base is None else dict(base.new_index),
    )
    for batch in _batches(flat, slow, batch_bytes):
        writer.add(batch.pieces)
    return writer.finish()


def _same_parts(a: engine.PartResult, b: engine.PartResult, ra: Path, rb: Path) -> None:
    ma, mb = a.manifest, b.manifest
    assert ma.blobs == mb.blobs
    assert ma.data_files == mb.data_files
    assert (a.written_bytes, a.chunks, a.new_chunks, a.root) == (
        b.written_bytes,
        b.chunks,
        b.new_chunks,
        b.root,
    )
    assert a.new_index == b.new_index
    for f in ma.data_files:
        assert (ra / f).read_bytes() == (rb / f).read_bytes()


leaf_sizes = st.lists(st.integers(0, 3 * CHUNK), min_size=1, max_size=30)


@settings(max_examples=30, deadline=None)
@given(leaf_sizes, st.integers(0, 2**32 - 1), st.sampled_from([CHUNK, 3 * CHUNK, 1 << 20]))
def test_one_chunk_leaves_write_as_the_general_path(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], seed: int, batch_bytes: int
) -> None:
    """Full then incremental parts of leaves of every size around one chunk, with repeated
    content (stored once), leaves unchanged since the base (inherited) and leaves changed back
    to content of the base (references): fast and general paths write the same."""
    rng = np.random.default_rng(seed)
    # Contents from a few patterns: repeated within a version and across versions.
    patterns = [np.zeros(3 * CHUNK, np.uint8), np.ones(3 * CHUNK, np.uint8)]
    patterns.append(rng.integers(0, 256, 3 * CHUNK).astype(np.uint8))

    def leaf(n: int) -> np.ndarray[Any, Any]:
        if rng.random() < 0.3:
            return rng.integers(0, 256, n).astype(np.uint8)
        return patterns[rng.integers(0, 3)][:n].copy()

    state = {f"l{i}": leaf(n) for i, n in enumerate(sizes)}
    later = {k: v.copy() if rng.random() < 0.5 else leaf(len(v)) for k, v in state.items()}
    roots = [tmp_path_factory.mktemp("fast"), tmp_path_factory.mktemp("slow")]
    parts = []
    for root, slow in zip(roots, (False, True), strict=True):
        tokens = itertools.count()
        mp = pytest.MonkeyPatch()
        mp.setattr(secrets, "token_hex", lambda _n, t=tokens: f"{next(t):08x}")
        try:
            first = _write_part(root, state, 1, slow=slow, batch_bytes=batch_bytes)
            second = _write_part(root, later, 2, slow=slow, base=first, batch_bytes=batch_bytes)
        finally:
            mp.undo()
        parts.append((first, second))
    for (fast, slow_part), (ra, rb) in zip(zip(*parts, strict=True), [roots] * 2, strict=True):
        _same_parts(fast, slow_part, ra, rb)


def test_one_chunk_leaves_are_one_segment_each(tmp_path: Path) -> None:
    """Repeated content is stored once; an unchanged leaf is inherited; each root is the
    leaf's chunk hash."""
    a, b = np.arange(100, dtype=np.int32), np.arange(100, 200, dtype=np.int32)
    state = {"a": a, "b": b, "a2": a.copy(), "e": np.empty(0, np.int8)}
    first = _write_part(tmp_path, state, 1, slow=False)
    rows = [e.table.tolist() for e in first.manifest.blobs]
    assert rows == [
        [[STORED, 0, 0, 400]],
        [[STORED, 0, 400, 400]],
        [[STORED, 0, 0, 400]],  # a2: the bytes of a
        [],
    ]
    assert [e.root for e in first.manifest.blobs[:3]] == [
        hash_bytes(a.tobytes()),
        hash_bytes(b.tobytes()),
        hash_bytes(a.tobytes()),
    ]
    assert first.manifest.blobs[3].root == merkle_root(b"")
    assert first.written_bytes == 800 and first.chunks == 3 and first.new_chunks == 2
    state["b"] = b + 1
    second = _write_part(tmp_path, state, 2, slow=False, base=first)
    kinds = [e.table[:, 0].tolist() for e in second.manifest.blobs]
    assert kinds == [[INHERITED], [STORED], [INHERITED], []]
    assert second.written_bytes == 400 and second.new_chunks == 1
    assert second.base is not None
    used = set(second.manifest.data_files) | set(second.base.used_files())
    assert second.used_files() == used == {*first.manifest.data_files, *second.manifest.data_files}


def test_a_leaf_added_twice_is_captured_incompletely(tmp_path: Path) -> None:
    flat = flatten({"w": np.arange(10, dtype=np.uint8)})
    writer = engine.PartWriter(LocalStore(tmp_path), 3, flat, chunk_bytes=CHUNK)
    view = flat.blobs[0].host_view()
    writer.add([Piece(0, 0, view), Piece(0, 0, view)])
    try:
        with pytest.raises(CheckpointError, match="step 3: leaf w was captured incompletely"):
            writer.finish()
    finally:
        writer.abort()


def test_blob_root_of_one_chunk_leaves(tmp_path: Path) -> None:
    flat = flatten({"a": np.arange(10, dtype=np.uint8), "b": np.arange(3 * CHUNK) % 7})
    writer = engine.PartWriter(LocalStore(tmp_path), 3, flat, chunk_bytes=CHUNK)
    for batch in direct_batches(flat, batch_bytes=1 << 20, chunk_bytes=CHUNK):
        writer.add(batch.pieces)
    try:
        assert writer.blob_root(0) == hash_bytes(flat.blobs[0].host_view())
        part = writer.finish()
        assert [writer.blob_root(i) for i in range(2)] == [e.root for e in part.manifest.blobs]
    finally:
        writer.abort()


def test_a_direct_save_leaves_the_gc_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cryosnap.save keeps the cyclic GC paused while the version is written, then resumes
    it, also when the save fails."""
    import gc

    import cryosnap

    assert gc.isenabled()
    cryosnap.save(tmp_path / "run", {"a": np.arange(10)}, step=1)
    assert gc.isenabled()
    with pytest.raises(cryosnap.CheckpointExistsError):
        cryosnap.save(tmp_path / "run", {"a": np.arange(10)}, step=1)
    assert gc.isenabled()

    def fail(_self: Any) -> None:
        assert not gc.isenabled()  # paused while the version is written
        raise CheckpointError("no manifest today")

    with monkeypatch.context() as m:
        m.setattr(engine.PartWriter, "finish", fail)
        with pytest.raises(CheckpointError, match="no manifest today"):
            cryosnap.save(tmp_path / "run", {"a": np.arange(10)}, step=3)
    assert gc.isenabled()
    gc.disable()
    try:
        cryosnap.save(tmp_path / "run", {"a": np.arange(10)}, step=2)
        assert not gc.isenabled()
    finally:
        gc.enable()
