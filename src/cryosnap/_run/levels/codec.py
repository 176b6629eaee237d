"""The codec of one level (``Checkpointer(codec=)``): whether the data files written to the
persistent level are stored coded (byte shuffle + zstd, _format/codec.py), and the rates that
decide it under ``"auto"``.

Used where the persistent level's data files are written: on its flusher thread (the copy
from scratch, levels/flush.py) and on the writer's I/O threads (the write path,
engine/write/: a run without scratch, or the ranks' rewrite of node-local scratch). Its
counters take a lock; :meth:`LevelCodec.snapshot` may be read from any thread.
docs/design/levels.md ("Codecs") has the why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cryosnap._format.codec import FrameEncoder
from cryosnap.storage import BlobWriter, CodedWriter, Store
from cryosnap.storage.base import BytesLike

__all__ = ["CodecRates", "LevelCodec", "pays"]

# Plain bytes compressed to calibrate the codec under "auto" while the level's files are
# written plain: a slice of SAMPLE_BYTES from a buffer written after every WINDOW_BYTES (the
# flush's copy windows are that size), so the sample spreads over the version (the first
# 16 MiB of a GPT-2's state, its embedding, gave 1.08 where the whole state gives 1.18), until
# CALIBRATE_BYTES were compressed. A buffer under MIN_SAMPLE_BYTES (a small leaf on the write
# path) is not sampled: the next larger one is.
CALIBRATE_BYTES = 64 << 20
SAMPLE_BYTES = 1 << 20
WINDOW_BYTES = 16 << 20
MIN_SAMPLE_BYTES = 64 << 10


def pays(write_bytes_per_s: float, codec_bytes_per_s: float, ratio: float) -> bool:
    """Whether coding a flush takes less time than writing it plain, the codec and the writes
    in series on the flusher thread: ``n / W > n / C + n / (ratio * W)``, that is
    ``W < C * (1 - 1 / ratio)`` (``W`` the level's write rate, ``C`` the codec's)."""
    return ratio > 1.0 and write_bytes_per_s < codec_bytes_per_s * (1.0 - 1.0 / ratio)


@dataclass(frozen=True, slots=True)
class CodecRates:
    """What a level's codec measured so far: the level's write rate (stored bytes over the
    seconds its writes took), the codec's (plain bytes over the seconds compressing them),
    the ratio (plain over stored bytes compressed), and the data files written each way.
    A rate is None until measured."""

    mode: str
    write_bytes_per_s: float | None
    codec_bytes_per_s: float | None
    ratio: float | None
    coded_files: int
    plain_files: int

    @property
    def use(self) -> bool:
        """Whether the next data file written is coded."""
        if self.mode == "zstd":
            return True
        w, c, r = self.write_bytes_per_s, self.codec_bytes_per_s, self.ratio
        return w is not None and c is not None and r is not None and pays(w, c, r)


class _TimedWriter:
    """A plain writer that counts the bytes written and the seconds the writes took, and
    hands ``codec`` a buffer to calibrate on after every :data:`WINDOW_BYTES` written."""

    def __init__(self, inner: BlobWriter, codec: LevelCodec) -> None:
        self.key = inner.key
        self._inner = inner
        self._codec = codec
        self._unsampled = WINDOW_BYTES  # the first large buffer is sampled
        self.nbytes = 0
        self.seconds = 0.0

    def write(self, buffers: Sequence[BytesLike]) -> None:
        t0 = time.perf_counter()
        self._inner.write(buffers)
        self.seconds += time.perf_counter() - t0
        for b in buffers:
            view = memoryview(b).cast("B")
            self.nbytes += view.nbytes
            if self._unsampled >= WINDOW_BYTES and view.nbytes >= MIN_SAMPLE_BYTES:
                self._codec.sample(view)
                self._unsampled = 0
            self._unsampled += view.nbytes

    def tell(self) -> int:
        return self._inner.tell()

    def commit(self) -> None:
        t0 = time.perf_counter()
        self._inner.commit()
        self.seconds += time.perf_counter() - t0

    def abort(self) -> None:
        self._inner.abort()


class LevelCodec:
    """``mode`` ``"zstd"`` codes every data file written to the level; ``"auto"`` writes
    plain until both rates are measured (the first file: the level's writes timed, the codec
    calibrated on a slice of each window of its bytes), then codes each file when
    :func:`pays` says so, with the rates of every file since (coded ones included)."""

    def __init__(self, mode: str) -> None:
        if mode not in ("zstd", "auto"):
            raise ValueError(f"codec={mode!r}: expected None, 'zstd' or 'auto'")
        self.mode = mode
        self._lock = threading.Lock()
        self._stored = self._write_s = 0.0
        self._coded_plain = self._coded_stored = self._encode_s = 0.0
        self._files = [0, 0]  # coded, plain
        self._encoder: FrameEncoder | None = FrameEncoder()  # also: zstandard is installed

    def snapshot(self) -> CodecRates:
        with self._lock:
            return CodecRates(
                self.mode,
                self._stored / self._write_s if self._write_s > 0 else None,
                self._coded_plain / self._encode_s if self._encode_s > 0 else None,
                self._coded_plain / self._coded_stored if self._coded_stored > 0 else None,
                *self._files,
            )

    def use(self) -> bool:
        """Whether the next data file written is coded, as the rates measured so far say."""
        return self.snapshot().use

    def open_writer(
        self, dst: Store, key: str, *, coded: bool | None = None
    ) -> CodedWriter | _TimedWriter:
        """The writer of data file ``key`` on ``dst``: coded or plain (``coded``; None: as
        :meth:`use` says now). Give it to :meth:`written` once committed."""
        if self.use() if coded is None else coded:
            return CodedWriter(dst.open_writer(key))
        return _TimedWriter(dst.open_writer(key), self)

    def sample(self, view: memoryview) -> None:
        """Under ``"auto"``, calibrate the codec on a slice of ``view`` (plain bytes being
        written plain) until :data:`CALIBRATE_BYTES` were compressed."""
        if self.mode != "auto" or self._encoder is None:
            return
        mid = max(0, (view.nbytes - SAMPLE_BYTES) // 2) // 8 * 8
        view = view[mid : mid + SAMPLE_BYTES]
        # Under the lock: one zstd context, and a writer of each level's file may sample.
        with self._lock:
            if self._coded_plain >= CALIBRATE_BYTES:
                return
            t0 = time.perf_counter()
            stored, _elem, _how = self._encoder.encode(view)
            self._encode_s += time.perf_counter() - t0
            self._coded_plain += view.nbytes
            self._coded_stored += len(stored)

    def written(self, writer: BlobWriter) -> None:
        """Count a data file once ``writer`` (of :meth:`open_writer`) committed it."""
        with self._lock:
            if isinstance(writer, CodedWriter):
                s = writer.stats
                self._stored += s.stored_bytes
                self._write_s += s.write_seconds
                self._coded_plain += s.plain_bytes
                self._coded_stored += s.stored_bytes
                self._encode_s += s.encode_seconds
                self._files[0] += 1
            elif isinstance(writer, _TimedWriter):
                self._stored += writer.nbytes
                self._write_s += writer.seconds
                self._files[1] += 1
