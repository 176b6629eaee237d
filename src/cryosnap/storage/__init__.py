"""Storage backends behind one small protocol (see :mod:`cryosnap.storage.base`).

``open_store`` picks the backend from the location (:class:`LocalStore`, :class:`FsspecStore`)
and wraps it in a :class:`TimeoutStore`, so that every storage call is bounded.
Runs on the calling thread. docs/design/storage.md has the rest.
"""

from __future__ import annotations

import os
from typing import Any

from cryosnap.errors import DirectIOError
from cryosnap.storage._codec import CodedWriter, DecodedStore, coded_size, decoded, read_index
from cryosnap.storage._fsspec import FsspecStore
from cryosnap.storage._linked import LinkedStore, linked, location_of
from cryosnap.storage._local import LocalStore
from cryosnap.storage._timeout import TimeoutStore
from cryosnap.storage._wrap import WrapperStore, unwrap
from cryosnap.storage.base import (
    BlobWriter,
    ConditionalWrites,
    ConditionalWritesUnsupported,
    Store,
    StoreCapabilities,
    TruncatedError,
    validate_key,
)

__all__ = [
    "BlobWriter",
    "CodedWriter",
    "ConditionalWrites",
    "ConditionalWritesUnsupported",
    "DEFAULT_TIMEOUT_SECONDS",
    "DecodedStore",
    "FsspecStore",
    "LinkedStore",
    "LocalStore",
    "Store",
    "StoreCapabilities",
    "TimeoutStore",
    "TruncatedError",
    "WrapperStore",
    "check_direct_io",
    "coded_size",
    "decoded",
    "join_location",
    "location_of",
    "open_run_store",
    "open_store",
    "read_index",
    "unwrap",
    "validate_key",
]

# The default limit of one storage call. Generous for the largest single call the engine makes
# (a 64 MiB read or write, over 8 s even on a 10 MB/s network file system) and for an S3 call
# that s3fs retries (see _fsspec.py); short enough that a dead tier stops a save or a close()
# within minutes, not never.
DEFAULT_TIMEOUT_SECONDS = 120.0


def open_store(
    location: str | os.PathLike[str] | Store,
    *,
    timeout_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
    direct_io: bool | None = None,
    **storage_options: Any,
) -> Store:
    """The store for ``location``: a directory, a ``file://`` URL, any fsspec URL or a Store.

    ``direct_io`` is a directory's (:class:`LocalStore`): None, O_DIRECT data files where its
    file system takes them; True, always (a refusal is an error); False, never. It is not
    checked for the other stores here: ``check_direct_io`` says what a store does.

    The backend is wrapped in a :class:`TimeoutStore`: a call that does not return within
    ``timeout_seconds`` raises :class:`~cryosnap.errors.StorageTimeoutError` (None: no limit).
    A Store passed in is returned as it is, without a timeout: wrap it in a TimeoutStore to
    bound it. ``storage_options`` go to fsspec (for an fsspec URL).
    """
    if isinstance(location, Store):
        return location
    backend = _backend(location, storage_options, direct_io)
    if timeout_seconds is None:
        return backend
    return TimeoutStore(backend, timeout_seconds)


def open_run_store(location: str | os.PathLike[str] | Store, **options: Any) -> Store:
    """:func:`open_store` for a run: a :class:`LinkedStore`, which reads the data files a fork
    shares with its ancestors from them (``options`` as for :func:`open_store`)."""
    return linked(open_store(location, **options), open_store)


# What isinstance(x, Store) checks, for the message when it fails on a would-be store.
_STORE_MEMBERS = (
    "url",
    "capabilities",
    "read",
    "read_into",
    "read_ranges",
    "write",
    "open_writer",
    "exists",
    "list",
    "size",
    "delete",
    "remove_incomplete",
)


def check_direct_io(store: Store, wanted: bool | None, level: str) -> bool:
    """Whether ``store`` writes its data files with O_DIRECT (a directory's is decided here,
    once, by a probe); ``wanted`` True where it cannot is a :class:`DirectIOError` naming
    ``level``."""
    backend = unwrap(store)
    try:
        if isinstance(backend, LocalStore):
            direct = backend.check_direct_io()
        else:
            direct = False
            if wanted:
                raise DirectIOError(
                    f"direct_io=True, but {store.url} is not a local directory: direct writes "
                    "need one (give direct_io=None or False)"
                )
    except DirectIOError as exc:
        raise DirectIOError(f"the {level} level: {exc}") from None
    if wanted and not direct:
        raise DirectIOError(
            f"the {level} level: direct_io=True, but {store.url} was opened with "
            f"direct_io={backend.direct_io if isinstance(backend, LocalStore) else None}"
        )
    return direct


def join_location(root: str, sub: str) -> str:
    """``sub`` under the location ``root``: a URL joined with ``/``, a local path with the
    platform's separator (what :func:`open_store` then opens)."""
    return f"{root.rstrip('/')}/{sub}" if "://" in root else os.path.join(root, sub)


def _backend(
    location: str | os.PathLike[str], storage_options: dict[str, Any], direct_io: bool | None
) -> Store:
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str) or not location:
        missing = [m for m in _STORE_MEMBERS if not hasattr(location, m)]
        if hasattr(location, "open_writer") and missing:
            # A store written against an older protocol (e.g. before ``capabilities``).
            raise TypeError(
                f"{location!r} is not a Store: it lacks {', '.join(missing)} (a store that "
                "offers nothing beyond the primitives declares capabilities = StoreCapabilities())"
            )
        raise TypeError(
            f"checkpoint path must be a non-empty str, os.PathLike or URL, got {location!r}"
        )
    if location.startswith("file://"):
        return LocalStore(location[len("file://") :], direct_io=direct_io)
    if "://" in location or location.startswith("memory:"):
        return FsspecStore(location, **storage_options)
    return LocalStore(location, direct_io=direct_io)
