"""Flush: copy committed versions from the scratch tier to the persistent tier, in order.

A version is flushed by copying every file it needs that the persistent tier lacks (its data
files, its manifests and those of the versions its chain inherits from), each one durable before
the next, and writing its commit record *last*: a persistent commit record never names a byte
that is not durable there, so a crash or an outage mid-flush leaves no torn version, only files
that the next flush reuses or retention removes. The copied files keep their keys, so the
version reads on the persistent tier exactly as on scratch (each tier is self-contained).

:class:`Flusher` runs the flushes on a thread of its own, one version after the other in the
order they were committed on scratch. A failing flush (the persistent tier is down or refuses)
is retried with exponential backoff for ``retry_seconds``; meanwhile saves keep landing on
scratch, and scratch retention keeps every version that is not yet persistent. Only the run's
writer flushes; no collectives here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import xxhash

from .engine import read_commit
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
    StorageError,
)
from .manifest import commit_key, manifest_key
from .storage import Store

__all__ = ["Flusher", "SourceDamagedError", "flush_version"]

_T = TypeVar("_T")

log = logging.getLogger("cryosnap")

# Bytes copied per read/write call: large sequential I/O on both tiers.
_COPY_BYTES = 16 << 20
_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 5.0


def _no_wait() -> None:
    return None


def _copy_file(
    src: Store, dst: Store, key: str, nbytes: int, yield_to: Callable[[], None] = _no_wait
) -> None:
    writer = dst.open_writer(key)
    try:
        buf = bytearray(min(nbytes, _COPY_BYTES))
        view = memoryview(buf)
        offset = 0
        while offset < nbytes:
            yield_to()
            n = min(len(buf), nbytes - offset)
            src.read_into(key, offset, [view[:n]])
            writer.write([view[:n]])
            offset += n
        writer.commit()
    except BaseException:
        writer.abort()
        raise


class SourceDamagedError(CheckpointError):
    """The version cannot be flushed because its scratch copy is incomplete or damaged:
    retrying would not help (the persistent tier is not the problem)."""


def _from_src(step: int, src: Store, read: Callable[[], _T]) -> _T:
    try:
        return read()
    except (CheckpointNotFoundError, IntegrityError, CheckpointFormatError) as exc:
        raise SourceDamagedError(f"step {step} on scratch {src.url} is damaged: {exc}") from exc


def flush_version(
    src: Store, dst: Store, step: int, *, yield_to: Callable[[], None] = _no_wait
) -> int:
    """Make version ``step`` of ``src`` complete on ``dst``; returns the bytes copied.

    Data files already on ``dst`` with the right size are kept (an earlier flush of the chain,
    or a flush interrupted after them): their names are unique and stores make a file visible
    only once it is whole. Manifests (whose names are not unique: a step may be saved again
    after a crash) are kept only when their bytes are the same. ``yield_to()`` is called before
    each piece copied: it may block (the program is capturing a version: its stall comes
    first). A damaged or incomplete scratch copy raises :class:`SourceDamagedError`.
    """
    record = _from_src(step, src, lambda: read_commit(src, step))
    copied = 0
    for key in record.data_files:
        nbytes = _from_src(step, src, lambda key=key: src.size(key))  # type: ignore[misc]
        if dst.exists(key) and dst.size(key) == nbytes:
            continue
        _from_src(step, src, lambda key=key, n=nbytes: _copy_file(src, dst, key, n, yield_to))  # type: ignore[misc]
        copied += nbytes
    # The manifests of this version and of every version its chain inherits from, by the keys
    # they must have; their commit records are not needed (a base may be gone from scratch's
    # retention: it is not a version here, only a manifest this one resolves through).
    ranks = sorted(m.rank for m in record.manifests)
    own = {m.key: m.xxh3 for m in record.manifests}
    keys = [manifest_key(s, r) for s in (record.chain or (step,)) for r in ranks]
    for key in dict.fromkeys([*keys, *own]):
        data = _from_src(step, src, lambda key=key: src.read(key))  # type: ignore[misc]
        if key in own and xxhash.xxh3_128_hexdigest(data) != own[key]:
            raise SourceDamagedError(
                f"step {step} on scratch {src.url}: manifest {key} does not match its hash"
            )
        if dst.exists(key) and dst.read(key) == data:
            continue
        dst.write(key, data)
        copied += len(data)
    body = _from_src(step, src, lambda: src.read(commit_key(step)))
    dst.write(commit_key(step), body)
    return copied + len(body)


class Flusher:
    """Flushes committed scratch versions to the persistent tier on a background thread.

    ``on_done(step, error)`` runs on the flusher thread once a version is persistent
    (``error`` None) or has failed for good.
    """

    def __init__(
        self,
        src: Store,
        dst: Store,
        *,
        retry_seconds: float,
        on_done: Callable[[int, BaseException | None], None],
        yield_to: Callable[[], None] = _no_wait,
    ) -> None:
        self.src = src
        self.yield_to = yield_to
        self.dst = dst
        self.retry_seconds = retry_seconds
        self.on_done = on_done
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._closing_deadline = float("inf")
        self._thread = threading.Thread(target=self._run, name="cryosnap-flush", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        self._queue.put(step)

    def finish_within(self, seconds: float) -> None:
        """From now on, retries of every queued flush together end after ``seconds``."""
        self._closing_deadline = min(self._closing_deadline, time.monotonic() + seconds)

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
            error = self._flush(step)
            try:
                self.on_done(step, error)
            except Exception:  # pragma: no cover - the callback must not stop the flusher
                log.exception("after flushing step %d", step)

    def _flush(self, step: int) -> BaseException | None:
        deadline = time.monotonic() + self.retry_seconds
        delay = _BACKOFF_FIRST
        attempt = 0
        while True:
            attempt += 1
            try:
                t0 = time.perf_counter()
                nbytes = flush_version(self.src, self.dst, step, yield_to=self.yield_to)
            except (CheckpointError, OSError) as exc:
                self.last_error = exc
                if isinstance(exc, SourceDamagedError):
                    log.error("step %d cannot be flushed: %s", step, exc)
                    return exc
                give_up = min(deadline, self._closing_deadline)
                if self._stop.is_set() or time.monotonic() + delay > give_up:
                    log.error("step %d could not be flushed to %s: %s", step, self.dst.url, exc)
                    return StorageError(
                        f"step {step} is on scratch ({self.src.url}) but could not be flushed "
                        f"to the persistent tier {self.dst.url} after {attempt} attempts: {exc}"
                    )
                if attempt == 1:
                    log.warning(
                        "flushing step %d to %s failed (%s); it stays on scratch, retrying",
                        step,
                        self.dst.url,
                        exc,
                    )
                self._stop.wait(delay)
                delay = min(delay * 2, _BACKOFF_MAX)
                continue
            self.last_error = None
            log.debug("step %d flushed: %d bytes in %.3f s", step, nbytes, time.perf_counter() - t0)
            return None
