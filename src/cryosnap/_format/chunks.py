"""Chunking, hashing and Merkle trees: pure functions, no I/O, no threads.

Runs on whichever thread calls it. xxhash holds the GIL while it hashes, so callers hash in
chunk-sized calls; :func:`hash_chunks_released` (the read side's) releases it.
docs/FORMAT.md ("Chunks and hashes") has the scheme; docs/design/format.md has the why.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from cryosnap import _native
from cryosnap._validate import integer

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


def hash_chunks_released(data: memoryview, chunk_bytes: int) -> bytes:
    """:func:`hash_chunks` of ``data`` (a flat byte view the caller keeps unchanged meanwhile),
    with the GIL released while each chunk of at least 128 KiB hashes."""
    return _native.hash_chunks(data, chunk_bytes, _CHUNK_SEED)


def hash_each_released(views: Sequence[memoryview]) -> list[bytes]:
    """The digest of each of ``views`` (flat byte views of one chunk each, which the caller
    keeps unchanged meanwhile): :func:`hash_bytes` of a batch of small leaves in one call, with
    the GIL released while each view of at least 128 KiB hashes."""
    return _native.hash_each(views, _CHUNK_SEED)


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
