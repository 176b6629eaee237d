"""Scratch devices: the striped store's routing and accounting, and the placement model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cryosnap.engine import _split_pieces
from cryosnap.engine.items import Piece
from cryosnap.errors import StorageError
from cryosnap.storage import LocalStore
from cryosnap.storage.striped import Placement, StripedStore, device_of


def striped(tmp_path: Path, caps: list[int | None]) -> StripedStore:
    return StripedStore([LocalStore(tmp_path / f"d{i}") for i in range(len(caps))], caps)


def test_keys_route_by_device_suffix(tmp_path: Path) -> None:
    assert device_of("data/000000000001-r00000-ab12-d1.dat", 2) == 1
    assert device_of("data/000000000001-r00000-ab12-d7.dat", 2) == 0  # no such device
    assert device_of("data/000000000001-r00000-ab12.dat", 2) == 0
    assert device_of("versions/000000000001/COMMIT.json", 2) == 0
    store = striped(tmp_path, [None, 1000])
    w = store.open_writer("data/000000000001-r00000-ab12-d1.dat")
    w.write([b"x" * 300])
    w.commit()
    store.write("versions/000000000001/COMMIT.json", b"{}")
    assert (tmp_path / "d1" / "data").is_dir() and not (tmp_path / "d0" / "data").exists()
    assert (tmp_path / "d0" / "versions").is_dir()
    assert store.list("data") == ["data/000000000001-r00000-ab12-d1.dat"]
    assert store.free_bytes(1) == 700 and store.free_bytes(0) is None
    store.delete("data/000000000001-r00000-ab12-d1.dat")
    assert store.free_bytes(1) == 1000
    # Usage is counted again when the store is reopened.
    w = store.open_writer("data/000000000002-r00000-cd34-d1.dat")
    w.write([b"y" * 100])
    w.commit()
    assert striped(tmp_path, [None, 1000]).free_bytes(1) == 900


def _drive(placement: Placement, batches: int, nbytes: int) -> list[int]:
    """Place ``batches`` batches while every device is busy: bytes per device."""
    got = [0] * placement.devices
    for _ in range(batches):
        d = placement.choose(nbytes, reserve=nbytes)
        placement.enqueue(d, nbytes)
        got[d] += nbytes
    return got


def test_adaptive_split_is_proportional_to_measured_throughput(tmp_path: Path) -> None:
    placement = Placement(striped(tmp_path, [None, None]))
    placement.observe(0, 400 << 20, 1.0)  # 400 MiB/s
    placement.observe(1, 100 << 20, 1.0)  # 100 MiB/s
    got = _drive(placement, 100, 1 << 20)
    share = got[0] / sum(got)
    assert 0.78 <= share <= 0.82, got
    # Both finish at about the same time: the split that minimizes the time to durable.
    rates = placement.rates()
    assert rates[0] is not None and rates[1] is not None
    finish = [got[0] / rates[0], got[1] / rates[1]]
    assert max(finish) / min(finish) < 1.1


def test_unmeasured_devices_are_tried_and_written_bytes_leave_the_queue(tmp_path: Path) -> None:
    placement = Placement(striped(tmp_path, [None, None]))
    assert placement.rates() == [None, None]
    first = _drive(placement, 2, 1 << 20)
    assert first == [1 << 20, 1 << 20]  # no measurement: balanced
    placement.done(0, 1 << 20)
    placement.done(1, 1 << 20)
    assert placement.queued == [0, 0]


def test_other_strategies(tmp_path: Path) -> None:
    fastest = Placement(striped(tmp_path, [None, None]), strategy="fastest")
    fastest.observe(0, 100, 1.0)
    fastest.observe(1, 400, 1.0)
    assert _drive(fastest, 10, 10) == [0, 100]
    robin = Placement(striped(tmp_path, [None, None]), strategy="round_robin")
    assert _drive(robin, 10, 10) == [50, 50]
    with pytest.raises(ValueError, match="strategy"):
        Placement(striped(tmp_path / "one", [None]), strategy="random")


def test_capacity_is_respected_and_exhaustion_names_the_tier(tmp_path: Path) -> None:
    placement = Placement(striped(tmp_path, [3 << 20, None]))
    placement.observe(0, 1000 << 20, 1.0)  # much faster, but small
    placement.observe(1, 1 << 20, 1.0)
    got = _drive(placement, 10, 1 << 20)
    assert got[0] == 3 << 20 and got[1] == 7 << 20
    placement.release()
    full = Placement(striped(tmp_path / "f", [1 << 20]))
    with pytest.raises(StorageError, match=r"scratch tier .* is full"):
        full.choose(2 << 20, reserve=2 << 20)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    chunk=st.sampled_from([4, 8, 16]),
    limit=st.integers(1, 64),
)
def test_split_pieces_keeps_bytes_and_chunk_boundaries(
    sizes: list[int], chunk: int, limit: int
) -> None:
    pieces = []
    for blob, n in enumerate(sizes):
        data = np.arange(n, dtype=np.uint8) + blob
        pieces.append(Piece(blob, 0, memoryview(data.tobytes())))
    groups = _split_pieces(pieces, limit, chunk)
    flat = [p for g in groups for p in g]
    for blob, n in enumerate(sizes):
        parts = [p for p in flat if p.blob == blob]
        assert b"".join(bytes(p.view) for p in parts) == bytes(pieces[blob].view)
        offsets = [p.offset for p in parts]
        assert offsets == sorted(offsets)
        assert all(o % chunk == 0 for o in offsets)
        assert sum(p.view.nbytes for p in parts) == n


def test_the_device_list_of_a_scratch_tier_cannot_change_under_it(tmp_path: Path) -> None:
    from cryosnap.errors import CheckpointError

    striped(tmp_path, [None, None])
    striped(tmp_path, [None, None])  # the same list: fine
    with pytest.raises(CheckpointError, match="same order"):
        StripedStore([LocalStore(tmp_path / "d0")], [None])
    with pytest.raises(CheckpointError, match="same order"):
        StripedStore([LocalStore(tmp_path / "d0"), LocalStore(tmp_path / "other")], [None, None])
