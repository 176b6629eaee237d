"""Compaction in the part writer (engine/write/_compact.py): which older files a part
evacuates (read for under LIVE_FRACTION of their bytes), what it copies, and that the part
reads back exactly; the commit's file list is exact either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cryosnap import engine
from cryosnap._run.capture.staging import direct_batches
from cryosnap._state import flatten
from cryosnap.engine.write._compact import LIVE_FRACTION
from cryosnap.storage import LocalStore

CHUNK = 4096


def _write(
    store: LocalStore,
    state: dict[str, Any],
    step: int,
    base: engine.PartResult | None = None,
    *,
    compact: bool = True,
) -> engine.PartResult:
    flat = flatten(state)
    writer = engine.PartWriter(
        store,
        step,
        flat,
        chunk_bytes=CHUNK,
        base=None if base is None else base.resolved(),
        index=None if base is None else dict(base.new_index),
        compact=compact,
    )
    for batch in direct_batches(flat, batch_bytes=3 * CHUNK, chunk_bytes=CHUNK):
        writer.add(batch.pieces)
    return writer.finish()


def _chunks(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, n * CHUNK, dtype=np.uint8)


@pytest.mark.parametrize(("changing", "moved"), [(7, False), (8, True)])
def test_a_file_is_evacuated_below_the_live_fraction(
    tmp_path: Path, changing: int, moved: bool
) -> None:
    """One unchanged chunk beside ``changing`` changed ones: at 1/8 of the file it stays
    referenced, below it is copied."""
    store = LocalStore(tmp_path)
    frozen = _chunks(1, 0)
    first = _write(store, {"a": _chunks(changing, 1), "b": frozen}, 0)
    (old,) = first.manifest.data_files
    live = CHUNK / store.size(old)
    assert (live < LIVE_FRACTION) is moved
    second = _write(store, {"a": _chunks(changing, 2), "b": frozen}, 1, first)
    (own,) = [f for f in second.manifest.data_files if f != old]
    # The commit names exactly the files the part reads: the old one only if not evacuated.
    assert second.used_files() == ({own} if moved else {own, old})
    assert second.compacted_bytes == (CHUNK if moved else 0)
    assert second.written_bytes == changing * CHUNK + second.compacted_bytes
    resolved = second.resolved()
    at = resolved.blob_index("b")
    assert at is not None
    b = resolved.blobs[at]
    assert resolved.files[int(b.files[0])] == (own if moved else old)
    offset = int(b.offsets[0])
    got = bytearray(CHUNK)
    store.read_into(resolved.files[int(b.files[0])], offset, [memoryview(got)])
    assert bytes(got) == frozen.tobytes()
    if moved:  # the copy is the content index's location now: the next part reads it
        assert second.new_index[bytes(b.hashes[0])] == (own, offset)


def test_without_compaction_the_files_are_still_exact(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    frozen = _chunks(1, 0)
    parts = [_write(store, {"a": _chunks(8, 1), "b": frozen}, 0)]
    for step in (1, 2):
        state = {"a": _chunks(8, step + 1), "b": frozen}
        parts.append(_write(store, state, step, parts[-1], compact=False))
    (first,), (own,) = parts[0].manifest.data_files, parts[2].manifest.data_files
    # Step 2 reads its own file and the first one, not step 1's (its base's, which a
    # superset of the base's files named before): retention can drop step 1's file with it.
    assert parts[2].used_files() == {own, first}
    assert parts[2].compacted_bytes == 0
