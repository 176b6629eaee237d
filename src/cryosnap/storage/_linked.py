"""LinkedStore: a run's store that also reads the data files a fork shares with its ancestors.

A fork's manifests name an ancestor's data file as ``ancestors/<i>/data/...``
(docs/FORMAT.md, "Forks"); this wrapper reads such a key from ``ancestors[i]`` of the run's
``FORK.json``, and every other key from the run itself. A reference is followed only when it
is one cryosnap made: the ancestor is an absolute local directory that holds the hold of this
fork (``forks/<token>.json``, naming this run and listing the file). Anything else is a
:class:`~cryosnap.errors.CheckpointFormatError` raised before the ancestor is read, so that an
edited ``FORK.json`` or manifest cannot make a reader open files outside the run and the runs
that agreed to be read. Writes and deletes never reach an ancestor. Runs on the calling thread.
"""

from __future__ import annotations

import builtins
import os
import threading
from collections.abc import Callable, Sequence

from cryosnap._format.forks import FORK_KEY, ForkRecord, Hold, hold_key, split_ancestor_key
from cryosnap.errors import CheckpointError, CheckpointFormatError, CheckpointNotFoundError
from cryosnap.storage._wrap import WrapperStore
from cryosnap.storage.base import BlobWriter, BytesLike, Store

__all__ = ["LinkedStore", "linked", "location_of"]


class LinkedStore(WrapperStore):
    """``inner``, with the ``ancestors/<i>/`` keys of a fork read from its ancestors (opened
    with ``opener`` on first use, each checked once)."""

    def __init__(self, inner: Store, opener: Callable[[str], Store]) -> None:
        super().__init__(inner)
        self._opener = opener
        self._lock = threading.Lock()
        self._record: ForkRecord | None = None
        self._read_record = False
        self._ancestors: dict[int, tuple[Store, frozenset[str]]] = {}

    def _route(self, key: str) -> tuple[Store, str]:
        if not key.startswith("ancestors/"):
            return self.inner, key
        parsed = split_ancestor_key(key)
        if parsed is None:
            raise CheckpointFormatError(f"{self.url}: malformed ancestor data file {key!r:.120}")
        index, inner_key = parsed
        store, files = self.ancestor(index)
        if inner_key not in files:
            # Not one the ancestor keeps for this fork: as good as missing (an older manifest
            # of a chain may name a file no version reads any more), and never read.
            raise CheckpointNotFoundError(
                f"{self.url}: {key}: ancestor {store.url} holds no such file for this fork",
                path=key,
            )
        return store, inner_key

    @property
    def opener(self) -> Callable[[str], Store]:
        """How this store opens its ancestors (``open_store``)."""
        return self._opener

    def location(self) -> str:
        """Where this run is, as its ancestors' holds name it (:func:`location_of`)."""
        return location_of(self.inner)

    def fork_record(self) -> ForkRecord | None:
        """This run's ``FORK.json`` (None: the run is no fork), read once."""
        with self._lock:
            if not self._read_record:
                try:
                    data = self.inner.read(FORK_KEY)
                except CheckpointNotFoundError:
                    data = None
                if data is not None:
                    self._record = ForkRecord.from_json(data, f"{self.url}/{FORK_KEY}")
                self._read_record = True
            return self._record

    def forget_fork_record(self) -> None:
        """Read ``FORK.json`` again when next asked (it was written through this store)."""
        with self._lock:
            self._read_record = False
            self._record = None
            self._ancestors.clear()

    def ancestor(self, index: int) -> tuple[Store, frozenset[str]]:
        """Ancestor ``index``'s store and the data files it holds for this fork, checked."""
        with self._lock:
            found = self._ancestors.get(index)
        if found is not None:
            return found
        record = self.fork_record()
        where = f"{self.url}/{FORK_KEY}"
        if record is None:
            raise CheckpointFormatError(
                f"{self.url}: a manifest names a data file of ancestor {index}, but the run "
                f"holds no {FORK_KEY}: it is no fork (an edited manifest?)",
                path=self.url,
            )
        if index >= len(record.ancestors):
            raise CheckpointFormatError(
                f"{where}: a manifest names ancestor {index}; the record lists "
                f"{len(record.ancestors)}",
                path=self.url,
            )
        found = self._check(record, record.ancestors[index], where)
        with self._lock:
            self._ancestors[index] = found
        return found

    def _check(self, record: ForkRecord, url: str, where: str) -> tuple[Store, frozenset[str]]:
        if not os.path.isabs(url) or os.path.normpath(url) != url:
            raise CheckpointFormatError(
                f"{where}: ancestor {url!r:.200} is not an absolute, normalized local path; "
                "nothing was read from it",
                path=self.url,
            )
        store = self._opener(url)
        key = hold_key(record.token)
        try:
            hold = Hold.from_json(store.read(key), f"{url}/{key}")
        except CheckpointNotFoundError:
            raise CheckpointFormatError(
                f"{where}: ancestor {url} holds no record of this fork ({key}): the reference "
                "was edited, or the fork or its ancestor was moved; nothing else was read",
                path=self.url,
            ) from None
        if hold.token != record.token or hold.fork != self.location():
            raise CheckpointFormatError(
                f"{url}/{key} names the fork {hold.fork!r:.200}, not {self.location()}: the "
                "reference was edited or the fork was moved",
                path=self.url,
            )
        return store, frozenset(hold.data_files)

    def read(self, key: str) -> bytes:
        store, key = self._route(key)
        return store.read(key)

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        store, key = self._route(key)
        store.read_into(key, offset, buffers)

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        store, key = self._route(key)
        store.read_ranges(key, ranges)

    def map_file(self, key: str) -> memoryview | None:
        store, key = self._route(key)
        mapper = getattr(store, "map_file", None)
        return None if mapper is None else mapper(key)

    def cached_share(self, key: str) -> float | None:
        store, key = self._route(key)
        probe = getattr(store, "cached_share", None)
        return None if probe is None else probe(key)

    def read_ranges_cold(
        self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]
    ) -> None:
        store, key = self._route(key)
        getattr(store, "read_ranges_cold", store.read_ranges)(key, ranges)

    def exists(self, key: str) -> bool:
        try:
            store, key = self._route(key)
        except CheckpointNotFoundError:
            return False
        return store.exists(key)

    def size(self, key: str) -> int:
        store, key = self._route(key)
        return store.size(key)

    def write(self, key: str, data: BytesLike) -> None:
        self.inner.write(_own(key), data)

    def open_writer(self, key: str) -> BlobWriter:
        return self.inner.open_writer(_own(key))

    def delete(self, key: str) -> None:
        self.inner.delete(_own(key))

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self.inner.list(prefix)


def _own(key: str) -> str:
    if key.startswith("ancestors/"):
        raise CheckpointError(f"{key}: a fork never writes or deletes its ancestors' files")
    return key


def location_of(store: Store) -> str:
    """Where the run on ``store`` is, as holds and fork records name it: the real path of a
    directory (symbolic links and ``..`` resolved), the URL of any other store."""
    root = store.capabilities.local_path
    return store.url if root is None else os.path.realpath(root)


def linked(store: Store, opener: Callable[[str], Store]) -> Store:
    """``store`` as a :class:`LinkedStore` (itself if it is one already)."""
    if isinstance(store, LinkedStore):
        return store
    return LinkedStore(store, opener)
