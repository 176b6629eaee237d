"""FsspecStore: a run under any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

fsspec itself is a core dependency; the backend packages (s3fs, gcsfs) are imported by fsspec
only when a URL of theirs is opened. On object stores every PUT is atomic, so ``write`` is a
single ``pipe_file`` and a data file becomes visible when its upload completes on ``commit``.
Durability is whatever the backend guarantees when ``close`` returns (S3: the object is stored).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import fsspec

from ..errors import CheckpointError, CheckpointNotFoundError, StorageError
from .base import BytesLike, TruncatedError, validate_key

__all__ = ["FsspecStore"]


class FsspecStore:
    """A store rooted at an fsspec URL prefix."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        self._url = url.rstrip("/")
        try:
            self.fs, root = fsspec.core.url_to_fs(self._url, **storage_options)
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open {url}: {exc}") from exc
        self.root = root.rstrip("/")

    def __repr__(self) -> str:
        return f"FsspecStore({self._url!r})"

    @property
    def url(self) -> str:
        return self._url

    def _path(self, key: str) -> str:
        return f"{self.root}/{validate_key(key)}"

    @contextmanager
    def _errors(self, key: str, action: str) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{key} not found in {self.url}") from exc
        except Exception as exc:
            # Backends raise their own exception types (botocore, aiohttp...): any failure
            # inside the backend is a storage failure, named with the store and the key.
            raise StorageError(f"{action} {key} in {self.url} failed: {exc}") from exc

    def read(self, key: str) -> bytes:
        with self._errors(key, "reading"):
            data: bytes = self.fs.cat_file(self._path(key))
            return data

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        views = [memoryview(b).cast("B") for b in buffers]
        with self._errors(key, "reading"), self.fs.open(self._path(key), "rb") as f:
            f.seek(offset)
            for v in views:
                got = 0
                while got < v.nbytes:
                    n = f.readinto(v[got:])
                    if not n:
                        raise TruncatedError(
                            f"{key} ends before byte {offset + v.nbytes}, "
                            "before the data it should hold"
                        )
                    got += n
                offset += v.nbytes

    def write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with self._errors(key, "writing"):
            self._makedirs(path)
            self.fs.pipe_file(path, bytes(data))

    def open_writer(self, key: str) -> _FsspecWriter:
        path = self._path(key)
        with self._errors(key, "creating"):
            self._makedirs(path)
            return _FsspecWriter(self, key, path)

    def _makedirs(self, path: str) -> None:
        parent = path.rsplit("/", 1)[0]
        if parent:
            self.fs.makedirs(parent, exist_ok=True)

    def exists(self, key: str) -> bool:
        with self._errors(key, "checking"):
            return bool(self.fs.isfile(self._path(key)))

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        with self._errors(prefix or ".", "listing"):
            if not self.fs.exists(base):
                return []
            found = self.fs.find(base)
        # Backends differ on a leading "/" (memory:// has one, s3:// none): compare without it.
        root = self.root.lstrip("/") + "/"
        keys = (p.lstrip("/") for p in found)
        return sorted(k[len(root) :] for k in keys if k.startswith(root))

    def size(self, key: str) -> int:
        with self._errors(key, "stat of"):
            return int(self.fs.size(self._path(key)))

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._errors(key, "deleting"):
            if self.fs.exists(path):
                self.fs.rm_file(path)


class _FsspecWriter:
    def __init__(self, store: FsspecStore, key: str, path: str) -> None:
        self.key = key
        self._store = store
        self._path = path
        self._file: Any = store.fs.open(path, "wb")
        self._written = 0

    def write(self, buffers: Sequence[BytesLike]) -> None:
        if self._file is None:
            raise ValueError(f"writer for {self.key} is closed")
        with self._store._errors(self.key, "writing"):
            for b in buffers:
                self._written += self._file.write(b)

    def tell(self) -> int:
        return self._written

    def commit(self) -> None:
        if self._file is None:
            raise ValueError(f"writer for {self.key} is closed")
        f, self._file = self._file, None
        with self._store._errors(self.key, "committing"):
            f.close()

    def abort(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            # Discard an unfinished upload rather than completing it.
            discard = getattr(f, "discard", None)
            try:
                if callable(discard):
                    discard()
                else:
                    f.close()
            finally:
                self._store.delete(self.key)
