"""LocalStore: a run directory on a POSIX file system (local disk, NVMe, tmpfs, NFS, Lustre).

Crash consistency: small files (manifests, commit records) are written to a temporary name in
the same directory, fsynced, renamed over the key and the directory is fsynced, so the new name
and its content reach the disk together. Large data files are streamed to ``<key>.partial`` with
``writev`` (few syscalls for many buffers), fsynced and renamed on commit; a crash leaves only a
``.partial`` file that no version references. Reads use ``preadv`` straight into the caller's
buffers: no intermediate copy.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointNotFoundError, StorageError
from .base import BytesLike, TruncatedError, validate_key

__all__ = ["LocalStore"]

_IOV_MAX = min(getattr(os, "sysconf", lambda _: 1024)("SC_IOV_MAX"), 1024)
_PARTIAL = ".partial"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """A store rooted at a local directory (created on first write)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalStore) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    @property
    def url(self) -> str:
        return str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    @contextmanager
    def _errors(self, key: str, action: str) -> Iterator[None]:
        # One place maps OS errors to the library's: the most specific error, with the cause.
        try:
            yield
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{key} not found in {self.url}") from exc
        except OSError as exc:
            what = "disk full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc.strerror
            raise StorageError(f"{action} {key} in {self.url} failed: {what}") from exc

    def read(self, key: str) -> bytes:
        with self._errors(key, "reading"):
            return self._path(key).read_bytes()

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.read_ranges(key, [(offset, buffers)])

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        path = self._path(key)
        with self._errors(key, "reading"):
            fd = os.open(path, os.O_RDONLY)
            try:
                for offset, buffers in ranges:
                    _preadv_all(fd, offset, list(buffers), key)
            finally:
                os.close(fd)

    def write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        with self._errors(key, "writing"):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    _writev_all(fd, [data])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            _fsync_dir(path.parent)

    def open_writer(self, key: str) -> _LocalWriter:
        path = self._path(key)
        with self._errors(key, "creating"):
            path.parent.mkdir(parents=True, exist_ok=True)
            return _LocalWriter(self, key, path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        out: list[str] = []
        with self._errors(prefix or ".", "listing"):
            for dirpath, _dirs, files in os.walk(base):
                rel = Path(dirpath).relative_to(self.root).as_posix()
                for name in files:
                    if name.endswith(_PARTIAL) or (name.startswith(".") and name.endswith(".tmp")):
                        continue  # a write in progress (reserved names, see validate_key)
                    out.append(name if rel == "." else f"{rel}/{name}")
        return sorted(out)

    def size(self, key: str) -> int:
        with self._errors(key, "stat of"):
            return self._path(key).stat().st_size

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._errors(key, "deleting"):
            path.unlink(missing_ok=True)
        # Drop directories the deletion left empty (a retired version's folder), never the root.
        parent = path.parent
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent


class _LocalWriter:
    def __init__(self, store: LocalStore, key: str, path: Path) -> None:
        self.key = key
        self._store = store
        self._path = path
        self._partial = path.with_name(path.name + _PARTIAL)
        self._fd: int | None = os.open(self._partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._written = 0

    def write(self, buffers: Sequence[BytesLike]) -> None:
        if self._fd is None:
            raise ValueError(f"writer for {self.key} is closed")
        with self._store._errors(self.key, "writing"):
            self._written += _writev_all(self._fd, list(buffers))

    def tell(self) -> int:
        return self._written

    def commit(self) -> None:
        if self._fd is None:
            raise ValueError(f"writer for {self.key} is closed")
        with self._store._errors(self.key, "committing"):
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None
            os.replace(self._partial, self._path)
            _fsync_dir(self._path.parent)

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._partial.unlink(missing_ok=True)


def _writev_all(fd: int, buffers: list[BytesLike]) -> int:
    """Write every buffer, looping over partial writes and the iovec limit.

    The common case (every call writes everything) does no per-buffer Python work: this runs
    on the I/O thread while another thread holds the GIL for hashing.
    """
    views = [
        v
        if isinstance(v, memoryview) and v.ndim == 1 and v.format == "B"
        else memoryview(v).cast("B")
        for v in buffers
    ]
    total = 0
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        n = os.writev(fd, batch)
        total += n
        if n == sum(map(len, batch)):
            i += len(batch)
            continue
        # A partial write: drop what was written, keep the unwritten tail of a buffer.
        for v in batch:
            if n >= v.nbytes:
                n -= v.nbytes
                i += 1
            else:
                views[i] = v[n:]
                break
    return total


def _preadv_all(fd: int, offset: int, buffers: list[memoryview], key: str) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_MAX]
        n = os.preadv(fd, batch, offset)
        if n == 0:
            raise TruncatedError(f"{key} ends at byte {offset}, before the data it should hold")
        offset += n
        for v in batch:
            if n >= v.nbytes:
                n -= v.nbytes
                i += 1
            else:
                views[i] = v[n:]
                break
