"""FsspecStore: a run under any fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).

Every ``write`` is a single ``pipe_file``; durability is whatever the backend guarantees. On
S3 it declares conditional writes; it never declares a ``local_path``.
Runs on the calling thread; s3fs and gcsfs run their requests on their own event loop thread.
docs/design/storage.md has the why (and the S3 timeouts).
"""

from __future__ import annotations

import builtins
import os
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import fsspec

from cryosnap.errors import CheckpointError, CheckpointNotFoundError, StorageError
from cryosnap.storage._s3 import s3_conditional_writes
from cryosnap.storage.base import BytesLike, StoreCapabilities, TruncatedError, validate_key

__all__ = ["FsspecStore"]


class FsspecStore:
    """A store rooted at an fsspec URL prefix."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        self._url = url.rstrip("/")
        if fsspec.core.split_protocol(self._url)[0] in ("s3", "s3a"):
            storage_options = _s3_defaults(storage_options)
        try:
            self.fs, root = fsspec.core.url_to_fs(self._url, **storage_options)
        except (ImportError, ValueError) as exc:
            raise StorageError(f"cannot open {url}: {exc}") from exc
        self.root = root.rstrip("/")
        protocols = self.fs.protocol
        protocols = {protocols} if isinstance(protocols, str) else set(protocols)
        # Object stores: atomic PUTs, uploads completed on commit, no directories.
        self.object_store = bool(protocols & _UPLOAD_ON_COMMIT)
        self._capabilities = StoreCapabilities(
            conditional_writes=s3_conditional_writes(self.fs, self.root, self._url)
        )

    def __repr__(self) -> str:
        return f"FsspecStore({self._url!r})"

    @property
    def url(self) -> str:
        return self._url

    @property
    def capabilities(self) -> StoreCapabilities:
        return self._capabilities

    def _path(self, key: str) -> str:
        return f"{self.root}/{validate_key(key)}"

    @contextmanager
    def _errors(self, key: str, action: str) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except FileNotFoundError as exc:
            if action in ("reading", "stat of", "checking", "listing", "deleting"):
                raise CheckpointNotFoundError(f"{key} not found in {self.url}") from exc
            # Writing where the bucket or directory does not exist is a storage failure.
            raise StorageError(f"{action} {key} in {self.url} failed: {exc}") from exc
        except Exception as exc:
            # Backends raise their own exception types (botocore, aiohttp...): any failure
            # inside the backend is a storage failure, named with the store and the key.
            raise StorageError(f"{action} {key} in {self.url} failed: {exc}") from exc

    def read(self, key: str) -> bytes:
        path = self._path(key)  # an invalid key is a ValueError, not a storage failure
        with self._errors(key, "reading"):
            data: bytes = self.fs.cat_file(path)
            return data

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.read_ranges(key, [(offset, buffers)])

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        path = self._path(key)
        with self._errors(key, "reading"), self.fs.open(path, "rb") as f:
            for offset, buffers in ranges:
                f.seek(offset)
                for v in (memoryview(b).cast("B") for b in buffers):
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

    def write(self, key: str, data: BytesLike) -> None:
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
        # Object stores have no directories; makedirs there would try to create the bucket
        # (a typo in the URL would quietly make a new one).
        parent = path.rsplit("/", 1)[0]
        if parent and not self.object_store:
            self.fs.makedirs(parent, exist_ok=True)

    def _info(self, path: str) -> dict[str, Any] | None:
        """Fresh metadata of ``path`` (None if absent); other failures raise."""
        self.fs.invalidate_cache(path)  # another process may have changed it
        try:
            info: dict[str, Any] = self.fs.info(path)
        except FileNotFoundError:
            return None
        return info

    def exists(self, key: str) -> bool:
        path = self._path(key)
        with self._errors(key, "checking"):
            info = self._info(path)
            return info is not None and info.get("type") == "file"

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        with self._errors(prefix or ".", "listing"):
            if not self.fs.isdir(base):
                return []
            found = self.fs.find(base)
        # Backends differ on a leading "/" (memory:// has one, s3:// none): compare without it.
        root = self.root.lstrip("/") + "/"
        keys = (p.lstrip("/") for p in found)
        found_keys = (k[len(root) :] for k in keys if k.startswith(root))
        # Hide writes in progress (reserved names, see validate_key).
        return sorted(k for k in found_keys if not _incomplete(k.rsplit("/", 1)[-1]))

    def size(self, key: str) -> int:
        path = self._path(key)
        with self._errors(key, "stat of"):
            info = self._info(path)
            if info is None or info.get("type") != "file":
                raise FileNotFoundError(path)
            return int(info["size"])

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._errors(key, "deleting"):
            if self.fs.exists(path):
                self.fs.rm_file(path)

    def remove_incomplete(self, prefix: str = "") -> builtins.list[str]:
        if self.object_store:
            # A PUT is atomic and an upload becomes an object only on commit: an abandoned one
            # leaves no object (S3 keeps its parts until a bucket lifecycle rule aborts it;
            # aborting them here could hit another writer's upload in the same bucket).
            return []
        base = self._path(prefix) if prefix else self.root
        with self._errors(prefix or ".", "removing incomplete files under"):
            if not self.fs.isdir(base):
                return []
            root = self.root.lstrip("/") + "/"
            removed = []
            for path in self.fs.find(base):
                key = path.lstrip("/")
                if key.startswith(root) and _incomplete(key.rsplit("/", 1)[-1]):
                    # A writer's ".<name>.<hex>.tmp" that a crash left before its move.
                    self.fs.rm_file(path)
                    removed.append(key[len(root) :])
        return sorted(removed)


def _incomplete(name: str) -> bool:
    """Whether a file name is a write in progress (the reserved names, see validate_key)."""
    return name.endswith(".partial") or (name.startswith(".") and name.endswith(".tmp"))


def _s3_defaults(storage_options: dict[str, Any]) -> dict[str, Any]:
    """``storage_options`` with bounded S3 requests (see the module docstring), except where
    the caller's options or AWS_MAX_ATTEMPTS/AWS_RETRY_MODE chose otherwise."""
    config = dict(storage_options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", 5)
    config.setdefault("read_timeout", 10)
    if "retries" not in config and not (
        os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")
    ):
        config["retries"] = {"total_max_attempts": 2, "mode": "standard"}
    return {**storage_options, "config_kwargs": config}


# Object stores whose fsspec files complete an upload only on commit() with autocommit=False.
_UPLOAD_ON_COMMIT = {"s3", "s3a", "gs", "gcs", "abfs", "az", "adl"}


class _FsspecWriter:
    """A file that appears under its key only on ``commit()``; ``abort()`` leaves an existing
    key alone. Object stores: ``autocommit=False`` (the upload completes on commit, is aborted
    on discard). Other file systems: a temporary ``.<name>.<hex>.tmp`` moved into place."""

    def __init__(self, store: FsspecStore, key: str, path: str) -> None:
        self.key = key
        self._store = store
        self._path = path
        self._tmp: str | None = None
        if store.object_store:
            self._file: Any = store.fs.open(path, "wb", autocommit=False)
            # fsspec queues non-autocommit files on the filesystem's transaction for ever; we
            # commit or discard ourselves, so do not let the (cached) filesystem keep them.
            with suppress(AttributeError, ValueError):
                store.fs.transaction.files.remove(self._file)
        else:
            head, _, name = path.rpartition("/")
            self._tmp = f"{head}/.{name}.{secrets.token_hex(4)}.tmp"
            self._file = store.fs.open(self._tmp, "wb")
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
            if self._tmp is None:
                f.commit()
            else:
                self._store.fs.mv(self._tmp, self._path)

    def abort(self) -> None:
        f, self._file = self._file, None
        if f is None:
            return
        # Nothing was committed: the upload or temporary file is abandoned.
        with suppress(Exception):
            if self._tmp is None:
                try:
                    f.discard()
                finally:
                    # s3fs's discard() leaves the file open: its __del__ would then close() it,
                    # which (autocommit=False) starts a new multipart upload of a dropped buffer.
                    f.closed = True
            else:
                f.close()
                self._store.fs.rm_file(self._tmp)
