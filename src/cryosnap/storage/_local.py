"""LocalStore: a run directory on a POSIX file system (local disk, NVMe, tmpfs, NFS, Lustre).

Owns every byte cryosnap reads or writes under a local run directory: crash consistent (fsync,
rename) and a closed world (no symlink below the root is followed). Runs on the calling
thread (a reader's, or the engine's I/O threads); holds no locks, callers serialize writes to
one key. docs/design/storage.md has the why.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

from cryosnap import _native
from cryosnap.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    DirectIOError,
    StorageError,
)
from cryosnap.storage._direct import (
    IOV_MAX,
    O_DIRECT,
    DirectFile,
    DirectReader,
    Syscalls,
    advance,
    probe_direct,
    takes_direct_reads,
)
from cryosnap.storage.base import BytesLike, StoreCapabilities, TruncatedError, validate_key

__all__ = ["LocalStore"]

log = logging.getLogger("cryosnap")

_PARTIAL = ".partial"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC
_DIR_FLAGS = _ROOT_FLAGS | os.O_NOFOLLOW
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
# O_EXCL: a name planted in advance (a symlink, a hard link to a file elsewhere) is never reused.
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
# A run's keys are 1-3 levels deep; a hostile tree may nest without end (recursion, open fds).
_MAX_DEPTH = 32


def _in_progress(name: str) -> bool:
    """A write in progress, or a crashed one's leftover: the names ``validate_key`` reserves."""
    return name.endswith(_PARTIAL) or (name.startswith(".") and name.endswith(".tmp"))


def _kind(mode: int) -> str:
    kinds = [
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device file"),
        (stat.S_ISBLK, "a device file"),
    ]
    return next((text for test, text in kinds if test(mode)), "a special file")


def _makedirs_durably(path: Path) -> None:
    """``mkdir -p path``, fsyncing the parent of every directory it creates."""
    missing: list[Path] = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for new in reversed(missing):
        try:
            new.mkdir()
        except FileExistsError:
            continue  # made by someone else meanwhile
        _fsync_dir(new.parent)


def not_a_directory(root: Path) -> StorageError | None:
    """The error for a run directory ``root`` that is, or lies below, something other than a
    directory (a file given as the run); None if it is not so (a directory, or missing)."""
    for path in (*reversed(root.parents), root):
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return None
        if not stat.S_ISDIR(mode):
            where = "a run directory" if path == root else "a directory"
            text = f"{path} is {_kind(mode)}, not {where}"
            return StorageError(text if path == root else f"{root}: {text}", path=str(root))
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, _ROOT_FLAGS)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore:
    """A store rooted at a local directory (created on first write).

    ``direct_io``: how data files (``open_writer``) are written. None: with ``O_DIRECT``
    where the directory's file system takes it (probed once, by the first data file or
    :meth:`check_direct_io`), buffered elsewhere; True: direct, and a file system that refuses
    it is a :class:`~cryosnap.DirectIOError`; False: through the page cache. Small files
    (``write``) always go through the page cache. ``syscalls``: the calls direct writes make
    (faults: :class:`cryosnap.testing.FaultySyscalls`). ``private``: files 0600, dirs 0700."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        direct_io: bool | None = None,
        syscalls: Syscalls | None = None,
        private: bool = False,
    ) -> None:
        if direct_io is not None and not isinstance(direct_io, bool):
            raise TypeError(f"direct_io must be None, True or False, got {direct_io!r}")
        self.root = Path(root).expanduser().absolute()
        self._warned: set[str] = set()
        self.direct_io = direct_io
        self.syscalls = syscalls or Syscalls()
        self._direct: bool | None = None if direct_io is not False else False
        # Whether a cold restore reads data files with O_DIRECT: until a file system refuses.
        self._direct_reads = direct_io is not False
        self.file_mode, self.dir_mode = (0o600, 0o700) if private else (0o644, 0o777)

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def check_direct_io(self) -> bool:
        """Whether data files are written with ``O_DIRECT``, decided once (by a probe, which
        creates the root); raises :class:`~cryosnap.DirectIOError` where ``direct_io=True``
        and the file system refuses it."""
        if self._direct is None:
            errors = self._errors(".", "probing direct I/O in")
            with errors, self._dirs([], ".", create=True) as fds:
                fs = _fs_type(os.fstat(fds[0]).st_dev)
                why = probe_direct(fds[0], self.syscalls, fs, memory=bool(self.direct_io))
            if why is not None and self.direct_io:
                raise DirectIOError(
                    f"direct_io=True, but {self.url} cannot take direct writes: {why}; "
                    "give direct_io=None (direct where it works) or False"
                )
            self._direct = why is None
        return self._direct

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LocalStore) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    @property
    def url(self) -> str:
        return str(self.root)

    @property
    def capabilities(self) -> StoreCapabilities:
        return StoreCapabilities(local_path=self.root)

    @contextmanager
    def _errors(self, key: str, action: str) -> Iterator[None]:
        # One place maps OS errors to the library's: the most specific error, with the cause.
        try:
            yield
        except CheckpointError:
            raise  # already ours (StorageError and CheckpointNotFoundError are OSErrors too)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"{key} not found in {self.url}") from exc
        except OSError as exc:
            what = "disk full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else exc.strerror
            raise StorageError(f"{action} {key} in {self.url} failed: {what}") from exc

    # -- resolving keys without following links ----------------------------------------------

    def _not_regular(self, key: str, mode: int) -> CheckpointFormatError:
        return CheckpointFormatError(
            f"{key} in {self.url} is {_kind(mode)}, not a regular file; "
            "a run never makes cryosnap read outside it"
        )

    def _not_a_dir(self, key: str, where: str, mode: int, *, reading: bool) -> CheckpointError:
        text = f"{key} in {self.url}: {where} is {_kind(mode)}, not a directory; "
        if reading:
            return CheckpointFormatError(text + "a run never makes cryosnap read outside it")
        return StorageError(text + "cryosnap never writes or deletes through it")

    def _open_root(self, *, create: bool) -> int:
        try:
            return os.open(self.root, _ROOT_FLAGS)
        except FileNotFoundError:
            if not create:
                raise
        except NotADirectoryError as exc:
            error = not_a_directory(self.root)
            if error is None:
                raise
            raise error from exc
        _makedirs_durably(self.root)
        return os.open(self.root, _ROOT_FLAGS)

    def _open_dir(
        self, parent: int, name: str, key: str, where: str, *, create: bool, reading: bool
    ) -> int:
        """Open the directory ``name`` in ``parent``, never through a symlink; ``create``
        makes it if missing and fsyncs ``parent`` so the new entry is durable."""
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as exc:
            # O_DIRECTORY|O_NOFOLLOW on a symlink: ENOTDIR on Linux, ELOOP elsewhere.
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
            raise self._not_a_dir(key, where, mode, reading=reading) from exc
        try:
            os.mkdir(name, self.dir_mode, dir_fd=parent)
        except FileExistsError:
            pass  # made by someone else meanwhile; opened and checked below like any other
        else:
            os.fsync(parent)
        return self._open_dir(parent, name, key, where, create=False, reading=reading)

    @contextmanager
    def _dirs(
        self, parts: Sequence[str], key: str, *, create: bool = False, reading: bool = False
    ) -> Iterator[list[int]]:
        """Descriptors of the root and of each directory ``parts`` names below it, in order."""
        fds = [self._open_root(create=create)]
        try:
            for i, name in enumerate(parts):
                where = "/".join(parts[: i + 1])
                fds.append(
                    self._open_dir(fds[-1], name, key, where, create=create, reading=reading)
                )
            yield fds
        finally:
            for fd in fds:
                os.close(fd)

    @contextmanager
    def _open_regular(self, key: str) -> Iterator[int]:
        """A read-only descriptor of the regular file ``key``, or CheckpointFormatError."""
        parts = validate_key(key).split("/")
        name = parts[-1]
        with self._errors(key, "reading"), self._dirs(parts[:-1], key, reading=True) as fds:
            # lstat first: a device file or FIFO is never even opened.
            mode = os.stat(name, dir_fd=fds[-1], follow_symlinks=False).st_mode
            if not stat.S_ISREG(mode):
                raise self._not_regular(key, mode)
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=fds[-1])
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                raise self._not_regular(key, stat.S_IFLNK) from exc  # swapped for a link
            try:
                mode = os.fstat(fd).st_mode  # what was opened, whatever was swapped meanwhile
                if not stat.S_ISREG(mode):
                    raise self._not_regular(key, mode)
                yield fd
            finally:
                os.close(fd)

    def _warn_once(self, key: str, message: str) -> None:
        # Retention lists the run after every version: one warning per name is enough.
        if key not in self._warned:
            self._warned.add(key)
            log.warning("cryosnap: %s", message)

    def _stray(self, key: str, why: str) -> None:
        """Warn about a file that is not cryosnap's; it is left alone."""
        self._warn_once(key, f"{self.url}: stray file {key} ignored: {why}")

    def _walk(self, fd: int, rel: str, depth: int = 0) -> Iterator[tuple[int, str, list[str]]]:
        """``(descriptor, key prefix, regular file names)`` of the directory ``fd`` and of every
        real directory below it; symlinks and special files are skipped with a warning."""
        with os.scandir(fd) as it:
            entries = list(it)
        files: list[str] = []
        subdirs: list[str] = []
        for e in entries:
            key = f"{rel}/{e.name}" if rel else e.name
            if e.is_dir(follow_symlinks=False):
                subdirs.append(e.name)
            elif e.is_file(follow_symlinks=False):
                files.append(e.name)
            else:
                with suppress(OSError):  # gone meanwhile: nothing to warn about
                    mode = e.stat(follow_symlinks=False).st_mode
                    self._stray(key, f"{_kind(mode)}, not a regular file")
        yield fd, rel, files
        for name in subdirs:
            key = f"{rel}/{name}" if rel else name
            if depth >= _MAX_DEPTH:
                self._stray(key, f"nested deeper than {_MAX_DEPTH} directories")
                continue
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    continue  # removed, or swapped for a link, since the scan
                raise
            try:
                yield from self._walk(sub, key, depth + 1)
            finally:
                os.close(sub)

    @contextmanager
    def _tree(self, prefix: str, action: str) -> Iterator[Iterator[tuple[int, str, list[str]]]]:
        """``_walk`` of the directory ``prefix`` (nothing when it is missing or not one)."""
        parts = validate_key(prefix).split("/") if prefix else []
        with self._errors(prefix or ".", action), ExitStack() as stack:
            fds: list[int] = []
            try:
                fds = stack.enter_context(self._dirs(parts, prefix, reading=True))
            except FileNotFoundError:
                pass
            except CheckpointFormatError as exc:
                self._warn_once(prefix, f"{exc}; not listed")
            yield self._walk(fds[-1], prefix) if fds else iter(())

    # -- the Store protocol ------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        with self._open_regular(key) as fd, open(fd, "rb", buffering=0, closefd=False) as f:
            return f.readall()

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.read_ranges(key, [(offset, buffers)])

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        with self._open_regular(key) as fd:
            for offset, buffers in ranges:
                _preadv_all(fd, offset, list(buffers), key)

    def map_file(self, key: str) -> memoryview | None:
        """The regular file ``key`` mapped whole, readable and copy-on-write
        (``MAP_PRIVATE``: writes to the memory never reach the file), as a writable byte
        view; or None where mapping is not done: an empty file, a network or FUSE file system
        (see the module docstring), a platform without ``mmap`` in its C library.

        The mapping holds no file descriptor (Python's ``mmap`` keeps one per mapping, and a
        restore may map thousands of files while its leaves may live as long as the
        program) and is unmapped when the last view of it goes. The file may be deleted or
        renamed meanwhile, but never truncated (a data file is written once and never
        modified): a page past a truncated end raises SIGBUS."""
        if not _native.can_map():
            return None
        with self._open_regular(key) as fd, self._errors(key, "mapping"):
            st = os.fstat(fd)
            if not st.st_size or not _mappable_device(st.st_dev):
                return None
            return _native.map_private(fd, st.st_size)

    def cached_share(self, key: str) -> float | None:
        """The share of the regular file ``key``'s pages in the page cache (``mincore``, which
        reads nothing in), where a cold read of it (:meth:`read_ranges_cold`) would go to the
        disk with ``O_DIRECT``; None where it cannot be told (an empty file, no ``mincore``) or
        the read would not be direct (``direct_io=False``, a file system that refuses it): a
        restore reads such files as warm ones, through the page cache."""
        if not self._direct_reads:
            return None
        with self._open_regular(key) as fd:
            if not takes_direct_reads(fd):
                self._direct_reads = False
                return None
            counts = _native.cached_pages(fd, os.fstat(fd).st_size)
        return None if counts is None or not counts[1] else counts[0] / counts[1]

    def read_ranges_cold(
        self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]
    ) -> None:
        """:meth:`read_ranges` for a file out of the page cache: large ``O_DIRECT`` reads
        straight into the buffers where their memory is aligned as their offsets are (an
        aligned bounce buffer elsewhere), unless ``direct_io=False`` or the file system refuses
        them (then, and from a refusal midway on, buffered reads with read-ahead advice;
        :class:`~cryosnap.storage._direct.DirectReader`). Leaves the page cache as it was."""
        with self._open_regular(key) as fd:
            reader = DirectReader(fd, key, self.syscalls, direct=self._direct_reads)
            try:
                for offset, buffers in ranges:
                    reader.read(offset, _flat_views(buffers))
            finally:
                if reader.refused and self._direct_reads:
                    self._direct_reads = False
                    self._warn_once(
                        ".direct-reads", f"{self.url}: reads buffered: {reader.refused}"
                    )

    def write(self, key: str, data: BytesLike) -> None:
        parts = validate_key(key).split("/")
        name = parts[-1]
        tmp = f".{name}.{secrets.token_hex(4)}.tmp"
        with self._errors(key, "writing"), self._dirs(parts[:-1], key, create=True) as fds:
            parent = fds[-1]
            try:
                fd = os.open(tmp, _CREATE_FLAGS, self.file_mode, dir_fd=parent)
                try:
                    _writev_all(fd, [data])
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except BaseException:
                with suppress(OSError):
                    os.unlink(tmp, dir_fd=parent)
                raise
            os.fsync(parent)

    def open_writer(self, key: str) -> _LocalWriter:
        parts = validate_key(key).split("/")
        with self._errors(key, "creating"):
            with self._dirs(parts[:-1], key, create=True) as fds:
                parent = os.dup(fds[-1])  # the writer commits in this very directory
            try:
                return _LocalWriter(self, key, parent, parts[-1], direct=self.check_direct_io())
            except BaseException:
                os.close(parent)
                raise

    def exists(self, key: str) -> bool:
        parts = validate_key(key).split("/")
        with self._errors(key, "stat of"):
            try:
                with self._dirs(parts[:-1], key, reading=True) as fds:
                    st = os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError, CheckpointFormatError):
                return False
            return stat.S_ISREG(st.st_mode)

    def size(self, key: str) -> int:
        parts = validate_key(key).split("/")
        with self._errors(key, "stat of"), self._dirs(parts[:-1], key, reading=True) as fds:
            st = os.stat(parts[-1], dir_fd=fds[-1], follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise self._not_regular(key, st.st_mode)
            return st.st_size

    def delete(self, key: str) -> None:
        parts = validate_key(key).split("/")
        with self._errors(key, "deleting"):
            try:
                with self._dirs(parts[:-1], key) as fds:
                    # A symlink named by the key is unlinked itself, never what it points to.
                    os.unlink(parts[-1], dir_fd=fds[-1])
                    # Drop the directories this left empty (a retired version's), never the root.
                    for parent, name in zip(fds[-2::-1], parts[-2::-1], strict=True):
                        try:
                            os.rmdir(name, dir_fd=parent)
                        except OSError:
                            break
            except FileNotFoundError:
                pass  # deleting a missing key is not an error

    def remove_incomplete(self, prefix: str = "") -> list[str]:
        removed: list[str] = []
        with self._tree(prefix, "removing incomplete files under") as tree:
            for fd, rel, files in tree:
                names = [name for name in files if _in_progress(name)]
                for name in names:
                    with suppress(FileNotFoundError):  # gone meanwhile
                        os.unlink(name, dir_fd=fd)
                    removed.append(f"{rel}/{name}" if rel else name)
                if names:
                    os.fsync(fd)
        return sorted(removed)

    def incomplete(self, prefix: str = "") -> dict[str, int]:
        """The files :meth:`remove_incomplete` would delete under ``prefix`` and their sizes
        (what a dry run of a clean-up reports); deletes nothing."""
        found: dict[str, int] = {}
        with self._tree(prefix, "listing incomplete files under") as tree:
            for fd, rel, files in tree:
                for name in files:
                    if not _in_progress(name):
                        continue
                    with suppress(FileNotFoundError):  # gone meanwhile
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        found[f"{rel}/{name}" if rel else name] = st.st_size
        return found

    def list(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        with self._tree(prefix, "listing") as tree:
            for _fd, rel, files in tree:
                for name in files:
                    key = f"{rel}/{name}" if rel else name
                    if _in_progress(name):
                        continue  # a write in progress, or remove_incomplete's to reclaim
                    try:
                        out.append(validate_key(key))
                    except ValueError:
                        self._stray(key, "not a valid key")
        return sorted(out)


class _LocalWriter:
    def __init__(
        self, store: LocalStore, key: str, parent: int, name: str, *, direct: bool
    ) -> None:
        self.key = key
        self._store = store
        self._name = name
        self._partial = name + _PARTIAL
        # The directory's descriptor, not its path: commit renames where the bytes were written.
        self._parent: int | None = parent
        with suppress(FileNotFoundError):
            os.unlink(self._partial, dir_fd=parent)  # a crashed writer's, or a planted name
        flags = _CREATE_FLAGS | (O_DIRECT if direct else 0)
        self._fd: int | None = os.open(self._partial, flags, store.file_mode, dir_fd=parent)
        self._direct = DirectFile(self._fd, key, store.syscalls) if direct else None
        self._written = 0

    def write(self, buffers: Sequence[BytesLike]) -> None:
        if self._fd is None:
            raise ValueError(f"writer for {self.key} is closed")
        with self._store._errors(self.key, "writing"):
            if self._direct is not None:
                self._written += self._direct.write(_flat_views(buffers))
            else:
                self._written += _writev_all(self._fd, list(buffers))

    def tell(self) -> int:
        return self._written

    def commit(self) -> None:
        if self._fd is None or self._parent is None:
            raise ValueError(f"writer for {self.key} is closed")
        with self._store._errors(self.key, "committing"):
            try:
                if self._direct is not None:
                    self._direct.finish()
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None
            parent = self._parent
            os.replace(self._partial, self._name, src_dir_fd=parent, dst_dir_fd=parent)
            os.fsync(parent)
            # Kept open until here so that abort() can still remove a partial file that failed
            # to commit.
            self._parent = None
            os.close(parent)

    def abort(self) -> None:
        if self._direct is not None:
            self._direct.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._parent is not None:
            parent, self._parent = self._parent, None
            try:
                with suppress(FileNotFoundError):
                    os.unlink(self._partial, dir_fd=parent)
            finally:
                os.close(parent)


def _flat_views(buffers: Sequence[BytesLike]) -> list[memoryview]:
    return [
        v
        if isinstance(v, memoryview) and v.ndim == 1 and v.format == "B"
        else memoryview(v).cast("B")
        for v in buffers
    ]


def _writev_all(fd: int, buffers: list[BytesLike]) -> int:
    """Write every buffer, looping over partial writes and the iovec limit.

    The common case (every call writes everything) does no per-buffer Python work: this runs
    on the I/O thread while another thread holds the GIL for hashing.
    """
    views = _flat_views(buffers)
    total = 0
    i = 0
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        n = os.writev(fd, batch)
        total += n
        # A partial write: drop what was written, keep the unwritten tail of a buffer.
        i = i + len(batch) if n == sum(map(len, batch)) else advance(views, i, n)
    return total


# File systems whose page faults read a local block device or memory: a fault cannot wait on a
# network (a read can, and a TimeoutStore bounds it).
_MAPPED_FS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "tmpfs", "ramfs", "overlay", "zfs", "jfs"}
)
_fs_types: dict[int, str] = {}


def _mappable_device(dev: int) -> bool:
    """Whether the file system of device ``dev`` is one of _MAPPED_FS; False where it cannot
    be told."""
    return _fs_type(dev) in _MAPPED_FS


def _fs_type(dev: int) -> str:
    """The file system type of device ``dev`` from ``/proc/self/mountinfo`` (once per
    device); "" where it cannot be told."""
    fs = _fs_types.get(dev)
    if fs is None:
        fs = ""
        want = f"{os.major(dev)}:{os.minor(dev)}"
        with (
            suppress(OSError, ValueError, IndexError),
            open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f,
        ):
            for line in f:
                fields = line.split()
                if fields[2] == want:
                    fs = fields[fields.index("-") + 1]
                    break
        _fs_types[dev] = fs
    return fs


def _preadv_all(fd: int, offset: int, buffers: list[memoryview], key: str) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    i = 0
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        n = os.preadv(fd, batch, offset)
        if n == 0:
            raise TruncatedError(f"{key} ends at byte {offset}, before the data it should hold")
        offset += n
        i = advance(views, i, n)
