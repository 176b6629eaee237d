"""Flush: copy committed versions from the scratch tier to the persistent tier, in order.

Every chunk is verified as it is copied and the commit record is written last, so a crash
leaves no torn version. :class:`Flusher` runs the flushes on a thread of its own; only the
run's writer flushes; no collectives here. docs/design/levels.md has the why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import xxhash

from cryosnap._format.blobs import STORED
from cryosnap._format.chunks import HASH_BYTES, hash_chunks_released
from cryosnap._format.commit import CommitRecord
from cryosnap._format.keys import version_prefix
from cryosnap._format.manifest import with_codec
from cryosnap._format.marks import MarkRecord, parse_mark_key
from cryosnap._run.levels.codec import LevelCodec
from cryosnap.engine import chain_keys, chain_manifests, read_commit, read_manifest
from cryosnap.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
    LockLostError,
    SourceDamagedError,
    StorageError,
)
from cryosnap.storage import CodedWriter, Store, coded_size, read_index

__all__ = ["Flushed", "Flusher", "flush_keys", "flush_version"]

_T = TypeVar("_T")

log = logging.getLogger("cryosnap")

# Bytes copied per read/write call: large sequential I/O on both tiers.
_COPY_BYTES = 16 << 20
_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 5.0


def _no_wait() -> None:
    return None


@dataclass(frozen=True, slots=True)
class Flushed:
    """One version's successful flush: the bytes this process wrote to the next level and
    the seconds its last (successful) attempt took."""

    step: int
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class _Chunks:
    """The chunks a version's chain claims in one data file, sorted by offset, unique:
    their offsets, lengths and 16-byte digests."""

    offsets: np.ndarray[Any, np.dtype[np.int64]]
    lengths: np.ndarray[Any, np.dtype[np.int64]]
    digests: np.ndarray[Any, np.dtype[np.uint8]]  # (chunks, 16)


_NO_CHUNKS = _Chunks(
    np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, HASH_BYTES), np.uint8)
)

_Claim = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]


def _claims(
    src: Store, record: CommitRecord
) -> tuple[dict[str, _Chunks], dict[str, tuple[str, str | None]]]:
    """Every stored chunk the version's chain claims, per data file, from manifests verified
    against the hashes their successors record; and those manifests, each rank's oldest
    first (key -> hash and the key of its base). A chunk referenced by several versions (or
    de-duplicated within one) is claimed once per reference; duplicates are merged."""
    parts: dict[str, list[_Claim]] = {}
    manifests: dict[str, tuple[str, str | None]] = {}
    for ref in record.manifests:
        manifest, _ = read_manifest(src, record, ref.rank)
        for m, key, xxh3 in reversed(chain_manifests(src, manifest, ref.key, ref.xxh3)):
            manifests[key] = (xxh3, None if m.base is None else m.base.key)
            for entry in m.blobs:
                for key, claim in _entry_claims(
                    m.data_files, entry.table, entry.hashes, m.chunk_bytes
                ):
                    parts.setdefault(key, []).append(claim)
    return {key: _merge(items) for key, items in parts.items()}, manifests


def _entry_claims(
    files: Sequence[str], table: np.ndarray[Any, Any], hashes: bytes, cb: int
) -> Iterator[tuple[str, _Claim]]:
    rows = table[table[:, 0] == STORED]
    if not len(rows):
        return
    counts = -(-rows[:, 3] // cb)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    offsets = np.repeat(rows[:, 2], counts) + within * cb
    lengths = np.minimum(offsets + cb, np.repeat(rows[:, 2] + rows[:, 3], counts)) - offsets
    digests = np.frombuffer(hashes, np.uint8).reshape(-1, HASH_BYTES)
    which = np.repeat(rows[:, 1], counts)
    for f in np.unique(which).tolist():
        sel = which == f
        yield files[f], (offsets[sel], lengths[sel], digests[sel])


def _merge(items: list[_Claim]) -> _Chunks:
    offsets = np.concatenate([o for o, _n, _d in items])
    lengths = np.concatenate([n for _o, n, _d in items])
    digests = np.concatenate([d for _o, _n, d in items])
    order = np.lexsort((lengths, offsets))
    offsets, lengths, digests = offsets[order], lengths[order], digests[order]
    dup = np.zeros(len(offsets), bool)
    dup[1:] = (offsets[1:] == offsets[:-1]) & (lengths[1:] == lengths[:-1])
    dup[1:] &= (digests[1:] == digests[:-1]).all(axis=1)
    keep = ~dup
    return _Chunks(offsets[keep], lengths[keep], digests[keep])


def _check_claims(key: str, nbytes: int, chunks: _Chunks) -> None:
    """Claims that cannot all be true: chunks that overlap or lie outside the file."""
    o, n = chunks.offsets, chunks.lengths
    if not len(o):
        return
    if int(o[0]) < 0 or int((o + n).max()) > nbytes or bool((o[1:] < (o + n)[:-1]).any()):
        raise IntegrityError(
            f"data file {key} ({nbytes} bytes) does not hold the chunks its manifests claim"
        )


def _verify_window(
    key: str, src: Store, view: memoryview, lo: int, chunks: _Chunks, chunk_bytes: int
) -> None:
    """Check the claimed chunks lying in ``view`` (the file's bytes from ``lo``); runs of
    back-to-back full chunks are hashed in one call."""
    hi = lo + view.nbytes
    o, n = chunks.offsets, chunks.lengths
    a, b = int(np.searchsorted(o, lo)), int(np.searchsorted(o + n, hi, side="right"))
    if a >= b:
        return
    o, n, d = o[a:b], n[a:b], chunks.digests[a:b]
    # A run ends after a chunk that is short or not followed by its neighbour.
    ends = (np.flatnonzero((n[:-1] != chunk_bytes) | (o[1:] != o[:-1] + n[:-1])) + 1).tolist()
    for i, j in zip([0, *ends], [*ends, len(o)], strict=True):
        start, stop = int(o[i]) - lo, int(o[j - 1] + n[j - 1]) - lo
        if hash_chunks_released(view[start:stop], chunk_bytes) != d[i:j].tobytes():
            raise IntegrityError(
                f"data file {key} on {src.url}: bytes {start + lo}-{stop + lo} do not match "
                "the hashes their manifests record"
            )


def _copy_file(
    src: Store,
    dst: Store,
    key: str,
    nbytes: int,
    chunks: _Chunks,
    chunk_bytes: int,
    yield_to: Callable[[], None] = _no_wait,
    codec: LevelCodec | None = None,
) -> bool:
    """Copy ``key`` in large reads; every claimed chunk is checked before its bytes are
    written. Windows end on chunk boundaries, so each chunk is hashed whole. With ``codec``
    the file may be written coded (its writer compresses each frame as it fills): returns
    whether it was."""
    _check_claims(key, nbytes, chunks)
    ends = chunks.offsets + chunks.lengths
    writer = dst.open_writer(key) if codec is None else codec.open_writer(dst, key)
    try:
        buf = memoryview(bytearray(min(nbytes, _COPY_BYTES + chunk_bytes)))
        lo = 0
        while lo < nbytes:
            yield_to()
            hi = min(lo + _COPY_BYTES, nbytes)
            # Move the end past a chunk that straddles it (a chunk is at most chunk_bytes).
            k = int(np.searchsorted(chunks.offsets, hi)) - 1
            if k >= 0 and int(ends[k]) > hi:
                hi = int(ends[k])
            view = buf[: hi - lo]
            src.read_into(key, lo, [view])
            _verify_window(key, src, view, lo, chunks, chunk_bytes)
            writer.write([view])  # a plain writer of "auto" calibrates the codec on it
            lo = hi
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    if codec is not None:
        codec.written(writer)
    return isinstance(writer, CodedWriter)


def _from_src(step: int, src: Store, read: Callable[[], _T]) -> _T:
    try:
        return read()
    except (CheckpointNotFoundError, IntegrityError, CheckpointFormatError) as exc:
        raise SourceDamagedError(
            f"step {step} on scratch {src.url} is damaged: {exc}", step=step, path=src.url
        ) from exc


def _no_fence() -> None:
    return None


def flush_keys(src: Store, step: int) -> set[str]:
    """The files a flush of ``step`` writes to the persistent tier (empty if its scratch copy
    cannot be read)."""
    try:
        record = read_commit(src, step)
    except CheckpointError:
        return set()
    try:
        manifests = chain_keys(src, record)
    except CheckpointError:  # a chain manifest unreadable there: at least the version's own
        manifests = [m.key for m in record.manifests]
    return {*record.data_files, *manifests}


def flush_version(
    src: Store,
    dst: Store,
    step: int,
    *,
    yield_to: Callable[[], None] = _no_wait,
    fence: Callable[[], None] = _no_fence,
    codec: LevelCodec | None = None,
) -> int:
    """Make version ``step`` of ``src`` complete on ``dst``; returns the bytes copied.

    Data files already on ``dst`` with the right size are kept (an earlier flush of the chain,
    or a flush interrupted after them): their names are unique and stores make a file visible
    only once it is whole. Manifests (whose names are not unique: a step may be saved again
    after a crash) are kept only when their bytes are the same. ``yield_to()`` is called before
    each piece copied: it may block (the program is capturing a version: its stall comes
    first). Every chunk copied is checked against its recorded hash; a damaged or incomplete
    scratch copy raises :class:`SourceDamagedError`. ``fence()`` runs before the commit record
    is written (a writer that lost the run's lock makes nothing visible).

    ``codec`` (the persistent level's, levels/codec.py) writes data files coded where it says
    so; the manifests naming coded files, and the commit record and marks naming those
    manifests, are then stored on ``dst`` with bytes of their own (docs/FORMAT.md, "Coded
    data files"). A coded file already on ``dst`` stays coded, with or without ``codec``.
    """
    record = _from_src(step, src, lambda: read_commit(src, step))
    claims, manifests = _from_src(step, src, lambda: _claims(src, record))
    copied, coded = _copy_data(src, dst, step, record, claims, yield_to, codec)
    # The manifests of this version and of every version its chain inherits from, as each
    # names its base (key and hash, checked here); their commit records are not needed (a base
    # may be gone from scratch's retention: it is not a version here, only a manifest this one
    # resolves through). A chain naming coded files is written as dst stores it (with_codec).
    texts = _dst_manifests(src, dst, step, manifests, coded, set(record.data_files))
    for key, (data, _src) in texts.items():
        if dst.exists(key) and dst.read(key) == data:
            continue
        dst.write(key, data)
        copied += len(data)
    body = _from_src(step, src, lambda: src.read(record.key))
    dst_body = _dst_record(body, record, texts)
    fence()
    dst.write(record.key, dst_body)
    rebind = None if dst_body is body else xxhash.xxh3_128_hexdigest(dst_body)
    return copied + len(dst_body) + _copy_marks(src, dst, step, rebind)


def _copy_data(
    src: Store,
    dst: Store,
    step: int,
    record: CommitRecord,
    claims: dict[str, _Chunks],
    yield_to: Callable[[], None],
    codec: LevelCodec | None,
) -> tuple[int, set[str]]:
    """Copy the version's data files ``dst`` lacks (``codec``: coded where it says); the
    plain bytes copied and the data files of the record that are coded on ``dst``."""
    copied = 0
    coded: set[str] = set()
    for key in record.data_files:
        nbytes = _from_src(step, src, lambda key=key: src.size(key))  # type: ignore[misc]
        if dst.exists(key):
            have = dst.size(key)
            if have == nbytes:
                continue
            # A coded copy is kept, whatever this flush's codec: committed versions on dst
            # may name it coded (an earlier flush of the chain), or a flush interrupted
            # after it wrote it.
            if coded_size(dst, key, nbytes):
                coded.add(key)
                continue
        chunks = claims.get(key, _NO_CHUNKS)

        def copy(key: str = key, n: int = nbytes, c: _Chunks = chunks) -> bool:
            return _copy_file(src, dst, key, n, c, record.chunk_bytes, yield_to, codec)

        if _from_src(step, src, copy):
            coded.add(key)
        copied += nbytes
    return copied, coded


def _coded_on(dst: Store, files: set[str]) -> set[str]:
    """Of ``files`` (named by older manifests of a chain, not by the version's record: their
    chunks are superseded, their plain size unknown here), those that are coded on ``dst``."""
    out: set[str] = set()
    for key in sorted(files):
        try:
            read_index(dst, key)
        except (CheckpointError, OSError):
            continue
        out.add(key)
    return out


def _dst_manifests(
    src: Store,
    dst: Store,
    step: int,
    manifests: dict[str, tuple[str, str | None]],
    coded: set[str],
    listed: set[str],
) -> dict[str, tuple[bytes, bytes]]:
    """Per manifest of the chain (oldest first), its bytes on dst and on src: the same bytes
    unless it names a file coded on dst (``coded``: of the record's files, ``listed``; the
    others are asked of dst) or its base's bytes changed (then :func:`with_codec`)."""
    out: dict[str, tuple[bytes, bytes]] = {}
    datas: dict[str, bytes] = {}
    for key, (xxh3, _base) in manifests.items():
        data = datas[key] = _from_src(step, src, lambda key=key: src.read(key))  # type: ignore[misc]
        if xxhash.xxh3_128_hexdigest(data) != xxh3:
            raise SourceDamagedError(
                f"step {step} on scratch {src.url}: manifest {key} does not match its hash",
                step=step,
                path=src.url,
            )
    named = {key: set(json.loads(data).get("data_files", ())) for key, data in datas.items()}
    frozen = frozenset(coded | _coded_on(dst, set().union(*named.values()) - listed))
    for key, (_xxh3, base) in manifests.items():
        data = datas[key]
        base_text = out.get(base) if base is not None else None
        new_base = None
        if base_text is not None and base_text[0] is not base_text[1]:
            new_base = xxhash.xxh3_128_hexdigest(base_text[0])
        names = frozen.intersection(named[key])
        if new_base is None and not names:
            out[key] = (data, data)
        else:
            out[key] = (with_codec(data, frozen, new_base, key), data)
    return out


def _dst_record(body: bytes, record: CommitRecord, texts: dict[str, tuple[bytes, bytes]]) -> bytes:
    """The commit record as dst stores it: ``body`` itself unless a manifest it names was
    written with other bytes there (then naming those bytes)."""
    refs = []
    for ref in record.manifests:
        data, plain = texts[ref.key]
        if data is plain:
            refs.append(ref)
        else:
            refs.append(
                dataclasses.replace(ref, xxh3=xxhash.xxh3_128_hexdigest(data), nbytes=len(data))
            )
    if refs == list(record.manifests):
        return body
    return dataclasses.replace(record, manifests=tuple(refs)).to_json()


def _copy_marks(src: Store, dst: Store, step: int, rebind: str | None = None) -> int:
    """The version's mark records, after its commit record (as ``Checkpointer.mark`` writes
    them): bound to the commit record's bytes, copied as they are (``rebind``: to the hash of
    dst's commit record, where its bytes differ from src's). A failure is logged: the
    version is flushed; only a mark given before the flush is missing on ``dst``."""
    copied = 0
    try:
        for key in src.list(version_prefix(step)):
            if parse_mark_key(key) is not None:
                data = src.read(key)
                if rebind is not None:
                    mark = MarkRecord.from_json(data, key)
                    data = dataclasses.replace(mark, commit_xxh3=rebind).to_json()
                dst.write(key, data)
                copied += len(data)
    except CheckpointError as exc:
        log.warning("step %d: copying its marks from %s failed: %s", step, src.url, exc)
    return copied


class CollectiveFlush(Protocol):
    """A flush whose attempts are collectives (every rank writes its part of the version:
    _writer.Rewriter): every rank must make the same attempts, so whether to try again is
    agreed."""

    def __call__(
        self,
        src: Store,
        dst: Store,
        step: int,
        *,
        yield_to: Callable[[], None],
        fence: Callable[[], None],
    ) -> int: ...

    def agree(self, step: int, retry: bool) -> bool:
        """After a failed attempt at ``step`` (collective): True when every rank retries."""
        ...


class Flusher:
    """Flushes committed scratch versions to the persistent tier on a background thread.

    ``on_done(step, outcome)`` runs on the flusher thread once a version is persistent
    (``outcome`` a :class:`Flushed`) or has failed for good (the error).
    """

    def __init__(
        self,
        src: Store,
        dst: Store,
        *,
        retry_seconds: float,
        on_done: Callable[[int, Flushed | BaseException], None],
        yield_to: Callable[[], None] = _no_wait,
        fence: Callable[[], None] = _no_fence,
        flush: Callable[..., int] | CollectiveFlush = flush_version,
        agree: Callable[[int, bool], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[float], object] | None = None,
    ) -> None:
        # ``flush(src, dst, step, yield_to=, fence=)`` copies one version. With ``agree`` its
        # attempts are collectives: after a failed one, every rank says whether it would try
        # again (not given up, not damaged, time left) and all retry only if all would.
        # ``clock`` tells the retries' deadlines, ``wait(seconds)`` the backoff between them
        # (default: a wait that :meth:`abandon` cuts short); a test passes a fake pair.
        self._flush_one = flush
        self.agree = agree
        self.src = src
        self.yield_to = yield_to
        self.fence = fence
        self.dst = dst
        self.retry_seconds = retry_seconds
        self.on_done = on_done
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._clock = clock
        self._wait = wait if wait is not None else self._stop.wait
        self._closing_deadline = float("inf")
        self._thread = threading.Thread(target=self._run, name="cryosnap-flush", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        self._queue.put(step)

    def finish_within(self, seconds: float) -> None:
        """From now on, retries of every queued flush together end after ``seconds``."""
        self._closing_deadline = min(self._closing_deadline, self._clock() + seconds)

    def close(self) -> None:
        """Finish the queued flushes, all of them retried at most ``retry_seconds`` more in
        total, then stop."""
        self.finish_within(self.retry_seconds)
        self._queue.put(None)
        self._thread.join()

    def abandon(self) -> None:
        """Stop retrying: the flush in progress fails at its next retry, queued ones fail."""
        self._stop.set()

    def _run(self) -> None:
        while True:
            step = self._queue.get()
            if step is None:
                return
            outcome = self._flush(step)
            try:
                self.on_done(step, outcome)
            except Exception:  # pragma: no cover - the callback must not stop the flusher
                log.exception("after flushing step %d", step)

    def _flush(self, step: int) -> Flushed | BaseException:
        deadline = self._clock() + self.retry_seconds
        delay = _BACKOFF_FIRST
        attempt = 0
        while True:
            attempt += 1
            try:
                t0 = time.perf_counter()
                nbytes = self._flush_one(
                    self.src, self.dst, step, yield_to=self.yield_to, fence=self.fence
                )
            except (CheckpointError, OSError) as exc:
                self.last_error = exc
                final = isinstance(exc, (SourceDamagedError, LockLostError))
                give_up = min(deadline, self._closing_deadline)
                out_of_time = self._stop.is_set() or self._clock() + delay > give_up
                if self.agree is not None:
                    try:
                        again = self.agree(step, not (final or out_of_time))
                    except CheckpointError as agree:
                        log.error("step %d: agreeing on a retry failed: %s", step, agree)
                        again = False
                    final = final or not again
                if final:
                    log.error("step %d cannot be flushed: %s", step, exc)
                    return exc
                if out_of_time:
                    log.error("step %d could not be flushed to %s: %s", step, self.dst.url, exc)
                    return StorageError(
                        f"step {step} is on scratch ({self.src.url}) but could not be flushed "
                        f"to the persistent tier {self.dst.url} after {attempt} "
                        f"attempt{'s' * (attempt > 1)}: {exc}"
                    )
                if attempt == 1:
                    log.warning(
                        "flushing step %d to %s failed (%s); it stays on scratch, retrying",
                        step,
                        self.dst.url,
                        exc,
                    )
                self._wait(delay)
                delay = min(delay * 2, _BACKOFF_MAX)
                continue
            self.last_error = None
            seconds = time.perf_counter() - t0
            log.debug("step %d flushed: %d bytes in %.3f s", step, nbytes, seconds)
            return Flushed(step, nbytes, seconds)
