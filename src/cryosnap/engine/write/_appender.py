"""The appender of one data file: buffers queued by the writer thread are written, in order,
on an I/O thread of its own, then fsynced and committed behind the last of them.

``append``, ``start_commit``, ``wait_commit`` and ``abort`` run on the writer thread; the
writes (and a level codec's compression of them), the commit and the ``release`` callbacks on
the appender's I/O thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from cryosnap.storage import Store
from cryosnap.storage.base import BlobWriter
from cryosnap.storage.striped import Placement

__all__ = ["Appender", "FileCodec"]


class FileCodec(Protocol):
    """How a level stores the data files written to it (``Checkpointer(codec=)``: the
    persistent level's ``LevelCodec``, _run/levels/codec.py): coded or plain, file by file,
    and what each one cost."""

    def use(self) -> bool:
        """Whether the next data file is coded."""
        ...

    def open_writer(self, dst: Store, key: str, *, coded: bool | None = None) -> BlobWriter:
        """The writer of ``key`` on ``dst``, coded or plain."""
        ...

    def written(self, writer: BlobWriter) -> None:
        """Count a file its writer (of :meth:`open_writer`) committed."""
        ...


@dataclass(frozen=True, slots=True)
class _Append:
    """Write ``views`` back to back (``nbytes`` in all), then call ``release``."""

    views: list[memoryview]
    release: Callable[[], None]
    nbytes: int


class _Commit:
    """Fsync and commit the file behind every write queued before."""


class _Stop:
    """End the I/O thread."""


_COMMIT: Final = _Commit()
_STOP: Final = _Stop()

_Task = _Append | _Commit | _Stop


class Appender:
    """Appends buffers to one data file on a thread of its own, so hashing and diffing the
    next batch (Python, holds the GIL) overlaps writing this one (syscalls, release it).
    With a ``placement`` it reports each write's bytes and busy seconds to it. The file is
    opened by the first write that has bytes: a part with no new bytes makes none. With a
    ``codec`` the file is written through it, ``coded`` or plain (decided by the caller before
    the first write, so its manifest can say so while the file is still being written)."""

    def __init__(
        self,
        store: Store,
        key: str,
        placement: Placement | None = None,
        device: int = 0,
        *,
        codec: FileCodec | None = None,
        coded: bool = False,
    ) -> None:
        self.store = store
        self.key = key
        self.placement = placement
        self.device = device
        self.codec = codec
        self.coded = coded
        self._queue: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._writer: BlobWriter | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def append(self, views: list[memoryview], release: Callable[[], None], nbytes: int) -> None:
        """Queue ``views`` (``nbytes``); ``release`` runs once they are written (or dropped,
        on a failure). An earlier write's failure is raised here, after queueing."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cryosnap-io", daemon=True)
            self._thread.start()
        self._queue.put(_Append(views, release, nbytes))
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if isinstance(task, _Stop):
                return
            if isinstance(task, _Commit):
                self._commit()
            else:
                self._write(task)

    def _commit(self) -> None:
        try:
            if self._error is None and self._writer is not None:
                t0 = time.perf_counter()
                self._writer.commit()
                self._observe(0, time.perf_counter() - t0)
                if self.codec is not None:
                    self.codec.written(self._writer)
        except BaseException as exc:
            self._error = exc

    def _write(self, task: _Append) -> None:
        try:
            if task.views and self._error is None:
                t0 = time.perf_counter()
                if self._writer is None:
                    self._writer = self._open()
                self._writer.write(task.views)
                self._observe(task.nbytes, time.perf_counter() - t0)
        except BaseException as exc:
            self._error = exc
        finally:
            if self.placement is not None:
                self.placement.done(self.device, task.nbytes)
            task.release()

    def _open(self) -> BlobWriter:
        if self.codec is None:
            return self.store.open_writer(self.key)
        return self.codec.open_writer(self.store, self.key, coded=self.coded)

    def _observe(self, nbytes: int, seconds: float) -> None:
        if self.placement is not None:
            self.placement.observe(self.device, nbytes, seconds)

    def _join(self) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def start_commit(self) -> None:
        """Queue the fsync and rename behind the last write; ``wait_commit`` waits for it."""
        if self._thread is not None:
            self._queue.put(_COMMIT)

    def wait_commit(self) -> None:
        self._join()
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        self._join()
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
