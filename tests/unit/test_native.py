"""cryosnap._native: every raw-memory call, and its fallback when the binding cannot load (no
ctypes symbol, xxhash's private extension renamed): the same digests, the same copies."""

from __future__ import annotations

import dataclasses
import errno
import os
import sys
import threading
from pathlib import Path
from typing import Any

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
    assert (lib.process_vm_readv is not None) == sys.platform.startswith("linux")


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


def _leaf_arrays() -> list[np.ndarray]:
    base = np.arange(240, dtype=np.float32)
    read_only = base.copy()
    read_only.flags.writeable = False
    return [
        base,  # writable, C order
        base[7:],  # a view inside another array
        read_only,
        np.asfortranarray(base.reshape(12, 20)),
        base.reshape(12, 20)[:, 3:],  # not contiguous
        base[::-2],  # negative strides
        np.array(["2026-12-06", "1970-01-01"], "datetime64[D]"),  # buffers refuse its dtype
        np.zeros(3, [("id", "<i4"), ("w", ">f8")]),
        np.array(5, np.int16),  # 0-d
        np.empty((0, 4), np.float32),
    ]


def test_leaf_address_is_the_first_element_of_any_array(binding: str) -> None:
    for arr in _leaf_arrays():
        assert _native.leaf_address(arr) == arr.ctypes.data, (arr.dtype, arr.strides)


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


def _pieces(seed: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A source buffer and ``count`` pieces of it (empty ones, tiny ones, a few of a MiB)
    scattered over a destination buffer: (source, destination offsets, source offsets,
    sizes), the destinations apart with a gap of 1-9 bytes after each."""
    rng = np.random.default_rng(seed)
    sizes = rng.choice([0, 1, 7, 256, 4096, 13_000], count).astype(np.int64)
    sizes[rng.choice(count, 3, replace=False)] = (1 << 20) + 3
    src_at = rng.integers(0, 4096, count).astype(np.int64)
    source = rng.integers(0, 256, int((src_at + sizes).max()), dtype=np.uint8)
    dest_at = np.concatenate([[0], np.cumsum(sizes + rng.integers(1, 10, count))[:-1]])
    return source, dest_at, src_at, sizes


def _expected(source: np.ndarray, dest_at: Any, src_at: Any, sizes: Any, n: int) -> np.ndarray:
    out = np.zeros(n, np.uint8)
    for d, s, k in zip(dest_at.tolist(), src_at.tolist(), sizes.tolist(), strict=True):
        out[d : d + k] = source[s : s + k]
    return out


@pytest.fixture
def split(monkeypatch: pytest.MonkeyPatch) -> None:
    """copy_pieces splits however few bytes it copies between its threads."""
    monkeypatch.setattr(_native, "_PARALLEL_MIN_BYTES", 0)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_pieces_copies_every_piece_and_nothing_else(
    binding: str, threads: int, split: None
) -> None:
    # More pieces than one vectored call takes, in parts of about equal bytes.
    source, dest_at, src_at, sizes = _pieces(threads, 2 * _native.IOV_MAX + 77)
    n = int((dest_at + sizes).max()) + 64
    dest = np.zeros(n, np.uint8)
    _native.copy_pieces(
        dest_at + dest.ctypes.data, src_at + source.ctypes.data, sizes, threads=threads
    )
    assert np.array_equal(dest, _expected(source, dest_at, src_at, sizes, n))
    _native.copy_pieces(np.zeros(0), np.zeros(0), np.zeros(0), threads=threads)  # nothing
    with pytest.raises(ValueError, match="differ"):
        _native.copy_pieces(dest_at[:3], src_at[:2], sizes[:3])


def test_copy_pieces_where_no_thread_can_start(
    monkeypatch: pytest.MonkeyPatch, split: None
) -> None:
    """At interpreter shutdown (a save from an atexit handler) no thread starts: the caller
    copies every part itself."""

    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)
    source, dest_at, src_at, sizes = _pieces(5, 500)
    n = int((dest_at + sizes).max())
    dest = np.zeros(n, np.uint8)
    _native.copy_pieces(dest_at + dest.ctypes.data, src_at + source.ctypes.data, sizes, threads=3)
    assert np.array_equal(dest, _expected(source, dest_at, src_at, sizes, n))


def _cut_short(real: Any, extra: int) -> Any:
    """A process_vm_readv that copies only the first half of a batch's pieces, then ``extra``
    bytes of the next one, and says so (a kernel stopping at memory it cannot pin)."""

    def vm_read(pid: int, local: int, n: int, remote: int, m: int, flags: int) -> int:
        half = n // 2
        done = real(pid, local, half, remote, half, flags)
        dest, size = _native._bytes_at(local, n * 16).view(np.int64).reshape(-1, 2)[half]
        src = int(_native._bytes_at(remote, m * 16).view(np.int64).reshape(-1, 2)[half, 0])
        more = min(extra, int(size))
        _native.memmove(int(dest), src, more)
        return int(done) + more

    return vm_read


@pytest.mark.skipif(_native._lib.process_vm_readv is None, reason="needs process_vm_readv")
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_copy_pieces_goes_on_where_the_kernel_stopped(
    monkeypatch: pytest.MonkeyPatch, extra: int, split: None
) -> None:
    lib = _native._lib
    monkeypatch.setattr(
        _native,
        "_lib",
        dataclasses.replace(lib, process_vm_readv=_cut_short(lib.process_vm_readv, extra)),
    )
    source, dest_at, src_at, sizes = _pieces(7, _native.IOV_MAX + 300)
    n = int((dest_at + sizes).max())
    dest = np.zeros(n, np.uint8)
    _native.copy_pieces(dest_at + dest.ctypes.data, src_at + source.ctypes.data, sizes, threads=2)
    assert np.array_equal(dest, _expected(source, dest_at, src_at, sizes, n))
    assert _native._vm_read_works


@pytest.mark.parametrize(("code", "for_good"), [(errno.EPERM, True), (errno.EFAULT, False)])
def test_copy_pieces_without_the_kernel_call(
    monkeypatch: pytest.MonkeyPatch, code: int, for_good: bool, split: None
) -> None:
    """Refused (seccomp: EPERM), the call is never made again; memory it cannot pin (EFAULT)
    is copied one piece at a time, the call kept for the next."""
    calls: list[int] = []

    def refuses(*args: int) -> int:
        calls.append(args[2])
        return -1

    lib = dataclasses.replace(_native._lib, process_vm_readv=refuses, get_errno=lambda: code)
    monkeypatch.setattr(_native, "_lib", lib)
    monkeypatch.setattr(_native, "_vm_read_works", True)  # restored after the test
    source, dest_at, src_at, sizes = _pieces(11, 3 * _native.IOV_MAX)
    n = int((dest_at + sizes).max())
    for _ in range(2):
        dest = np.zeros(n, np.uint8)
        _native.copy_pieces(
            dest_at + dest.ctypes.data, src_at + source.ctypes.data, sizes, threads=2
        )
        assert np.array_equal(dest, _expected(source, dest_at, src_at, sizes, n))
    if for_good:  # each thread's first call may come before either saw the refusal
        assert len(calls) <= 2
    else:  # every batch of both copies asked the kernel first (3 batches or more each)
        assert len(calls) >= 6
    assert _native._vm_read_works is not for_good


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
