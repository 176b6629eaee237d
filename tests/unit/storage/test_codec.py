"""Coded data files (docs/FORMAT.md, "Coded data files"): frames written by CodedWriter read
back through DecodedStore as the plain bytes, any range; damage is an IntegrityError."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cryosnap._format import codec
from cryosnap._format.codec import RAW, ZSTD, FrameEncoder, FrameIndex, shuffle, unshuffle
from cryosnap.errors import IntegrityError, MissingDependencyError
from cryosnap.storage import CodedWriter, LocalStore, coded_size, decoded, read_index
from cryosnap.storage import _codec as store_codec


def _payload(seed: int, n: int) -> bytes:
    """Bytes that compress (float32 with a few significant bits, zeros) and bytes that do
    not (random), mixed."""
    rng = np.random.default_rng(seed)
    floats = (rng.standard_normal(n // 8 + 1) * 1e-3).astype(np.float32).tobytes()
    out = (floats + bytes(n // 4) + rng.bytes(n // 4))[:n]
    return out + rng.bytes(n - len(out))


def _write(store: LocalStore, key: str, data: bytes, cuts: list[int]) -> CodedWriter:
    writer = CodedWriter(store.open_writer(key))
    at = 0
    for c in [*sorted(cuts), len(data)]:
        writer.write([memoryview(data)[at:c]])
        at = c
    assert writer.tell() == len(data)
    writer.commit()
    return writer


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 70_000),
    seed=st.integers(0, 2**32 - 1),
    frame=st.sampled_from([4096, 4099, 10_000, 1 << 16]),
    data=st.data(),
)
def test_every_range_reads_back_the_plain_bytes(
    tmp_path_factory: pytest.TempPathFactory, n: int, seed: int, frame: int, data: st.DataObject
) -> None:
    store = LocalStore(tmp_path_factory.mktemp("coded"))
    payload = _payload(seed, n)
    cuts = data.draw(st.lists(st.integers(0, n), max_size=4))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(store_codec, "FRAME_BYTES", frame)
        writer = _write(store, "data/f.dat", payload, cuts)
    index = read_index(store, "data/f.dat")
    assert index.plain_size == n == writer.stats.plain_bytes
    assert store.size("data/f.dat") == index.stored_size == writer.stats.stored_bytes
    assert len(index.plain_bytes) == -(-n // frame)
    view = decoded(store, {"data/f.dat"})
    assert view.size("data/f.dat") == n and view.read("data/f.dat") == payload
    ranges = data.draw(
        st.lists(st.tuples(st.integers(0, n), st.integers(0, n)), min_size=1, max_size=4)
    )
    bufs = [(lo, [memoryview(bytearray(max(0, hi - lo)))]) for lo, hi in ranges]
    view.read_ranges("data/f.dat", bufs)
    for lo, (buf,) in bufs:
        assert bytes(buf) == payload[lo : lo + buf.nbytes]
    assert coded_size(store, "data/f.dat", n) and not coded_size(store, "data/f.dat", n + 1)


def test_compressible_frames_are_zstd_and_random_ones_raw(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    rng = np.random.default_rng(1)
    floats = (rng.standard_normal(1 << 18) * 1e-3).astype(np.float32).tobytes()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(store_codec, "FRAME_BYTES", 1 << 20)
        _write(store, "data/a.dat", floats + rng.bytes(1 << 20), [])
    index = read_index(store, "data/a.dat")
    assert index.hows.tolist() == [ZSTD, RAW]
    assert index.elems.tolist() == [4, 1]  # float32 shuffled by 4 bytes
    assert int(index.stored_bytes[0]) < (1 << 20) * 0.95
    assert int(index.stored_bytes[1]) == 1 << 20


@given(st.binary(max_size=300), st.sampled_from([1, 2, 4, 8]))
def test_shuffle_is_undone(data: bytes, elem: int) -> None:
    out = memoryview(bytearray(len(data)))
    unshuffle(bytes(shuffle(memoryview(data), elem)), elem, out)
    assert bytes(out) == data


def test_float_frames_pick_their_element_size() -> None:
    rng = np.random.default_rng(2)
    enc = FrameEncoder()
    for dtype, elem in (("<f2", 2), ("<f4", 4), ("<f8", 8)):
        a = (rng.standard_normal(1 << 16) * 1e-3).astype(dtype)
        assert enc.encode(memoryview(a.tobytes()))[1:] == (elem, ZSTD)


@pytest.mark.parametrize("where", ["frame", "index", "trailer"])
def test_damage_is_an_integrity_error(tmp_path: Path, where: str) -> None:
    store = LocalStore(tmp_path)
    payload = _payload(3, 50_000)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(store_codec, "FRAME_BYTES", 8192)
        _write(store, "data/f.dat", payload, [])
    path = tmp_path / "data/f.dat"
    raw = bytearray(path.read_bytes())
    at = {"frame": 100, "index": len(raw) - codec.TRAILER_BYTES - 20, "trailer": len(raw) - 3}
    raw[at[where]] ^= 0x55
    path.write_bytes(bytes(raw))
    view = decoded(store, {"data/f.dat"})
    # A zstd frame carries the checksum of what it inflates to; raw frames are caught by the
    # chunk hashes of the plain bytes (tests/unit/run/test_codec.py).
    with pytest.raises(IntegrityError, match=r"data/f\.dat"):
        view.read("data/f.dat")


def test_a_plain_file_is_no_coded_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.write("data/p.dat", _payload(4, 10_000))
    assert not coded_size(store, "data/p.dat", 10_000)
    with pytest.raises(IntegrityError, match="not a coded data file"):
        read_index(store, "data/p.dat")


def test_frame_index_refuses_sizes_that_do_not_add_up() -> None:
    tail = FrameIndex.tail([(100, 50, 4, ZSTD)])
    table, trailer = tail[:32], tail[32:]
    with pytest.raises(IntegrityError, match="malformed"):
        FrameIndex.parse(table, trailer, 50 + len(tail) + 1, "f")
    assert FrameIndex.parse(table, trailer, 50 + len(tail), "f").plain_size == 100


def test_without_zstandard_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'cryosnap\[zstd\]'"):
        FrameEncoder()
    out = memoryview(bytearray(4))
    with pytest.raises(MissingDependencyError, match="codec 'shuffle-zstd'"):
        codec.decode_frame(b"xxxx", 4, 1, ZSTD, out)
