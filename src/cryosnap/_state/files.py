"""``cryosnap.File``: a file the program wrote, as a leaf of a state. Owns the leaf's three
moments: opened and mapped at ``flatten`` (the one read of the file), rebuilt as a handle
holding the verified bytes, and written at ``into=``'s path atomically (:class:`FileWrites`).

The only module of ``_state`` that does file I/O; caller's thread. docs/design/state-trees.md
("Files") has the why.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from typing import Any

import numpy as np

from cryosnap import _native
from cryosnap._format.skeleton import Json, format_path
from cryosnap.errors import CheckpointFormatError, FileLeafError, StateMismatchError

__all__ = [
    "File",
    "FileWrites",
    "check_file_into",
    "file_leaf",
    "loaded_file",
    "saved_file_path",
]


class File:
    """A file the program writes itself (HDF5, netCDF, a format of its own) as a leaf of a
    state: ``{"grid": cryosnap.File("out/grid.h5"), "it": 10}``.

    A save stores the file's bytes (chunked, hashed and de-duplicated like any blob) and its
    absolute path. ``restore(into=)`` writes them at the path of the ``File`` in ``into``;
    a load or restore without ``into`` returns ``File`` handles that hold the verified bytes
    (``read_bytes()``), with ``path`` the saved path and ``size`` their length.
    """

    __slots__ = ("_data", "_path")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = os.fspath(path)
        if not isinstance(p, str) or not p:
            raise TypeError(f"cryosnap.File(path): a non-empty str path, not {path!r:.80}")
        self._path = p
        self._data: bytearray | None = None  # a loaded handle's verified bytes

    @property
    def path(self) -> str:
        """The file's path: as given, or (a loaded handle) the absolute path it was saved at."""
        return self._path

    @property
    def size(self) -> int:
        """Its bytes: a loaded handle's, or the file's now (``os.stat``)."""
        return len(self._data) if self._data is not None else os.stat(self._path).st_size

    def read_bytes(self) -> bytes:
        """Its content: a loaded handle's verified bytes, or the file's now."""
        if self._data is not None:
            return bytes(self._data)
        with open(self._path, "rb") as f:
            return f.read()

    def __repr__(self) -> str:
        if self._data is not None:
            return f"cryosnap.File({self._path!r}, loaded, {len(self._data)} bytes)"
        return f"cryosnap.File({self._path!r})"


def loaded_file(path: str, data: bytearray) -> File:
    """A handle on the verified bytes ``data`` of a file saved at ``path``."""
    f = File(path)
    f._data = data
    return f


def file_leaf(f: File, path: tuple[str | int, ...]) -> tuple[Json, Any, int]:
    """The skeleton node of ``f`` at leaf ``path`` (its ``"b"`` left to the caller), the blob's
    source (a read-only uint8 array over the file mapped: no copy) and its byte count;
    :class:`FileLeafError` names the leaf when the path is no readable regular file."""
    if f._data is not None:  # a loaded handle saved again: its bytes, not a file's
        return {"t": "file", "path": f._path, "size": len(f._data)}, _array(f._data), len(f._data)
    where = f"cannot checkpoint {format_path(path)}: cryosnap.File({f._path!r})"
    saved = os.path.abspath(f._path)
    fd = _open_regular(saved, where)
    try:
        nbytes = os.fstat(fd).st_size
        source = _array(_native.map_shared_read(fd, nbytes) if nbytes else b"")
    except OSError as exc:
        raise FileLeafError(f"{where}: cannot map it: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    return {"t": "file", "path": saved, "size": nbytes}, source, nbytes


def _array(buf: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.frombuffer(buf, dtype=np.uint8) if len(buf) else np.empty(0, np.uint8)


def _open_regular(path: str, where: str) -> int:
    """A read-only descriptor of the regular file at ``path``; O_NONBLOCK so that opening a
    FIFO does not wait for a writer (fstat then refuses it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise FileLeafError(f"{where}: no such file") from exc
    except PermissionError as exc:
        raise FileLeafError(f"{where}: not readable (permission denied)") from exc
    except OSError as exc:
        raise FileLeafError(f"{where}: cannot open it: {exc.strerror or exc}") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise FileLeafError(f"{where}: is {_kind(mode)}, not a regular file")
    return fd


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def saved_file_path(node: dict[str, Any], blob_bytes: int, where: str) -> str:
    """The saved path of a ``file`` node, checked against its blob's size."""
    saved, size = node.get("path"), node.get("size")
    if not isinstance(saved, str) or type(size) is not int or size != blob_bytes:
        raise CheckpointFormatError(
            f"leaf {where}: malformed file node (path {saved!r:.80}, size {size!r:.40}, "
            f"its blob has {blob_bytes} bytes)"
        )
    return saved


def check_file_into(saved_kind: Any, into: Any, path: tuple[str | int, ...]) -> None:
    """Refuse a ``File`` of ``into`` where no file was saved, and anything else where one was."""
    if saved_kind == "file" and not isinstance(into, File):
        raise StateMismatchError(
            f"into= does not match the checkpoint at {format_path(path)}: saved a file, "
            f"into= has {type(into).__name__} (pass a cryosnap.File naming where to write it)"
        )
    if saved_kind != "file" and isinstance(into, File):
        raise StateMismatchError(
            f"into= does not match the checkpoint at {format_path(path)}: saved a "
            f"{saved_kind} leaf, into= has a cryosnap.File"
        )


def _keep_mode(fd: int, final: str) -> None:
    """Give the new file the permission bits of the one it replaces, if there is one."""
    try:
        mode = os.stat(final).st_mode
    except FileNotFoundError:
        return
    os.fchmod(fd, stat.S_IMODE(mode))


class FileWrites:
    """The files a restore writes at ``into=``'s paths, in two steps: :meth:`stage` writes
    each beside its target as a temporary file, fsynced; :meth:`commit` renames them all over
    their targets and fsyncs their directories. Until ``commit`` no target has changed, and
    :meth:`discard` removes what was staged: a restore that fails leaves every target as it
    was. (A process killed in between leaves the staged files, ``.<name>.<token>.cryosnap-tmp``
    beside their targets; killed during ``commit``, each target is whole, old or new.) A new
    file keeps the permission bits of the one it replaces."""

    def __init__(self) -> None:
        self._staged: list[tuple[str, str]] = []  # (temporary file, target)
        self._targets: dict[str, str] = {}  # target -> the leaf it is written for

    def stage(self, target: File, loaded: File, path: tuple[str | int, ...]) -> None:
        # Through symbolic links: the file a link names is replaced, the link stays (and the
        # temporary file lies on that file's file system, where the rename can happen).
        final = os.path.realpath(target.path)
        leaf = format_path(path)
        other = self._targets.setdefault(final, leaf)
        if other != leaf:
            raise StateMismatchError(
                f"into= names the file {final!r} for two leaves: {other} and {leaf}"
            )
        folder, name = os.path.split(final)
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.cryosnap-tmp")
        data = loaded._data if loaded._data is not None else bytearray(loaded.read_bytes())
        try:
            # 0o666: the umask decides, as for any new file the program would write.
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
            fd = os.open(tmp, flags, 0o666)
        except OSError as exc:
            raise FileLeafError(
                f"restoring {leaf}: cannot write {final!r}: {exc.strerror or exc}"
            ) from exc
        self._staged.append((tmp, final))
        try:
            _keep_mode(fd, final)
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        except OSError as exc:
            raise FileLeafError(
                f"restoring {leaf}: cannot write {final!r}: {exc.strerror or exc}"
            ) from exc
        finally:
            os.close(fd)

    def commit(self) -> None:
        """Rename every staged file over its target, then make the renames durable."""
        folders = set()
        while self._staged:
            tmp, final = self._staged[0]
            try:
                os.replace(tmp, final)
            except OSError as exc:
                self.discard()
                raise FileLeafError(
                    f"restoring {self._targets[final]}: cannot replace {final!r}: "
                    f"{exc.strerror or exc}"
                ) from exc
            self._staged.pop(0)
            folders.add(os.path.dirname(final))
        for folder in sorted(folders):
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def discard(self) -> None:
        """Remove every staged file (no target changed)."""
        staged, self._staged = self._staged, []
        for tmp, _final in staged:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
