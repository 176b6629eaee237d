"""capture_to_slabs: which chunks it copies, which it leaves unchanged, which it hashes in place
(another rank's share of a replicated blob), and the writer's side of hashed runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cryosnap import engine
from cryosnap._format.chunks import chunk_count, hash_chunks
from cryosnap._run.capture.staging import StagingPool, capture_to_slabs
from cryosnap._run.results import CaptureTracker
from cryosnap._state import flatten
from cryosnap.engine.items import Batch, Hashed, Piece, Unchanged
from cryosnap.errors import CheckpointError
from cryosnap.storage import LocalStore

CHUNK = 256


def capture(
    state: Any,
    *,
    changed: dict[int, Any] | None = None,
    foreign: dict[int, Any] | None = None,
    slab_bytes: int = 4 * CHUNK,
) -> tuple[Any, list[Batch], int]:
    flat = flatten(state)
    pool = StagingPool(slab_bytes=slab_bytes, budget_bytes=None)
    batches: list[Batch] = []
    copied = capture_to_slabs(
        flat,
        pool,
        chunk_bytes=CHUNK,
        emit=batches.append,
        tracker=CaptureTracker(len(flat.blobs)),
        changed=changed,
        foreign=foreign,
    )
    return flat, batches, copied


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 9 * CHUNK + 7), min_size=1, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_each_chunk_is_copied_hashed_or_left_unchanged(sizes: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    state = {f"b{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    flat = flatten(state)
    changed, foreign = {}, {}
    for i, blob in enumerate(flat.blobs):
        n = chunk_count(blob.nbytes, CHUNK)
        if rng.random() < 0.7:
            foreign[i] = rng.random(n) < 0.5
        if rng.random() < 0.5:
            changed[i] = rng.random(n) < 0.6
    flat, batches, copied = capture(state, changed=changed, foreign=foreign)
    items = [p for b in batches for p in b.pieces]
    assert sum(b.nbytes for b in batches) == flat.logical_bytes
    want_copied = 0
    for i, blob in enumerate(flat.blobs):
        data = blob.host_view()
        n = chunk_count(blob.nbytes, CHUNK)
        kinds = np.full(n, "copy", object)
        if i in foreign:
            kinds[foreign[i]] = "hash"
        if i in changed:
            kinds[~changed[i]] = "same"
        seen = np.full(n, "", object)
        for p in (p for p in items if p.blob == i):
            if isinstance(p, Piece):
                assert bytes(p.view) == bytes(data[p.offset : p.offset + p.view.nbytes])
                lo, hi, kind = p.offset, p.offset + p.view.nbytes, "copy"
            elif isinstance(p, Hashed):
                assert p.digests == hash_chunks(data[p.offset : p.offset + p.nbytes], CHUNK)
                lo, hi, kind = p.offset, p.offset + p.nbytes, "hash"
            else:
                assert isinstance(p, Unchanged)
                lo, hi, kind = p.first * CHUNK, p.first * CHUNK + p.nbytes, "same"
            assert lo % CHUNK == 0 and (hi % CHUNK == 0 or hi == blob.nbytes)
            assert (seen[lo // CHUNK : -(-hi // CHUNK)] == "").all()
            seen[lo // CHUNK : -(-hi // CHUNK)] = kind
        assert list(seen) == list(kinds)
        want_copied += sum(
            min(CHUNK, blob.nbytes - c * CHUNK) for c in range(n) if kinds[c] == "copy"
        )
    assert copied == want_copied


def test_a_hashed_run_of_this_ranks_own_share_is_refused(tmp_path: Path) -> None:
    """The capture and the writer must agree on the split: a hashed run the writer itself
    should write would leave chunks unwritten, so the version fails, naming the leaf."""
    state = {"w": np.arange(4 * CHUNK, dtype=np.uint8)}
    flat = flatten(state)
    owners = np.array([0, 0, 1, 1], np.int32)
    writer = engine.PartWriter(
        LocalStore(tmp_path), 3, flat, chunk_bytes=CHUNK, rank=0, shares={0: owners}
    )
    data = flat.blobs[0].host_view()
    try:
        with pytest.raises(CheckpointError, match=r"step 3: leaf w: chunks 1\.\.2 were hashed"):
            writer.add([Hashed(0, CHUNK, 2 * CHUNK, hash_chunks(data[CHUNK : 3 * CHUNK], CHUNK))])
    finally:
        writer.abort()


def test_torch_pieces_small_and_large_land_byte_for_byte() -> None:
    """Small pieces of host tensors are memmoved, large ones copied by torch: the slabs hold
    the leaves' exact bytes, including an offset view, a Parameter and non-float dtypes."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(7)
    base = torch.randn(3 << 18, generator=g)  # 3 MiB: large pieces
    state = {
        "big": base,
        "tail": torch.randn(700_001, generator=g),  # crosses slabs, odd size
        "small": [torch.randn(n, generator=g) for n in (1, 3, 64, 1000, 4097)],
        "ints": torch.arange(333, dtype=torch.int16),
        "flags": torch.rand(77, generator=g) > 0.5,
        "view": torch.randn(64, 64, generator=g)[5:20],  # storage offset, contiguous
        "param": torch.nn.Parameter(torch.randn(10, generator=g)),
    }
    flat = flatten(state)
    chunk = 64 << 10
    pool = StagingPool(slab_bytes=4 << 20, budget_bytes=None)
    batches: list[Batch] = []
    copied = capture_to_slabs(
        flat,
        pool,
        chunk_bytes=chunk,
        emit=batches.append,
        tracker=CaptureTracker(len(flat.blobs)),
    )
    assert copied == flat.logical_bytes
    got = {i: bytearray(b.nbytes) for i, b in enumerate(flat.blobs)}
    for batch in batches:
        for p in batch.pieces:
            assert isinstance(p, Piece)
            got[p.blob][p.offset : p.offset + p.view.nbytes] = p.view
    for i, blob in enumerate(flat.blobs):
        assert bytes(got[i]) == bytes(blob.host_view()), blob.path
