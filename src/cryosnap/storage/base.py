"""The Store protocol: the handful of primitives every storage backend provides.

Keys are relative ``/``-separated paths, validated here, so no backend touches a path outside
its root; :class:`cryosnap.testing.store.StoreTests` checks the contract on every backend.
Runs on the calling thread; stores hold no locks, callers serialize writes to one key.
docs/design/storage.md has the contract and how to add a backend.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from cryosnap._format.keys import validate_key
from cryosnap.errors import ConditionalWritesUnsupported, TruncatedError

__all__ = [
    "BlobWriter",
    "BytesLike",
    "ConditionalWrites",
    "ConditionalWritesUnsupported",
    "Store",
    "StoreCapabilities",
    "TruncatedError",
    "validate_key",
]

# Buffers cross this interface as memoryviews (numpy arrays and tensors are viewed first).
BytesLike = bytes | bytearray | memoryview


class BlobWriter(Protocol):
    """A large file being written; invisible until :meth:`commit`."""

    key: str

    def write(self, buffers: Sequence[BytesLike]) -> None:
        """Append ``buffers`` (in order) to the file."""
        ...

    def tell(self) -> int:
        """Bytes written so far."""
        ...

    def commit(self) -> None:
        """Make the file durable and visible under its key."""
        ...

    def abort(self) -> None:
        """Discard the file; never raises for a file that is already gone."""
        ...


class ConditionalWrites(Protocol):
    """Compare-and-swap on single keys of a store: writes that take effect only if the key is
    as the caller last saw it (S3's ``If-None-Match`` / ``If-Match``), so that two writers can
    never both win. The run lock uses them on object stores (:mod:`cryosnap._run.lock`).

    A key's *tag* (an S3 ETag) changes whenever its content does. Each request returns or raises
    within ``timeout`` seconds (:class:`~cryosnap.errors.StorageTimeoutError`); failures are
    :class:`~cryosnap.errors.StorageError`, and :class:`ConditionalWritesUnsupported` when the
    server turns the conditions down. A request retried by the backend after its first attempt
    landed may fail its own condition: ``create`` and ``replace`` then read the key back and succeed
    if it holds exactly ``data``.
    """

    def get(self, key: str, *, timeout: float) -> tuple[bytes, str] | None:
        """The content of ``key`` and its tag; None if there is no such key."""
        ...

    def create(self, key: str, data: bytes, *, timeout: float) -> str | None:
        """Store ``data`` under ``key`` only if ``key`` does not exist: its tag, or None."""
        ...

    def replace(self, key: str, data: bytes, tag: str, *, timeout: float) -> str | None:
        """Store ``data`` only if ``key``'s tag is still ``tag``: the new tag, or None (the key
        changed or is gone)."""
        ...

    def delete(self, key: str, tag: str | None, *, timeout: float) -> None:
        """Delete ``key`` if its tag is ``tag`` (None: whatever it holds); a key that changed
        or is gone is left alone."""
        ...


@dataclass(frozen=True, slots=True)
class StoreCapabilities:
    """What a store offers beyond the Store primitives, declared by the store (never inferred
    from its class). Fixed for the store's lifetime; wrappers forward their inner store's.
    The conformance suite checks that what a store declares is true.

    ``local_path``: the local directory that holds every key ``k`` as the regular file
    ``local_path / k`` (a :class:`~cryosnap.storage.LocalStore`'s root), or None. Read by
    :mod:`cryosnap._run.lock`, which takes an ``flock`` in it instead of a lock object, by the
    CLI, which looks for runs in its subdirectories, and by ``gc``'s report, which measures the
    leftovers of writes that never committed there (``engine.incomplete_files``). A store
    declares one only if every key is there: a StripedStore over several devices declares
    none, and so does an FsspecStore even on fsspec's local file system (its runs keep the
    lock protocol of fsspec stores).

    ``conditional_writes``: compare-and-swap requests on the store's keys
    (:class:`ConditionalWrites`), or None. Read by :mod:`cryosnap._run.lock`, which keeps its lock
    object with them (S3), and otherwise falls back to its claims protocol. They bypass the
    Store primitives: a wrapper that forwards them applies its own rules to them or none
    (TimeoutStore bounds them, FaultyStore injects no faults into them).
    """

    local_path: Path | None = None
    conditional_writes: ConditionalWrites | None = None


@runtime_checkable
class Store(Protocol):
    """Primitives of one storage location (a run directory or URL prefix)."""

    @property
    def url(self) -> str:
        """Where the store lives, for messages (a path or a URL)."""
        ...

    @property
    def capabilities(self) -> StoreCapabilities:
        """What this store offers beyond the primitives below (see StoreCapabilities)."""
        ...

    def read(self, key: str) -> bytes:
        """The whole content of ``key``."""
        ...

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        """Fill ``buffers`` (writable, in order) from ``key`` starting at byte ``offset``."""
        ...

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        """``read_into`` for several ``(offset, buffers)`` ranges of one file, opened once."""
        ...

    def write(self, key: str, data: BytesLike) -> None:
        """Atomically replace ``key`` with ``data`` (bytes or any buffer); durable on return."""
        ...

    def open_writer(self, key: str) -> BlobWriter:
        """Start writing a large file under ``key``."""
        ...

    def exists(self, key: str) -> bool:
        """Whether ``key`` is a committed file."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys of the committed files under the directory ``prefix``."""
        ...

    def size(self, key: str) -> int:
        """Size of ``key`` in bytes."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""
        ...

    def remove_incomplete(self, prefix: str = "") -> builtins.list[str]:
        """Delete the leftovers of writes that never committed under the directory ``prefix``
        (a crashed writer's ``.partial`` and temporary files) and return their names.

        Only the run's writer calls it, while none of its own writes is in progress; a store
        whose writes leave nothing behind (an object store's single PUT) returns ``[]``.
        """
        ...
