"""Chunking, hashing and Merkle trees: pure functions, no I/O, no threads.

Every stored buffer (a "blob": the bytes of one tensor, array or bytes leaf) is cut into
fixed-size chunks of ``chunk_bytes`` (the last one may be shorter). Each chunk is hashed with
xxh3-128; the chunk hashes are the leaves of a binary Merkle tree whose root identifies the blob.
Inner nodes hash the concatenation of their two children with a different seed from the chunks,
so a chunk can never pose as an inner node. An odd node at the end of a level is carried up
unchanged. The root of an empty blob is the hash of the empty string.

Runs on whichever thread calls it. xxhash holds the GIL while it hashes (about 30 GB/s on one
core here), so callers hash in chunk-sized calls to keep other threads responsive.
:func:`hash_chunks_released` (the read side's) calls the same xxh3-128 of the xxhash
extension through ctypes, which releases the GIL: several threads hash on several cores at once.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import xxhash

from ._validate import integer

__all__ = [
    "HASH_BYTES",
    "HASH_NAME",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "chunk_count",
    "chunk_spans",
    "hash_bytes",
    "hash_chunks",
    "hash_chunks_released",
    "hash_each_released",
    "merkle_levels",
    "merkle_root",
    "validate_chunk_bytes",
    "value_runs",
]

HASH_NAME = "xxh3_128"
HASH_BYTES = 16
MIN_CHUNK_BYTES = 4 << 10
MAX_CHUNK_BYTES = 64 << 20

_CHUNK_SEED = 0
_NODE_SEED = 1

_digest = xxhash.xxh3_128_digest


def validate_chunk_bytes(chunk_bytes: object) -> int:
    """Return ``chunk_bytes`` if it is an int in [4 KiB, 64 MiB]; a non-int is a
    ``TypeError``, an int out of range a ``ValueError``."""
    allowed = f"an int from {MIN_CHUNK_BYTES} (4 KiB) to {MAX_CHUNK_BYTES} (64 MiB)"
    return integer(
        chunk_bytes,
        "chunk_bytes",
        minimum=MIN_CHUNK_BYTES,
        maximum=MAX_CHUNK_BYTES,
        allowed=allowed,
    )


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """Number of chunks of a blob of ``nbytes``; an empty blob has none."""
    return -(-nbytes // chunk_bytes)


def value_runs(values: np.ndarray[Any, Any]) -> list[tuple[int, int]]:
    """The runs of equal values of a 1-D array (per chunk: changed, owner, kind...) as
    ``(a, b)``: ``values[a:b]`` all equal, in order, covering the array."""
    n = len(values)
    if n == 0:
        return []
    edges = (np.flatnonzero(values[1:] != values[:-1]) + 1).tolist()
    return list(itertools.pairwise([0, *edges, n]))


def chunk_spans(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(start, stop)`` byte offsets of each chunk of a blob of ``nbytes``."""
    return [(s, min(s + chunk_bytes, nbytes)) for s in range(0, nbytes, chunk_bytes)]


def hash_bytes(data: bytes | memoryview) -> bytes:
    """xxh3-128 digest (16 bytes) of one chunk."""
    return _digest(data, _CHUNK_SEED)


def hash_chunks(data: memoryview, chunk_bytes: int) -> bytes:
    """The concatenated 16-byte digests of every chunk of ``data`` (a flat byte view)."""
    n = data.nbytes
    if n <= chunk_bytes:
        return _digest(data, _CHUNK_SEED) if n else b""
    return b"".join(
        _digest(data[s : s + chunk_bytes], _CHUNK_SEED) for s in range(0, n, chunk_bytes)
    )


class _XXH128(ctypes.Structure):
    _fields_ = (("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64))


# A call through ctypes costs about a microsecond more than xxhash's own: chunks smaller than
# this are hashed by xxhash (holding the GIL), larger ones by the native call (releasing it).
_NATIVE_MIN_BYTES = 128 << 10


def _native_digest() -> Callable[[int, int, int], _XXH128] | None:
    """``XXH3_128bits_withSeed(address, nbytes, seed)`` of the xxhash extension (CPU-dispatched
    where it exports that variant), if it exports it and it hashes as xxhash does; else None."""
    try:
        lib = ctypes.CDLL(getattr(xxhash, "_xxhash").__file__)  # noqa: B009 (private module)
    except (OSError, AttributeError):
        return None
    for name in ("XXH3_128bits_withSeed_dispatch", "XXH3_128bits_withSeed"):
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.restype = _XXH128
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64)
        sample = ctypes.create_string_buffer(os.urandom(5000), 5000)
        address = ctypes.addressof(sample)
        sizes = (0, 1, 16, 17, 128, 129, 240, 241, 1024, 4096, 4999)
        if all(
            _canonical.pack((h := fn(address, n, _CHUNK_SEED)).high64, h.low64)
            == _digest(sample.raw[:n], _CHUNK_SEED)
            for n in sizes
        ):
            return fn  # type: ignore[no-any-return]
    return None


_canonical = struct.Struct(">QQ")  # XXH128_canonical_t: the high half first, big-endian
_native = _native_digest()


def hash_chunks_released(data: memoryview, chunk_bytes: int) -> bytes:
    """:func:`hash_chunks` of ``data`` (a flat byte view the caller keeps unchanged meanwhile),
    with the GIL released while each chunk of at least 128 KiB hashes."""
    n = data.nbytes
    native = _native
    if native is None or chunk_bytes < _NATIVE_MIN_BYTES or n < _NATIVE_MIN_BYTES:
        return hash_chunks(data, chunk_bytes)
    if data.readonly:
        address = int(np.frombuffer(data, np.uint8).ctypes.data)
    else:
        address = ctypes.addressof(ctypes.c_char.from_buffer(data))
    pack = _canonical.pack
    out = []
    for s in range(0, n, chunk_bytes):
        size = min(chunk_bytes, n - s)
        if size < _NATIVE_MIN_BYTES:
            out.append(_digest(data[s : s + size], _CHUNK_SEED))
        else:
            h = native(address + s, size, _CHUNK_SEED)
            out.append(pack(h.high64, h.low64))
    return b"".join(out)


def hash_each_released(views: Sequence[memoryview]) -> list[bytes]:
    """The digest of each of ``views`` (flat byte views of one chunk each, which the caller
    keeps unchanged meanwhile): :func:`hash_bytes` of a batch of small leaves in one call, with
    the GIL released while each view of at least 128 KiB hashes."""
    digest = _digest
    native = _native
    if native is None:
        return [digest(v, _CHUNK_SEED) for v in views]
    pack = _canonical.pack
    out: list[bytes] = []
    for v in views:
        n = v.nbytes
        if n < _NATIVE_MIN_BYTES:
            out.append(digest(v, _CHUNK_SEED))
            continue
        if v.readonly:
            address = int(np.frombuffer(v, np.uint8).ctypes.data)
        else:
            address = ctypes.addressof(ctypes.c_char.from_buffer(v))
        h = native(address, n, _CHUNK_SEED)
        out.append(pack(h.high64, h.low64))
    return out


def _split(hashes: bytes) -> list[bytes]:
    if len(hashes) % HASH_BYTES:
        raise ValueError(f"hash list of {len(hashes)} bytes is not a multiple of {HASH_BYTES}")
    return [hashes[i : i + HASH_BYTES] for i in range(0, len(hashes), HASH_BYTES)]


def merkle_levels(chunk_hashes: bytes | Sequence[bytes]) -> list[list[bytes]]:
    """Every level of the Merkle tree, leaves first, root level (one node) last."""
    if isinstance(chunk_hashes, bytes) and len(chunk_hashes) == HASH_BYTES:
        return [[chunk_hashes]]  # one chunk: the chunk's hash is the root
    level = _split(chunk_hashes) if isinstance(chunk_hashes, bytes) else list(chunk_hashes)
    if not level:
        return [[_digest(b"", _CHUNK_SEED)]]
    levels = [level]
    while len(level) > 1:
        nxt = [_digest(level[i] + level[i + 1], _NODE_SEED) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
        levels.append(level)
    return levels


def merkle_root(chunk_hashes: bytes | Sequence[bytes]) -> bytes:
    """The root of the Merkle tree over ``chunk_hashes`` (concatenated or a sequence)."""
    return merkle_levels(chunk_hashes)[-1][0]
