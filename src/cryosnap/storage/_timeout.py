"""TimeoutStore: every call of a store bounded in time, so that a tier that stops answering
surfaces as :class:`~cryosnap.errors.StorageTimeoutError` instead of hanging its caller.

A call that times out is abandoned, not cancelled: callers treat "timed out" as "unknown".
Threads: one process-wide pool of daemon workers (``cryosnap-storage``), one per call in flight;
the caller may be any thread. docs/design/storage.md has what an abandoned call may still do.
"""

from __future__ import annotations

import builtins
import dataclasses
import math
import os
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any, Generic, TypeVar

from cryosnap.errors import StorageError, StorageTimeoutError
from cryosnap.storage._wrap import WrapperStore
from cryosnap.storage.base import BlobWriter, BytesLike, ConditionalWrites, Store, StoreCapabilities

__all__ = ["DEFAULT_MAX_STUCK_CALLS", "TimeoutStore"]

_T = TypeVar("_T")

# Abandoned calls of one store that may be outstanding before its tier counts as unresponsive.
DEFAULT_MAX_STUCK_CALLS = 4
# An idle worker exits after this long (a later call starts a new one in ~0.1 ms).
_IDLE_SECONDS = 20.0
# A commit may flush everything written to the device: its limit grows by a second per this
# many bytes, a rate below any disk or network file system a checkpoint would live on.
_COMMIT_FLOOR_BYTES_PER_SECOND = 32 << 20


class _Call(Generic[_T]):
    """One store call handed to a worker, and what the caller and the worker agree on.

    ``guard`` orders the end of the call against the caller's timeout: the worker marks the call
    finished under it, the caller marks it abandoned under it; whichever comes first wins and
    the other sees it.
    """

    __slots__ = (
        "abandoned",
        "done",
        "error",
        "finished",
        "fn",
        "guard",
        "late",
        "owner",
        "result",
    )

    def __init__(
        self,
        owner: TimeoutStore,
        fn: Callable[[], _T],
        late: Callable[[_T | None], None] | None = None,
    ) -> None:
        self.owner = owner
        self.fn = fn
        self.late = late  # cleanup once an abandoned call returns, given its result
        self.result: _T | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.abandoned = False
        self.guard = threading.Lock()
        self.done = threading.Lock()
        self.done.acquire()  # released by the worker when the call has ended

    def run(self) -> None:
        """On a worker: make the call and keep its outcome (or drop it if abandoned); the
        worker then releases ``done``."""
        result: _T | None = None
        error: BaseException | None = None
        try:
            result = self.fn()
        except BaseException as exc:  # handed to the caller, who raises it as it is
            error = exc
        with self.guard:
            self.finished = True
            abandoned = self.abandoned
            if not abandoned:
                self.result, self.error = result, error
        if abandoned:
            self.owner._returned()
            if self.late is not None:
                with suppress(Exception):
                    self.late(result)

    def outcome(self) -> _T:
        error, self.error = self.error, None
        if error is not None:
            try:
                raise error
            finally:
                del error  # no cycle through this frame's traceback
        return self.result  # type: ignore[return-value]  # None only for calls returning None


class _Pool:
    """Daemon worker threads, one per call in flight, shared by every TimeoutStore."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: queue.SimpleQueue[_Call[Any]] = queue.SimpleQueue()
        self._idle = 0  # workers waiting for a task and not yet promised one
        self._started = 0

    def submit(self, call: _Call[Any]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1  # promised to this call
            self._started += int(spawn)
            n = self._started
        if not spawn:
            self._tasks.put(call)
            return
        thread = threading.Thread(
            target=self._work, args=(call,), name=f"cryosnap-storage-{n}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as exc:  # the process is out of threads
            raise StorageError(
                f"cannot start a thread for a storage call on {call.owner.url}: {exc}"
            ) from exc

    def _work(self, call: _Call[Any] | None) -> None:
        while call is not None:
            call.run()
            with self._lock:
                # Idle before the caller wakes: its next call reuses this worker.
                self._idle += 1
            call.done.release()
            call = None  # an idle worker holds nothing of the caller's (buffers, results)
            call = self._next()

    def _next(self) -> _Call[Any] | None:
        """The next call for this idle worker; None when it should exit."""
        while True:
            try:
                return self._tasks.get(timeout=_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:
                        self._idle -= 1
                        return None
                # Every idle worker has been promised a call: one is on its way to the queue.


_pool = _Pool()
_stores: weakref.WeakSet[TimeoutStore] = weakref.WeakSet()


def _after_fork() -> None:
    # The child has none of the parent's threads: no worker, and no abandoned call to wait for.
    global _pool
    _pool = _Pool()
    for store in list(_stores):
        store._stuck = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


class TimeoutStore(WrapperStore):
    """Bounds every call of ``inner`` to ``timeout_seconds`` (see the module docstring).

    ``max_stuck_calls``: how many abandoned calls may be outstanding before new calls fail at
    once with StorageTimeoutError.
    """

    def __init__(
        self,
        inner: Store,
        timeout_seconds: float,
        *,
        max_stuck_calls: int = DEFAULT_MAX_STUCK_CALLS,
    ) -> None:
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)):
            raise TypeError(f"timeout_seconds must be a number of seconds, got {timeout_seconds!r}")
        if not 0 < timeout_seconds < math.inf:
            raise ValueError(
                f"timeout_seconds={timeout_seconds!r} is invalid: allowed is a positive, finite "
                "number of seconds"
            )
        if isinstance(max_stuck_calls, bool) or not isinstance(max_stuck_calls, int):
            raise TypeError(f"max_stuck_calls must be an int, got {max_stuck_calls!r}")
        if max_stuck_calls < 1:
            raise ValueError(f"max_stuck_calls={max_stuck_calls} is invalid: allowed is >= 1")
        super().__init__(inner)
        self.timeout_seconds = float(timeout_seconds)
        self.max_stuck_calls = max_stuck_calls
        self._lock = threading.Lock()
        self._stuck = 0
        _stores.add(self)

    def __repr__(self) -> str:
        return f"TimeoutStore({self.inner!r}, timeout_seconds={self.timeout_seconds:g})"

    @property
    def capabilities(self) -> StoreCapabilities:
        caps = self.inner.capabilities
        if caps.conditional_writes is None:
            return caps
        bounded = _BoundedConditionalWrites(caps.conditional_writes, self.timeout_seconds)
        return dataclasses.replace(caps, conditional_writes=bounded)

    @property
    def stuck_calls(self) -> int:
        """Abandoned calls that have not returned yet."""
        return self._stuck

    # -- running calls -----------------------------------------------------------------------

    def _call(
        self,
        action: str,
        key: str,
        fn: Callable[[], _T],
        *,
        late: Callable[[_T | None], None] | None = None,
        limit: float | None = None,
        writer: _TimeoutWriter | None = None,
    ) -> _T:
        """Run ``fn`` on a worker; raise StorageTimeoutError if it does not end in time."""
        if self._stuck >= self.max_stuck_calls:
            raise StorageTimeoutError(
                f"{action} {key} in {self.url} was not attempted: {self._stuck} earlier calls "
                f"have not returned after {self.timeout_seconds:g} s; the tier is unresponsive"
            )
        call = _Call(self, fn, late)
        seconds = self.timeout_seconds if limit is None else limit
        submitted = False
        try:
            _pool.submit(call)
            submitted = True
            ended = call.done.acquire(timeout=seconds)
        except BaseException:
            if not submitted:
                raise
            # Interrupted while waiting (KeyboardInterrupt): the call goes on without a caller,
            # like one that timed out (a writer's abort must wait for it, not race it).
            self._abandon(call, writer)
            raise
        if not ended and self._abandon(call, writer):
            raise StorageTimeoutError(
                f"{action} {key} in {self.url} did not return within {seconds:g} s; "
                "the tier is unresponsive"
            )
        return call.outcome()

    def _abandon(self, call: _Call[Any], writer: _TimeoutWriter | None) -> bool:
        """Give up waiting for ``call``; False if it has ended meanwhile (its outcome stands)."""
        with call.guard:
            if call.finished:
                return False
            call.abandoned = True
            with self._lock:
                self._stuck += 1
            if writer is not None:
                writer._stuck = call
            return True

    def _returned(self) -> None:
        """An abandoned call has returned (on its worker)."""
        with self._lock:
            self._stuck = max(0, self._stuck - 1)

    # -- the Store primitives ----------------------------------------------------------------

    def read(self, key: str) -> bytes:
        return self._call("reading", key, lambda: self.inner.read(key))

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self._call("reading", key, lambda: self.inner.read_into(key, offset, buffers))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        self._call("reading", key, lambda: self.inner.read_ranges(key, ranges))

    def map_file(self, key: str) -> memoryview | None:
        """``inner``'s :meth:`LocalStore.map_file` (bounded like any call), or None if it has
        none. Only file systems whose faults cannot wait on a network map at all."""
        inner = getattr(self.inner, "map_file", None)
        if inner is None:
            return None
        mapped: memoryview | None = self._call("mapping", key, lambda: inner(key))
        return mapped

    def cached_share(self, key: str) -> float | None:
        """``inner``'s :meth:`LocalStore.cached_share` (bounded like any call), or None if it
        has none."""
        inner = getattr(self.inner, "cached_share", None)
        if inner is None:
            return None
        share: float | None = self._call("probing", key, lambda: inner(key))
        return share

    def read_ranges_cold(
        self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]
    ) -> None:
        """``inner``'s :meth:`LocalStore.read_ranges_cold` (bounded like any call), or its
        plain ``read_ranges``."""
        inner = getattr(self.inner, "read_ranges_cold", self.inner.read_ranges)
        self._call("reading", key, lambda: inner(key, ranges))

    def write(self, key: str, data: BytesLike) -> None:
        # A late write must store what was passed, not what a mutable buffer holds by then.
        payload = data if isinstance(data, bytes) else bytes(data)
        self._call("writing", key, lambda: self.inner.write(key, payload))

    def open_writer(self, key: str) -> BlobWriter:
        inner = self._call(
            "creating", key, lambda: self.inner.open_writer(key), late=_abort_late_writer
        )
        return _TimeoutWriter(self, inner)

    def exists(self, key: str) -> bool:
        return self._call("checking", key, lambda: self.inner.exists(key))

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self._call("listing", prefix or ".", lambda: self.inner.list(prefix))

    def size(self, key: str) -> int:
        return self._call("stat of", key, lambda: self.inner.size(key))

    def delete(self, key: str) -> None:
        self._call("deleting", key, lambda: self.inner.delete(key))

    def remove_incomplete(self, prefix: str = "") -> builtins.list[str]:
        return self._call(
            "removing incomplete files under",
            prefix or ".",
            lambda: self.inner.remove_incomplete(prefix),
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _BoundedConditionalWrites:
    """``inner``'s conditional writes, each request bounded by at most ``seconds``."""

    inner: ConditionalWrites
    seconds: float

    def get(self, key: str, *, timeout: float) -> tuple[bytes, str] | None:
        return self.inner.get(key, timeout=min(timeout, self.seconds))

    def create(self, key: str, data: bytes, *, timeout: float) -> str | None:
        return self.inner.create(key, data, timeout=min(timeout, self.seconds))

    def replace(self, key: str, data: bytes, tag: str, *, timeout: float) -> str | None:
        return self.inner.replace(key, data, tag, timeout=min(timeout, self.seconds))

    def delete(self, key: str, tag: str | None, *, timeout: float) -> None:
        self.inner.delete(key, tag, timeout=min(timeout, self.seconds))


def _abort_late_writer(writer: BlobWriter | None) -> None:
    # open_writer timed out and returned later: nobody will write to or commit that writer.
    if writer is not None:
        writer.abort()


class _TimeoutWriter:
    """A writer whose ``write``/``commit``/``abort`` are bounded like the store's calls."""

    def __init__(self, store: TimeoutStore, inner: BlobWriter) -> None:
        self._store = store
        self._inner = inner
        self.key = inner.key
        self._stuck: _Call[Any] | None = None  # the call that timed out, maybe still running

    def _usable(self, action: str) -> None:
        if self._stuck is not None:
            raise StorageTimeoutError(
                f"{action} {self.key} in {self._store.url} refused: an earlier call of this "
                f"writer did not return within {self._store.timeout_seconds:g} s; the tier is "
                "unresponsive"
            )

    def write(self, buffers: Sequence[BytesLike]) -> None:
        self._usable("writing")
        self._store._call("writing", self.key, lambda: self._inner.write(buffers), writer=self)

    def tell(self) -> int:
        return self._inner.tell()

    def commit(self) -> None:
        self._usable("committing")
        limit = self._store.timeout_seconds + self._inner.tell() / _COMMIT_FLOOR_BYTES_PER_SECOND
        self._store._call("committing", self.key, self._inner.commit, limit=limit, writer=self)

    def abort(self) -> None:
        stuck = self._stuck
        if stuck is not None:
            with stuck.guard:
                if not stuck.finished:
                    # Aborting now would race the stuck call on the same file descriptor.
                    stuck.late = lambda _result: self._inner.abort()
                    return
        with suppress(StorageTimeoutError):
            # Cleanup after a failure: a timeout here must not mask that failure.
            self._store._call("aborting", self.key, self._inner.abort, writer=self)
