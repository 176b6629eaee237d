"""WrapperStore: the base of stores that wrap one other store (timeouts, fault injection).

It forwards every Store primitive and ``capabilities`` unchanged; :func:`unwrap` tells which
backend lies underneath, never for data. Runs on the calling thread, like the store it wraps.
docs/design/storage.md has the why.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence

from cryosnap.storage.base import BlobWriter, BytesLike, Store, StoreCapabilities

__all__ = ["WrapperStore", "unwrap"]


class WrapperStore:
    """A store that forwards every primitive to ``inner``."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def capabilities(self) -> StoreCapabilities:
        return self.inner.capabilities

    def read(self, key: str) -> bytes:
        return self.inner.read(key)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.inner.read_into(key, offset, buffers)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        self.inner.read_ranges(key, ranges)

    def write(self, key: str, data: BytesLike) -> None:
        self.inner.write(key, data)

    def open_writer(self, key: str) -> BlobWriter:
        return self.inner.open_writer(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.list(prefix)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def remove_incomplete(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.remove_incomplete(prefix)


def unwrap(store: Store) -> Store:
    """The backend under ``store``'s wrappers (``store`` itself when it wraps nothing).

    To tell which backend and location a store is (tests, two stores that are one location);
    a feature of the backend is asked of ``store.capabilities`` instead, and reads and writes
    go through ``store`` so that its wrappers (timeouts, injected faults) apply.
    """
    while isinstance(store, WrapperStore):
        store = store.inner
    return store
