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

from .engine import read_commit
from .errors import CheckpointError, StorageError
from .manifest import commit_key, version_prefix
from .storage import Store

__all__ = ["Flusher", "flush_version"]

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


def flush_version(
    src: Store, dst: Store, step: int, *, yield_to: Callable[[], None] = _no_wait
) -> int:
    """Make version ``step`` of ``src`` complete on ``dst``; returns the bytes copied.

    Files already on ``dst`` with the right size are kept (an earlier flush of the chain, or a
    flush interrupted after them): stores make a file visible only once it is whole.
    ``yield_to()`` is called before each piece copied: it may block (the program is capturing
    a version: its stall comes first).
    """
    record = read_commit(src, step)
    copied = 0
    for key in record.data_files:
        nbytes = src.size(key)
        if dst.exists(key) and dst.size(key) == nbytes:
            continue
        _copy_file(src, dst, key, nbytes, yield_to)
        copied += nbytes
    # Manifests of this version and of the versions it inherits from; their commit records
    # are not needed (a base may be gone from scratch's retention; it is not a version here).
    own = commit_key(step)
    for s in record.chain or (step,):
        for key in src.list(version_prefix(s)):
            if key.endswith("/COMMIT.json"):
                continue
            if dst.exists(key):
                continue
            data = src.read(key)
            dst.write(key, data)
            copied += len(data)
    body = src.read(own)
    dst.write(own, body)
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
        self._lock = threading.Lock()
        self._waiting: list[int] = []  # queued or in progress, in order
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cryosnap-flush", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        with self._lock:
            self._waiting.append(step)
        self._queue.put(step)

    def pending(self) -> tuple[int, ...]:
        """Versions committed on scratch and not yet on the persistent tier."""
        with self._lock:
            return tuple(self._waiting)

    def close(self) -> None:
        """Finish the queued flushes (each retried at most ``retry_seconds``), then stop."""
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
            with self._lock:
                self._waiting.remove(step)
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
                if self._stop.is_set() or time.monotonic() + delay > deadline:
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
