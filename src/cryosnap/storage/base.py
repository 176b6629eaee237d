"""The Store protocol: the handful of primitives every storage backend provides.

A store is rooted at one run directory (or URL prefix) and addresses files by *keys*: relative,
``/``-separated paths such as ``versions/000000000005/COMMIT.json``. Keys are validated here, so
no backend ever touches a path outside its root.

Contract (checked by ``tests/unit/storage/conformance.py`` for every backend):

- ``write(key, data)`` is atomic and durable on return: a reader sees the old content (or no
  file) or the whole new content, never a prefix. Local: temp file + fsync + rename + directory
  fsync. Object stores: a single PUT, atomic by nature.
- ``open_writer(key)`` streams a large file; nothing is visible under ``key`` until ``commit()``
  returns, after which the bytes are durable. ``abort()`` removes what was written.
- ``read``/``read_into`` raise :class:`~cryosnap.errors.CheckpointNotFoundError` for a missing
  key and :class:`TruncatedError` when the file ends before the requested range.
- Every backend failure is raised as :class:`~cryosnap.errors.StorageError` naming the store and
  the key, with the backend's exception as ``__cause__``.

Runs on the calling thread; stores hold no locks, callers serialize writes to one key.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..errors import IntegrityError

__all__ = ["BlobWriter", "BytesLike", "Store", "TruncatedError", "validate_key"]

# Buffers cross this interface as memoryviews (numpy arrays and tensors are viewed first).
BytesLike = bytes | bytearray | memoryview

_KEY_SEGMENT = re.compile(r"^[A-Za-z0-9_.\-]+$")


class TruncatedError(IntegrityError):
    """A stored file ends before the byte range that was asked of it."""


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise ``ValueError``.

    Safe: non-empty ``/``-separated segments of letters, digits, ``_``, ``.``, ``-``; no segment
    is ``.`` or ``..``; no leading ``/``. This is what keeps a manifest from naming a file outside
    the run.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid storage key {key!r}: must be a non-empty string")
    for seg in key.split("/"):
        if seg in ("", ".", "..") or not _KEY_SEGMENT.match(seg):
            raise ValueError(
                f"invalid storage key {key!r}: segments must be non-empty, not '.' or '..', "
                "and made of letters, digits, '_', '.', '-'"
            )
    name = key.rsplit("/", 1)[-1]
    if name.endswith(".partial") or (name.startswith(".") and name.endswith(".tmp")):
        # These names are the stores' own files in progress (see _local.py).
        raise ValueError(f"invalid storage key {key!r}: '.partial' and '.*.tmp' are reserved")
    return key


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


@runtime_checkable
class Store(Protocol):
    """Primitives of one storage location (a run directory or URL prefix)."""

    @property
    def url(self) -> str:
        """Where the store lives, for messages (a path or a URL)."""
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

    def write(self, key: str, data: bytes) -> None:
        """Atomically replace ``key`` with ``data``; durable on return."""
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
