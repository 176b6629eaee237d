"""Storage backends behind one small protocol (see :mod:`cryosnap.storage.base`).

``open_store`` picks the backend from the location: a plain path or ``file://`` URL gives a
:class:`LocalStore` (fsync and atomic rename), any other fsspec URL an :class:`FsspecStore`.
"""

from __future__ import annotations

import os
from typing import Any

from ._fsspec import FsspecStore
from ._local import LocalStore
from .base import BlobWriter, Store, TruncatedError, validate_key

__all__ = [
    "BlobWriter",
    "FsspecStore",
    "LocalStore",
    "Store",
    "TruncatedError",
    "open_store",
    "validate_key",
]


def open_store(location: str | os.PathLike[str] | Store, **storage_options: Any) -> Store:
    """The store for ``location``: a directory, a ``file://`` URL, any fsspec URL or a Store."""
    if isinstance(location, Store):
        return location
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str) or not location:
        raise TypeError(
            f"checkpoint path must be a non-empty str, os.PathLike or URL, got {location!r}"
        )
    if location.startswith("file://"):
        return LocalStore(location[len("file://") :])
    if "://" in location or location.startswith("memory:"):
        return FsspecStore(location, **storage_options)
    return LocalStore(location)
