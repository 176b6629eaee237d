"""cryosnap._native: every raw-memory call, and its fallback when the binding cannot load (no
ctypes symbol, xxhash's private extension renamed): the same digests, the same copies."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

import cryosnap._format.chunks as chunks
from cryosnap import _native

BIG_CHUNK = 256 << 10  # hashed by the native call


def _missing() -> object:
    raise OSError("no such library")


@pytest.fixture(params=["native", "fallback"])
def binding(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test twice: with what loads here, and with no native binding at all, as where
    ctypes is missing (the public xxhash API, numpy copies by address, no advice)."""
    if request.param == "fallback":
        monkeypatch.setattr(_native, "_lib", _native.Binding())
    return str(request.param)


def test_the_native_binding_loads_here() -> None:
    lib = _native._lib
    assert lib.memmove is not None and lib.xxh3 is not None
    assert _native.can_map() == hasattr(__import__("mmap"), "MAP_PRIVATE")


def test_a_renamed_xxhash_extension_falls_back_to_the_public_api(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lib = _native.bind(open_xxhash=_missing)
    assert lib.xxh3 is None and lib.memmove is not None
    monkeypatch.setattr(_native, "_lib", lib)
    data = np.random.default_rng(1).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    assert chunks.hash_chunks_released(data.data, BIG_CHUNK) == chunks.hash_chunks(
        data.data, BIG_CHUNK
    )


def test_an_extension_whose_hash_differs_is_not_used() -> None:
    class Digest:
        high64 = low64 = 0

    class Wrong:
        """An extension whose XXH3 answers something else (another version's variant)."""

        def __init__(self) -> None:
            self.XXH3_128bits_withSeed = lambda address, nbytes, seed: Digest()

    assert _native.bind(open_xxhash=Wrong).xxh3 is None


def test_a_missing_libc_leaves_copies_and_drops_advice_and_mappings() -> None:
    lib = _native.bind(open_libc=_missing)
    assert lib.madvise is None and lib.mmap is None and lib.memmove is not None


@pytest.mark.parametrize("chunk_bytes", [4096, 128 << 10, BIG_CHUNK, (1 << 20) + 3])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 128 << 10, (128 << 10) + 1, (3 << 20) + 17])
def test_hashing_gives_xxhash_digests(binding: str, chunk_bytes: int, nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    raw = data.tobytes()
    want = b"".join(
        xxhash.xxh3_128_digest(raw[s : s + chunk_bytes], 7) for s in range(0, nbytes, chunk_bytes)
    )
    assert _native.hash_chunks(data.data, chunk_bytes, 7) == want
    data.flags.writeable = False
    assert _native.hash_chunks(data.data, chunk_bytes, 7) == want
    assert _native.hash_chunks(memoryview(raw), chunk_bytes, 7) == want


def test_hash_each_gives_xxhash_digests(binding: str) -> None:
    rng = np.random.default_rng(2)
    views = [rng.integers(0, 256, n, dtype=np.uint8).data for n in (0, 5, 128 << 10, 1 << 20)]
    assert _native.hash_each(views, 0) == [xxhash.xxh3_128_digest(v, 0) for v in views]


def test_address_of_views_and_arrays(binding: str) -> None:
    arr = np.arange(100, dtype=np.uint8)
    assert _native.address_of(arr) == arr.ctypes.data
    assert _native.address_of(arr.data) == arr.ctypes.data
    assert _native.address_of(arr[10:].data) == arr.ctypes.data + 10
    arr.flags.writeable = False
    assert _native.address_of(arr.data) == arr.ctypes.data
    assert _native.address_of(memoryview(b"")) == 0
    assert _native.address_of(np.empty(0, np.uint8)) == 0


def test_memmove_and_zero_copy_the_same_bytes(binding: str) -> None:
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 10_000, dtype=np.uint8)
    dest = np.zeros(12_000, np.uint8)
    _native.memmove(dest.ctypes.data + 100, src.ctypes.data + 7, 9_000)
    _native.memmove(dest.ctypes.data, src.ctypes.data, 0)
    assert np.array_equal(dest[100:9_100], src[7:9_007])
    assert not dest[:100].any() and not dest[9_100:].any()
    # The loops' memmove (ctypes' own, or the wrapper without it) copies the same bytes.
    again = np.zeros(12_000, np.uint8)
    move = _native.memmove_fn()
    move(again.ctypes.data + 100, src.ctypes.data + 7, 9_000)
    move(again.ctypes.data, src.ctypes.data, 0)
    assert np.array_equal(again, dest)
    _native.zero(dest.ctypes.data + 200, 50)
    assert not dest[200:250].any() and dest[100:200].tolist() == src[7:107].tolist()


def test_populate_keeps_the_memory_as_it_is(binding: str) -> None:
    buf = np.random.default_rng(0).integers(0, 256, (4 << 20) + 123, dtype=np.uint8)
    before = buf.copy()
    _native.populate(buf.ctypes.data + 77, buf.nbytes - 100)
    _native.populate(buf.ctypes.data, 0)
    _native.dontneed(buf.ctypes.data, 0)
    assert np.array_equal(buf, before)
    fresh = np.empty(3 << 20, np.uint8)
    _native.populate(fresh.ctypes.data, fresh.nbytes)
    fresh[:] = 7
    assert (fresh == 7).all()


def test_populate_on_a_kernel_without_it_stops_asking(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def refuses(address: int, nbytes: int, advice: int) -> int:
        calls.append(advice)
        return -1

    lib = _native.Binding(madvise=refuses, get_errno=lambda: 22)  # EINVAL: advice unknown
    monkeypatch.setattr(_native, "_lib", lib)
    monkeypatch.setattr(_native, "_populate_works", True)  # restored after the test
    buf = np.empty(1 << 20, np.uint8)
    _native.populate(buf.ctypes.data, buf.nbytes)
    _native.populate(buf.ctypes.data, buf.nbytes)
    assert len(calls) == 1
    # Other advice is still given: into='s mapped pieces are unmapped on such a kernel too.
    _native.dontneed(buf.ctypes.data, buf.nbytes)
    assert calls == [_native._MADV_POPULATE_WRITE, _native._MADV_DONTNEED]


@pytest.mark.skipif(not _native.can_map(), reason="needs libc mmap")
def test_map_private_is_copy_on_write_and_holds_no_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        view = _native.map_private(fd, 256 * 64)
    finally:
        os.close(fd)
    assert view is not None and not view.readonly
    assert bytes(view[:256]) == bytes(range(256))
    view[0] = 99  # copy-on-write: the file keeps its byte
    assert path.read_bytes()[0] == 0 and view[0] == 99
    with pytest.raises(OSError):
        _native.map_private(-1, 4096)


def test_without_mmap_nothing_is_mapped(binding: str, tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        got = _native.map_private(fd, 4096)
    finally:
        os.close(fd)
    assert (got is None) == (binding == "fallback" or not _native.can_map())


def test_page_cached(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"y" * 8192)
    got = _native.page_cached(path, 0)
    assert got is (True if hasattr(os, "RWF_NOWAIT") else None)
    assert _native.page_cached(tmp_path / "missing", 0) is None


def test_no_other_module_of_the_package_touches_ctypes() -> None:
    """No module of the package but _native imports ctypes (the benchmark's own probes aside,
    wherever that code lives)."""
    import cryosnap

    root = Path(cryosnap.__file__).parent
    users = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if ("import ctypes" in p.read_text() or "from ctypes" in p.read_text())
        and not p.relative_to(root).parts[0].startswith("bench")
    )
    assert users == ["_native.py"]
