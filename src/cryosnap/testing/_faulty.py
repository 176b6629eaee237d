"""Fault injection for tests and benchmarks: a store wrapper that fails, stalls or throttles,
and the syscalls of direct writes that fail midway.

``FaultyStore(inner, fault=...)`` calls ``fault(op, key)`` before every operation;
``bytes_per_second`` throttles writes. Conditional writes bypass the primitives: no faults.
``FaultySyscalls(fault)`` goes to ``LocalStore(..., syscalls=)``. Runs on the calling thread;
``fault`` runs there too, before the operation. docs/design/storage.md lists the operations.
"""

from __future__ import annotations

import builtins
import fcntl
import os
import threading
import time
from collections.abc import Callable, Sequence

from cryosnap.storage._direct import BLOCK_BYTES, O_DIRECT, Syscalls
from cryosnap.storage._wrap import WrapperStore
from cryosnap.storage.base import BlobWriter, BytesLike, Store

__all__ = ["FaultyStore", "FaultySyscalls"]

Fault = Callable[[str, str], None]


def _no_fault(op: str, key: str) -> None:
    return None


class FaultyStore(WrapperStore):
    """Wraps a store; every primitive first calls ``fault(op, key)``."""

    def __init__(
        self,
        inner: Store,
        *,
        fault: Fault = _no_fault,
        bytes_per_second: float | None = None,
    ) -> None:
        super().__init__(inner)
        self.fault = fault
        self.bytes_per_second = bytes_per_second
        self.ops: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _hit(self, op: str, key: str) -> None:
        with self._lock:
            self.ops.append((op, key))
        self.fault(op, key)

    def read(self, key: str) -> bytes:
        self._hit("read", key)
        return self.inner.read(key)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self._hit("read_into", key)
        self.inner.read_into(key, offset, buffers)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        self._hit("read_into", key)
        self.inner.read_ranges(key, ranges)

    def write(self, key: str, data: BytesLike) -> None:
        self._hit("write", key)
        self.inner.write(key, data)

    def open_writer(self, key: str) -> BlobWriter:
        self._hit("open_writer", key)
        return _FaultyWriter(self, self.inner.open_writer(key))

    def exists(self, key: str) -> bool:
        self._hit("exists", key)
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> builtins.list[str]:
        self._hit("list", prefix)
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        self._hit("size", key)
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self._hit("delete", key)
        self.inner.delete(key)

    def remove_incomplete(self, prefix: str = "") -> builtins.list[str]:
        self._hit("remove_incomplete", prefix)
        return self.inner.remove_incomplete(prefix)


class _FaultyWriter:
    def __init__(self, store: FaultyStore, inner: BlobWriter) -> None:
        self._store = store
        self._inner = inner
        self.key = inner.key

    def write(self, buffers: Sequence[BytesLike]) -> None:
        self._store._hit("writer.write", self.key)
        t0 = time.perf_counter()
        self._inner.write(buffers)
        rate = self._store.bytes_per_second
        if rate:
            nbytes = sum(memoryview(b).nbytes for b in buffers)
            time.sleep(max(0.0, nbytes / rate - (time.perf_counter() - t0)))

    def tell(self) -> int:
        return self._inner.tell()

    def commit(self) -> None:
        self._store._hit("writer.commit", self.key)
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class FaultySyscalls(Syscalls):
    """The writes of a :class:`~cryosnap.storage.LocalStore`'s direct-I/O data files (and of
    its probe), failing where ``fault(nbytes, direct)`` says: it runs before each ``pwrite``
    and ``pwritev`` (``nbytes``: all the call's bytes; ``direct``: the descriptor has
    ``O_DIRECT``) and raises an ``OSError`` (``EINVAL``: the
    device refuses direct I/O; ``ENOSPC``: the disk is full), returns a byte count below
    ``nbytes`` (a short write: that many bytes land), or None (the write as asked).
    ``writes`` lists ``(nbytes, direct)`` of every write that landed.

    ``read_fault(nbytes, direct)`` does the same before each ``preadv`` of a cold restore's
    reads (:meth:`LocalStore.read_ranges_cold`): an ``OSError``, a byte count below ``nbytes``
    (a short read: that many bytes land) or None. ``reads`` lists ``(nbytes, direct)`` of
    every read that returned."""

    def __init__(
        self,
        fault: Callable[[int, bool], int | None] = lambda n, direct: None,
        read_fault: Callable[[int, bool], int | None] = lambda n, direct: None,
    ) -> None:
        self.fault = fault
        self.read_fault = read_fault
        self.writes: list[tuple[int, bool]] = []
        self.reads: list[tuple[int, bool]] = []
        self._lock = threading.Lock()

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        direct = bool(flags & O_DIRECT)
        nbytes = sum(b.nbytes for b in buffers)
        n = self.read_fault(nbytes, direct)
        if n is not None and n < nbytes:
            if direct and n % BLOCK_BYTES:
                # The device read part of a block: those bytes land, as from the page cache.
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
                try:
                    data = os.pread(fd, n, offset) if n > 0 else b""
                finally:
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags)
                _land(buffers, data)
                return self._read(len(data), direct)
            buffers = _cut(buffers, n)
        return self._read(super().preadv(fd, buffers, offset), direct)

    def _read(self, n: int, direct: bool) -> int:
        with self._lock:
            self.reads.append((n, direct))
        return n

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        return self.pwritev(fd, [data], offset)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        direct = bool(flags & O_DIRECT)
        nbytes = sum(b.nbytes for b in buffers)
        n = self.fault(nbytes, direct)
        if n is not None and n < nbytes:
            buffers = _cut(buffers, n)
            if direct and n % BLOCK_BYTES:
                # The device wrote part of a block: land those bytes as it would have.
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~O_DIRECT)
                try:
                    return self._landed(os.pwritev(fd, buffers, offset) if n > 0 else 0, direct)
                finally:
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return self._landed(super().pwritev(fd, buffers, offset), direct)

    def _landed(self, n: int, direct: bool) -> int:
        with self._lock:
            self.writes.append((n, direct))
        return n


def _cut(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """The first ``nbytes`` of ``buffers``."""
    out = []
    for b in buffers:
        if nbytes <= 0:
            break
        out.append(b[:nbytes])
        nbytes -= b.nbytes
    return out


def _land(buffers: list[memoryview], data: bytes) -> None:
    at = 0
    for b in buffers:
        take = min(b.nbytes, len(data) - at)
        if take <= 0:
            break
        b[:take] = data[at : at + take]
        at += take
