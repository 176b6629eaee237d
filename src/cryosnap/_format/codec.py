"""The codec of the persistent level (docs/FORMAT.md, "Coded data files"): a data file stored
as frames of byte-shuffled, zstd-compressed bytes, an index of the frames and a trailer.

Pure: compression, the frame index and the trailer; no I/O (storage/_codec.py reads and writes
such files through a store). Runs on whichever thread calls it: the flusher's for the writes,
the read pool's for the reads (zstandard releases the GIL while it compresses or inflates).
"""

from __future__ import annotations

import importlib.util
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from cryosnap.errors import IntegrityError, MissingDependencyError

__all__ = [
    "CODEC_NAME",
    "FRAME_BYTES",
    "TRAILER_BYTES",
    "FrameEncoder",
    "FrameIndex",
    "decode_frame",
    "require_zstd",
]

# The codec named in manifests: byte shuffle by element size, then zstd.
CODEC_NAME = "shuffle-zstd"
# Plain bytes per frame: a read of a few chunks inflates at most a few MiB more than it needs.
FRAME_BYTES = 4 << 20
# zstd level 1: on float32 optimizer state it gave the ratio of level 3 (1.19 against 1.17)
# at about twice the rate here (docs/PERFORMANCE.md, "Codec").
ZSTD_LEVEL = 1
# The element sizes a frame may be shuffled by (1: not shuffled); the one that compresses a
# sample of the frame best is taken, per frame, so a file mixing dtypes is served frame by frame.
_SHUFFLES = (1, 2, 4, 8)
_SAMPLE_BYTES = 64 << 10
# How a frame's bytes are stored: raw (compression did not shrink them) or zstd.
RAW, ZSTD = 0, 1
_MAGIC = b"CSNPZST1"
# magic, plain bytes of the file, frames, xxh3-64 of the index
_TRAILER = struct.Struct("<8sQQQ")
TRAILER_BYTES = _TRAILER.size
# Per frame: plain bytes, stored bytes, element size, how stored.
_ROW = 4
_MAX_FRAMES = 1 << 32


def require_zstd(what: str) -> Any:
    """The ``zstandard`` module, or :class:`MissingDependencyError` naming ``what`` needs it
    and the extra that installs it."""
    if importlib.util.find_spec("zstandard") is None:
        raise MissingDependencyError(
            f"{what} needs the zstd codec (the zstandard package): pip install 'cryosnap[zstd]'"
        )
    import zstandard

    return zstandard


# Element sizes shuffled with integer shifts (one pass per byte plane: about twice the rate
# of numpy's byte transpose here); 8-byte elements are transposed.
_WORDS: dict[int, type[np.unsignedinteger[Any]]] = {2: np.uint16, 4: np.uint32}


def shuffle(data: memoryview, elem: int) -> memoryview:
    """``data`` with the i-th byte of every ``elem``-byte element gathered together (the
    bytes past the last whole element stay at the end)."""
    if elem == 1:
        return data
    a = np.frombuffer(data, np.uint8)
    k = len(a) // elem
    n = k * elem
    out = np.empty(len(a), np.uint8)
    word = _WORDS.get(elem)
    if word is None:
        out[:n].reshape(elem, k)[:] = a[:n].reshape(k, elem).T
    else:
        words = a[:n].view(word)
        for i in range(elem):
            np.copyto(out[i * k : (i + 1) * k], words >> (8 * i), casting="unsafe")
    out[n:] = a[n:]
    return out.data


def unshuffle(data: bytes, elem: int, out: memoryview) -> None:
    """Undo :func:`shuffle` into ``out`` (of ``len(data)`` bytes)."""
    a = np.frombuffer(data, np.uint8)
    dst = np.frombuffer(out, np.uint8)
    if elem == 1:
        dst[:] = a
        return
    k = len(a) // elem
    n = k * elem
    planes = a[:n].reshape(elem, k)
    word = _WORDS.get(elem)
    if word is None:
        dst[:n].reshape(k, elem)[:] = planes.T
    else:
        words = dst[:n].view(word)
        np.copyto(words, planes[0])
        for i in range(1, elem):
            words |= planes[i].astype(word) << (8 * i)
    dst[n:] = a[n:]


class FrameEncoder:
    """Compresses frames for one file (a zstd context is not shared between threads)."""

    def __init__(self) -> None:
        zstd = require_zstd("codec='zstd'")
        # With zstd's checksum of each frame's content: a damaged frame fails to inflate,
        # naming its file, before the chunk hashes would catch it.
        self._zstd = zstd.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
        self._probe = zstd.ZstdCompressor(level=1)

    def _element(self, frame: memoryview) -> int:
        mid = max(0, (frame.nbytes - _SAMPLE_BYTES) // 2) // 8 * 8
        sample = frame[mid : mid + _SAMPLE_BYTES]
        sizes = [len(self._probe.compress(shuffle(sample, e))) for e in _SHUFFLES]
        return _SHUFFLES[sizes.index(min(sizes))]

    def encode(self, frame: memoryview) -> tuple[bytes | memoryview, int, int]:
        """The bytes to store for ``frame``, its element size and how it is stored."""
        elem = self._element(frame)
        packed = self._zstd.compress(shuffle(frame, elem))
        if len(packed) >= frame.nbytes:
            return frame, 1, RAW
        return packed, elem, ZSTD


def decode_frame(
    stored: bytes | bytearray | memoryview, plain: int, elem: int, how: int, out: memoryview
) -> None:
    """Inflate one stored frame into ``out`` (``plain`` bytes); a frame that does not inflate
    to exactly that raises ValueError (the caller names the file)."""
    if how == RAW:
        if len(stored) != plain:
            raise ValueError(f"raw frame of {len(stored)} bytes, expected {plain}")
        out[:] = stored
        return
    zstd = require_zstd("reading a data file stored with codec 'shuffle-zstd'")
    try:
        data = zstd.ZstdDecompressor().decompress(stored, max_output_size=plain)
    except zstd.ZstdError as exc:
        raise ValueError(f"frame does not inflate: {exc}") from exc
    if len(data) != plain:
        raise ValueError(f"frame inflates to {len(data)} bytes, expected {plain}")
    unshuffle(data, elem, out)


@dataclass(frozen=True, slots=True)
class FrameIndex:
    """Where each frame of a coded file lies: per frame its plain offset and bytes, its stored
    offset and bytes, its element size and how it is stored (int64 columns)."""

    plain_offsets: np.ndarray[Any, np.dtype[np.int64]]
    plain_bytes: np.ndarray[Any, np.dtype[np.int64]]
    stored_offsets: np.ndarray[Any, np.dtype[np.int64]]
    stored_bytes: np.ndarray[Any, np.dtype[np.int64]]
    elems: np.ndarray[Any, np.dtype[np.int64]]
    hows: np.ndarray[Any, np.dtype[np.int64]]

    @property
    def plain_size(self) -> int:
        return int(self.plain_bytes.sum())

    @property
    def stored_size(self) -> int:
        """The file's size: its frames, the index and the trailer."""
        return int(self.stored_bytes.sum()) + len(self.plain_bytes) * _ROW * 8 + TRAILER_BYTES

    def frames(self, lo: int, hi: int) -> range:
        """The frames holding plain bytes ``lo`` to ``hi``."""
        if hi <= lo:
            return range(0)
        a = int(np.searchsorted(self.plain_offsets, lo, side="right")) - 1
        b = int(np.searchsorted(self.plain_offsets, hi, side="left"))
        return range(max(a, 0), b)

    @staticmethod
    def tail(rows: list[tuple[int, int, int, int]]) -> bytes:
        """The index and trailer written after frames ``rows`` (plain, stored, elem, how)."""
        table = np.asarray(rows, dtype="<i8").reshape(-1, _ROW).tobytes()
        plain = sum(r[0] for r in rows)
        return table + _TRAILER.pack(_MAGIC, plain, len(rows), xxhash.xxh3_64_intdigest(table))

    @staticmethod
    def trailer(data: bytes, size: int, where: str) -> tuple[int, int]:
        """(plain bytes, frames) from a file's last :data:`TRAILER_BYTES`; its index is the
        ``frames * 32`` bytes before them."""
        magic, plain, frames, _ = _TRAILER.unpack(data)
        if magic != _MAGIC or frames > _MAX_FRAMES or frames * _ROW * 8 + TRAILER_BYTES > size:
            raise IntegrityError(f"{where}: not a coded data file (bad trailer)")
        return plain, frames

    @classmethod
    def parse(cls, table: bytes, trailer: bytes, size: int, where: str) -> FrameIndex:
        """The index of a coded file of ``size`` bytes from its table and trailer, checked:
        hash, sizes that add up to the file's and to the plain bytes the trailer says."""
        _, plain, frames, digest = _TRAILER.unpack(trailer)
        if xxhash.xxh3_64_intdigest(table) != digest or len(table) != frames * _ROW * 8:
            raise IntegrityError(f"{where}: the frame index does not match its hash")
        rows = np.frombuffer(table, "<i8").reshape(-1, _ROW).astype(np.int64)
        plain_b, stored_b, elems, hows = (rows[:, i].copy() for i in range(_ROW))
        ok = bool((plain_b >= 0).all() and (stored_b >= 0).all())
        ok = ok and bool(np.isin(elems, _SHUFFLES).all() and np.isin(hows, (RAW, ZSTD)).all())
        index = cls(
            np.cumsum(plain_b) - plain_b,
            plain_b,
            np.cumsum(stored_b) - stored_b,
            stored_b,
            elems,
            hows,
        )
        if not ok or index.plain_size != plain or index.stored_size != size:
            raise IntegrityError(f"{where}: the frame index is malformed")
        return index
