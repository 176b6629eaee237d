"""Every raw-memory call: addresses, memmove/memset, many copies handed to the kernel at once,
madvise, libc mmap/munmap, the page-cache probe and the XXH3 binding that hashes with the GIL
released.

Each binding has a fallback, taken when it cannot load (no ctypes, no libc symbol, xxhash's
private extension renamed): numpy copies by address, one copy per piece, no advice, reads
instead of mappings, the public ``xxhash`` API (the same digests, holding the GIL). Pure; runs
on any thread.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import xxhash

__all__ = [
    "COPY_THREADS",
    "IOV_MAX",
    "address_of",
    "cached_pages",
    "can_map",
    "copy_pieces",
    "dontneed",
    "hash_chunks",
    "hash_each",
    "leaf_address",
    "map_private",
    "map_shared_read",
    "memmove",
    "memmove_fn",
    "page_cached",
    "populate",
    "zero",
]

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# The most buffers one vectored call takes (pwritev/preadv/process_vm_readv: Linux's
# UIO_MAXIOV, or less if said so; EINVAL beyond).
IOV_MAX: Final = min(getattr(os, "sysconf", lambda _: 1024)("SC_IOV_MAX"), 1024)
# copy_pieces splits its pieces between threads only from this many bytes: below, a thread's
# start costs more than the copies it takes over.
_PARALLEL_MIN_BYTES = 4 << 20
# The threads its callers split many small copies between (one per core this process may run
# on, up to 4: past that the memory's bandwidth, not each core's latency, is the limit).
COPY_THREADS: Final = max(
    1,
    min(
        4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ),
)
_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
# A call through ctypes costs about a microsecond more than xxhash's own: chunks smaller than
# this are hashed by xxhash (holding the GIL), larger ones by the native call (releasing it).
_NATIVE_MIN_BYTES = 128 << 10
_canonical = struct.Struct(">QQ")  # XXH128_canonical_t: the high half first, big-endian
_digest = xxhash.xxh3_128_digest

_Fn = Callable[..., Any]


@dataclass(frozen=True)
class Binding:
    """The native functions that loaded (None: the fallback is used)."""

    memmove: _Fn | None = None
    memset: _Fn | None = None
    # The first byte of a writable C-contiguous buffer: a memoryview or a numpy array.
    addressof: Callable[[memoryview | np.ndarray[Any, Any]], int] | None = None
    madvise: _Fn | None = None
    mmap: _Fn | None = None
    munmap: _Fn | None = None
    get_errno: Callable[[], int] | None = None
    xxh3: _Fn | None = None
    mincore: _Fn | None = None
    process_vm_readv: _Fn | None = None


def _open_libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _open_xxhash() -> Any:
    import ctypes

    return ctypes.CDLL(getattr(xxhash, "_xxhash").__file__)  # noqa: B009 (private module)


def bind(
    open_libc: Callable[[], Any] = _open_libc, open_xxhash: Callable[[], Any] = _open_xxhash
) -> Binding:
    """Load what loads: ctypes' copies, libc's ``madvise``/``mmap``/``munmap`` (Linux), the
    xxhash extension's XXH3 (checked against xxhash's digests); the rest stays None."""
    try:
        import ctypes
    except ImportError:
        return Binding()
    found: dict[str, Any] = {
        "memmove": ctypes.memmove,
        "memset": ctypes.memset,
        "addressof": lambda v: ctypes.addressof(ctypes.c_char.from_buffer(v)),
        "get_errno": ctypes.get_errno,
    }
    with contextlib.suppress(OSError, AttributeError):
        found.update(_bind_libc(open_libc()))
    with contextlib.suppress(OSError, AttributeError):
        found["xxh3"] = _bind_xxh3(open_xxhash())
    return Binding(**found)


def _bind_libc(libc: Any) -> dict[str, Any]:
    import ctypes

    out: dict[str, Any] = {}
    if sys.platform == "linux":
        madvise = libc.madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        madvise.restype = ctypes.c_int
        out["madvise"] = madvise
    if hasattr(mmap, "MAP_PRIVATE"):
        map_, unmap = libc.mmap, libc.munmap
        map_.restype = ctypes.c_void_p
        map_.argtypes = (
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        )
        unmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        out["mmap"], out["munmap"] = map_, unmap
    mincore = getattr(libc, "mincore", None)
    if mincore is not None:
        mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        mincore.restype = ctypes.c_int
        out["mincore"] = mincore
    vm_read = getattr(libc, "process_vm_readv", None) if sys.platform == "linux" else None
    if vm_read is not None:
        vm_read.argtypes = (
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_void_p,
            ctypes.c_ulong,
            ctypes.c_ulong,
        )
        vm_read.restype = ctypes.c_ssize_t
        out["process_vm_readv"] = vm_read
    return out


def _bind_xxh3(lib: Any) -> _Fn | None:
    """``XXH3_128bits_withSeed(address, nbytes, seed)`` (CPU-dispatched where the extension
    exports that variant), if it hashes as xxhash does; else None."""
    import ctypes

    class XXH128(ctypes.Structure):
        _fields_ = (("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64))

    for name in ("XXH3_128bits_withSeed_dispatch", "XXH3_128bits_withSeed"):
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.restype = XXH128
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64)
        sample = ctypes.create_string_buffer(os.urandom(5000), 5000)
        address = ctypes.addressof(sample)
        sizes = (0, 1, 16, 17, 128, 129, 240, 241, 1024, 4096, 4999)
        if all(
            _canonical.pack((h := fn(address, n, 0)).high64, h.low64) == _digest(sample.raw[:n], 0)
            for n in sizes
        ):
            return fn  # type: ignore[no-any-return]
    return None


_lib = bind()
_populate_works = True  # False once the kernel refused MADV_POPULATE_WRITE (older than 5.14)
_vm_read_works = True  # False once the kernel refused process_vm_readv (seccomp, no support)


# -- addresses and copies


def address_of(buf: memoryview | np.ndarray[Any, Any]) -> int:
    """The address of the first byte of ``buf`` (a flat byte view or an array; 0 if empty)."""
    if isinstance(buf, np.ndarray):
        return int(buf.__array_interface__["data"][0]) if buf.nbytes else 0
    if not buf.nbytes:
        return 0
    addressof = _lib.addressof
    if buf.readonly or addressof is None:
        return int(np.frombuffer(buf, np.uint8).__array_interface__["data"][0])
    return addressof(buf)


def leaf_address(leaf: Any) -> int:
    """The address of the first byte of a numpy array or of a tensor (its ``data_ptr()``)."""
    if not isinstance(leaf, np.ndarray):
        return int(leaf.data_ptr())
    addressof = _lib.addressof
    if addressof is not None:
        # Through the buffer protocol: 0.5 us against 1.2 us for .ctypes, which makes two
        # objects per call (20,000 small arrays: 10 against 25 ms).
        try:
            return int(addressof(leaf))
        except (TypeError, ValueError, BufferError):
            pass  # read-only, not C-contiguous, empty, or a dtype buffers refuse (datetime64)
    return int(leaf.ctypes.data)


class _At:
    """``nbytes`` of memory at ``address`` as numpy sees it (the fallback's copies)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


def _bytes_at(address: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.asarray(_At(address, nbytes))


def memmove(dest: int, source: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``source`` to ``dest`` (ctypes releases the GIL)."""
    if not nbytes:
        return
    native = _lib.memmove
    if native is not None:
        native(dest, source, nbytes)
    else:
        np.copyto(_bytes_at(dest, nbytes), _bytes_at(source, nbytes))


def memmove_fn() -> Callable[[int, int, int], object]:
    """The memmove to call in a loop of many copies: ctypes' own where bound (the wrapper
    above costs a Python call per copy, ~15% of 20,000 copies of 13 KB), else :func:`memmove`."""
    native = _lib.memmove
    return native if native is not None else memmove


def copy_pieces(
    dests: np.ndarray[Any, Any],
    sources: np.ndarray[Any, Any],
    nbytes: np.ndarray[Any, Any],
    *,
    threads: int = 1,
) -> None:
    """Copy ``nbytes[i]`` bytes from address ``sources[i]`` to address ``dests[i]``, for each
    ``i`` (three integer arrays of one length; no piece overlaps another's destination).

    ``threads`` > 1 splits the pieces into that many parts of about equal bytes, copied at
    once, each part's pieces handed to the kernel ``IOV_MAX`` at a time (``process_vm_readv``
    of this very process copies a batch of scattered pieces in one call, the GIL released for
    all of them). A loop of ``memmove`` makes a Python-level call per piece, holding the GIL
    between them, so threads running such loops wait for each other; the kernel's batches do
    not. On one thread the loop stays: the kernel copies 4 KiB pages one by one and was slower
    there (300 MB in 20,000 pieces: 87-97 against 64-68 ms for the loop; split between two
    threads 46-55 ms; docs/PERFORMANCE.md, "the copies of packs made by the kernel"). A batch
    the kernel does not copy whole (memory it cannot pin, a kernel or seccomp filter refusing
    the call) is copied from where it stopped one ``memmove`` per piece, as it always is
    without the call."""
    sizes = np.ascontiguousarray(nbytes, dtype=np.int64)
    if not sizes.size:
        return
    to = np.ascontiguousarray(dests, dtype=np.int64)
    frm = np.ascontiguousarray(sources, dtype=np.int64)
    if not to.shape == frm.shape == sizes.shape:
        raise ValueError(f"copy_pieces: {to.shape}, {frm.shape} and {sizes.shape} differ")
    ends = np.cumsum(sizes)
    total = int(ends[-1])
    parts = max(1, min(threads, sizes.size))
    if parts == 1 or total < _PARALLEL_MIN_BYTES or not _vm_read_ready():
        _copy_each(to, frm, sizes, 0, sizes.size, 0)
        return
    # Cut where each part's bytes reach its share; a part may be empty (one large piece).
    cuts = [0, *np.searchsorted(ends, [total * k // parts for k in range(1, parts)]).tolist()]
    cuts.append(sizes.size)
    errors: list[BaseException] = []

    def run(lo: int, hi: int) -> None:
        try:
            _copy_part(to, frm, sizes, ends, lo, hi)
        except BaseException as exc:  # raised on the caller's thread below
            errors.append(exc)

    started: list[threading.Thread] = []
    try:
        for k in range(1, parts):
            t = threading.Thread(target=run, args=(cuts[k], cuts[k + 1]), name="cryosnap-copy")
            try:
                t.start()
            except RuntimeError:  # no new thread (at interpreter shutdown: a save in atexit)
                _copy_part(to, frm, sizes, ends, cuts[k], cuts[k + 1])
            else:
                started.append(t)
        _copy_part(to, frm, sizes, ends, cuts[0], cuts[1])
    finally:
        for t in started:
            t.join()
    if errors:
        raise errors[0]


def _vm_read_ready() -> bool:
    return _vm_read_works and _lib.process_vm_readv is not None


def _copy_part(
    to: np.ndarray[Any, Any],
    frm: np.ndarray[Any, Any],
    sizes: np.ndarray[Any, Any],
    ends: np.ndarray[Any, Any],
    lo: int,
    hi: int,
) -> None:
    """:func:`copy_pieces` of the pieces ``lo:hi`` on this thread (``ends``: the cumulative
    sizes of all of them)."""
    global _vm_read_works
    vm_read, get_errno = _lib.process_vm_readv, _lib.get_errno
    if hi <= lo:
        return
    if vm_read is None or not _vm_read_works:
        _copy_each(to, frm, sizes, lo, hi, 0)
        return
    # struct iovec {void *base; size_t len} twice: the destinations (this process's "local"
    # side) and the sources (the "remote" side, this process too), piece i to piece i.
    local = np.stack((to[lo:hi], sizes[lo:hi]), axis=1)
    remote = np.stack((frm[lo:hi], sizes[lo:hi]), axis=1)
    local_at, remote_at = local.ctypes.data, remote.ctypes.data
    pid = os.getpid()
    for i in range(lo, hi, IOV_MAX):
        j = min(hi, i + IOV_MAX)
        start = int(ends[i - 1]) if i else 0
        want = int(ends[j - 1]) - start
        skip = (i - lo) * 16
        done = vm_read(pid, local_at + skip, j - i, remote_at + skip, j - i, 0)
        if done == want:
            continue
        if done < 0:
            if get_errno is not None and get_errno() in (errno.ENOSYS, errno.EPERM):
                _vm_read_works = False  # refused for good: the loop from now on
            done = 0
        # The rest of the batch one by one, from the first byte the kernel did not copy.
        k = int(np.searchsorted(ends[i:j], start + done, side="right")) + i
        into = start + done - (int(ends[k - 1]) if k else 0)
        _copy_each(to, frm, sizes, k, hi if not _vm_read_works else j, into)
        if not _vm_read_works:
            return


def _copy_each(
    to: np.ndarray[Any, Any],
    frm: np.ndarray[Any, Any],
    sizes: np.ndarray[Any, Any],
    lo: int,
    hi: int,
    skip: int,
) -> None:
    """One memmove per piece ``lo:hi``; the first ``skip`` bytes of piece ``lo`` already
    copied."""
    memmove = memmove_fn()
    for d, s, n in zip(to[lo:hi].tolist(), frm[lo:hi].tolist(), sizes[lo:hi].tolist(), strict=True):
        if n > skip:
            memmove(d + skip, s + skip, n - skip)
        skip = 0


def zero(address: int, nbytes: int) -> None:
    """Write ``nbytes`` zeros at ``address``."""
    if not nbytes:
        return
    native = _lib.memset
    if native is not None:
        native(address, 0, nbytes)
    else:
        _bytes_at(address, nbytes).fill(0)


# -- advice


def _whole_pages(address: int, nbytes: int) -> tuple[int, int]:
    """The bounds of the whole pages inside ``nbytes`` at ``address`` (empty: lo >= hi)."""
    return -(-address // _PAGE_BYTES) * _PAGE_BYTES, (address + nbytes) // _PAGE_BYTES * _PAGE_BYTES


def populate(address: int, nbytes: int) -> None:
    """Map the whole pages of ``nbytes`` at ``address`` (fresh memory a read is about to fill)
    in one call (``MADV_POPULATE_WRITE``) instead of one page fault per page as the read
    lands: about 30% less time for a fresh leaf here. Nothing changes in the memory; where the
    kernel lacks the call, the pages fault in as before."""
    global _populate_works
    lo, hi = _whole_pages(address, nbytes)
    madvise, get_errno = _lib.madvise, _lib.get_errno
    if (
        _populate_works
        and madvise is not None
        and get_errno is not None
        and hi > lo
        and madvise(lo, hi - lo, _MADV_POPULATE_WRITE)
        and get_errno() in (errno.EINVAL, errno.ENOSYS)
    ):
        _populate_works = False  # an older kernel: never asked again


def dontneed(address: int, nbytes: int) -> None:
    """Drop this process's mapping of the whole pages of ``nbytes`` at ``address`` (a range of
    a copy-on-write file mapping no leaf was built over, and nothing wrote to):
    ``MADV_DONTNEED`` leaves the page cache as it is, and a later access maps the file's pages
    again. Without madvise the pages stay mapped."""
    lo, hi = _whole_pages(address, nbytes)
    madvise = _lib.madvise
    if madvise is not None and hi > lo:
        madvise(lo, hi - lo, _MADV_DONTNEED)


# -- mappings and the page cache


def can_map() -> bool:
    """Whether :func:`map_private` maps (libc's ``mmap`` loaded)."""
    return _lib.mmap is not None and _lib.munmap is not None


class _Unmap:
    """Unmaps a mapping when the buffer that owns it is collected."""

    __slots__ = ("address", "munmap", "nbytes")

    def __init__(self, address: int, nbytes: int, munmap: _Fn) -> None:
        # munmap held here: the module's globals may be gone when the last leaf goes at exit.
        self.address, self.nbytes, self.munmap = address, nbytes, munmap

    def __del__(self) -> None:
        self.munmap(self.address, self.nbytes)


def map_private(fd: int, nbytes: int) -> memoryview | None:
    """``nbytes`` of ``fd`` mapped copy-on-write (``MAP_PRIVATE``), as a writable flat byte
    view that owns the mapping and holds no file descriptor; None without libc's ``mmap``.
    Raises OSError when the call fails."""
    map_, unmap, get_errno = _lib.mmap, _lib.munmap, _lib.get_errno
    if map_ is None or unmap is None or get_errno is None:
        return None
    import ctypes  # loaded: the binding above came from it

    address = map_(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        err = get_errno()
        raise OSError(err, os.strerror(err))
    try:
        array = (ctypes.c_ubyte * nbytes).from_address(address)
        array._unmap = _Unmap(address, nbytes, unmap)  # type: ignore[attr-defined]
    except BaseException:
        unmap(address, nbytes)
        raise
    return memoryview(array).cast("B")


def map_shared_read(fd: int, nbytes: int) -> memoryview:
    """``nbytes`` (> 0) of ``fd`` mapped read-only and shared: the page cache's own pages, no
    copy and no anonymous memory, as a read-only flat byte view that owns the mapping (``fd``
    may be closed). A read of a page the file no longer has (truncated meanwhile) is a SIGBUS:
    map only files that must not change while the view is read. Raises OSError."""
    mapping = mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ)
    with contextlib.suppress(AttributeError, OSError):  # advice only
        mapping.madvise(mmap.MADV_SEQUENTIAL)
    return memoryview(mapping)


def cached_pages(fd: int, nbytes: int) -> tuple[int, int] | None:
    """``(pages in the page cache, pages)`` of the first ``nbytes`` of ``fd`` (``mincore``
    over a shared read-only mapping, which reads nothing in); None where it cannot be told."""
    map_, unmap, mincore = _lib.mmap, _lib.munmap, _lib.mincore
    pages = -(-nbytes // _PAGE_BYTES)
    if map_ is None or unmap is None or mincore is None or not pages:
        return None
    import ctypes  # loaded: the binding above came from it

    address = map_(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        return None
    try:
        vec = (ctypes.c_ubyte * pages)()
        if mincore(address, nbytes, vec):
            return None
        return int(np.count_nonzero(np.frombuffer(memoryview(vec).cast("B"), np.uint8) & 1)), pages
    finally:
        unmap(address, nbytes)


def page_cached(path: Path, offset: int) -> bool | None:
    """Whether the page of ``path`` at ``offset`` is in the page cache (``preadv2`` with
    ``RWF_NOWAIT``); None where it cannot be told (no such flag, an error)."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        os.preadv(fd, [memoryview(bytearray(1))], offset, flag)
    except BlockingIOError:
        return False
    except OSError:
        return None
    finally:
        os.close(fd)
    return True


# -- XXH3


def hash_chunks(data: memoryview, chunk_bytes: int, seed: int) -> bytes:
    """The concatenated xxh3-128 digests of every ``chunk_bytes`` chunk of ``data`` (a flat
    byte view the caller keeps unchanged meanwhile), with the GIL released while each chunk of
    at least 128 KiB hashes; through xxhash's public API where the binding did not load."""
    n = data.nbytes
    native = _lib.xxh3
    if native is None or chunk_bytes < _NATIVE_MIN_BYTES or n < _NATIVE_MIN_BYTES:
        if n <= chunk_bytes:
            return _digest(data, seed) if n else b""
        return b"".join(_digest(data[s : s + chunk_bytes], seed) for s in range(0, n, chunk_bytes))
    address = address_of(data)
    pack = _canonical.pack
    out = []
    for s in range(0, n, chunk_bytes):
        size = min(chunk_bytes, n - s)
        if size < _NATIVE_MIN_BYTES:
            out.append(_digest(data[s : s + size], seed))
        else:
            h = native(address + s, size, seed)
            out.append(pack(h.high64, h.low64))
    return b"".join(out)


def hash_each(views: Sequence[memoryview], seed: int) -> list[bytes]:
    """The xxh3-128 digest of each of ``views`` (flat byte views the caller keeps unchanged
    meanwhile), with the GIL released while each view of at least 128 KiB hashes."""
    native = _lib.xxh3
    if native is None:
        return [_digest(v, seed) for v in views]
    pack = _canonical.pack
    out: list[bytes] = []
    for v in views:
        n = v.nbytes
        if n < _NATIVE_MIN_BYTES:
            out.append(_digest(v, seed))
            continue
        h = native(address_of(v), n, seed)
        out.append(pack(h.high64, h.low64))
    return out
