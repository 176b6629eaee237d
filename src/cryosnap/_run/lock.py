"""The run's write lock: one writer per run, recovered when its holder dies, fenced when lost.

:meth:`RunLock.check` runs before everything a writer makes visible or deletes; the store's
capabilities choose the protocol (``flock``, conditional writes, claims), never its class.
Runs on the thread that opens the Checkpointer (``acquire_run_lock``) and on the threads that
commit and retire (``check``); the heartbeat thread ``cryosnap-lock`` only refreshes the object.
docs/design/lock.md has the why.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import secrets
import socket
import stat
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryosnap.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    LockFileError,
    LockLostError,
    RunLockedError,
    StorageError,
)
from cryosnap.storage import ConditionalWrites, ConditionalWritesUnsupported, Store
from cryosnap.storage._local import not_a_directory

__all__ = ["CLAIMS_PREFIX", "LOCK_KEY", "STALE_SECONDS", "RunLock", "acquire_run_lock"]

LOCK_KEY = "writer.lock"
CLAIMS_PREFIX = "writer.lock.claims"
# A lock object whose heartbeat is older than this many seconds is taken over. Module-level so a
# test (or a program) can lower it in a process whose Checkpointer it does not construct itself.
STALE_SECONDS = 120.0
# The holder gives up at this fraction of stale_seconds, before any rival may take over.
_LEASE_FRACTION = 0.75
_CLAIM_ATTEMPTS = 6


def _owner(token: str, generation: int) -> dict[str, Any]:
    now = time.time()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": token,
        "generation": generation,
        "since_unix": now,
        "heartbeat_unix": now,
    }


def _describe(info: Any) -> str:
    if not isinstance(info, dict):
        return "another writer"
    since = info.get("since_unix")
    when = "?"
    if isinstance(since, (int, float)):
        with contextlib.suppress(ValueError, OverflowError, OSError):
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
    return f"pid {info.get('pid')} on host {info.get('host')} (since {when})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def _generation(info: Any) -> int:
    gen = info.get("generation") if isinstance(info, dict) else None
    return gen if isinstance(gen, int) and not isinstance(gen, bool) and gen >= 0 else 0


def _parse(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


class RunLock:
    """A held write lock: :meth:`check` before every commit or deletion; :meth:`release` is
    idempotent."""

    def __init__(
        self,
        store: Store,
        *,
        stale_seconds: float = STALE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.token = secrets.token_hex(8)
        self.generation = 0
        self.stale_seconds = float(stale_seconds)
        self._clock = clock
        self._lost: str | None = None
        self._mutex = threading.Lock()  # one of check / heartbeat / release at a time
        # Local flock:
        self._fd: int | None = None
        self._path: Path | None = None
        # Lock object:
        self._owner: dict[str, Any] | None = None
        self._cond: _ConditionalLock | None = None
        self._etag: str | None = None
        self._beat_ok = 0.0  # clock() when the last successful lock write began
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        _HELD.add(self)  # until released: a fork's child lets go of it (_forked)

    @property
    def lost(self) -> bool:
        """True once this writer knows it no longer holds the lock (sticky)."""
        return self._lost is not None

    @property
    def _lease(self) -> float:
        return self.stale_seconds * _LEASE_FRACTION

    def _lose(self, reason: str) -> None:
        if self._lost is None:
            self._lost = reason

    def _raise_lost(self) -> None:
        raise LockLostError(
            f"{self.store.url}: this writer no longer holds the run's write lock "
            f"({self._lost}); it stops instead of saving or deleting"
        )

    def _forked(self) -> None:
        """In a child forked from the writer (a DataLoader worker, a ``multiprocessing`` fork):
        the lock stays the parent's alone. The child closes its copy of the locked file, so a
        worker that outlives a killed parent does not hold the run locked, and it never writes,
        deletes or heartbeats the lock: it is not the writer."""
        self._mutex = threading.Lock()  # another thread may have held it at the fork
        fd, self._fd = self._fd, None
        if fd is not None:
            # close, never LOCK_UN: the open file is shared with the parent, whose lock it is.
            with contextlib.suppress(OSError):
                os.close(fd)
        self._owner = None
        self._heartbeat = None
        self._lose(f"this process (pid {os.getpid()}) was forked from the writer, which keeps it")

    def check(self) -> None:
        """Raise :class:`LockLostError` unless this writer still holds the lock (one stat
        locally, one read of the lock object elsewhere)."""
        with self._mutex:
            if self._lost is None:
                if self._fd is not None:
                    self._check_file()
                elif self._owner is not None:
                    self._check_object()
            if self._lost is not None:
                self._raise_lost()

    def _check_file(self) -> None:
        assert self._fd is not None and self._path is not None
        held = os.fstat(self._fd)
        try:
            now = os.stat(self._path, follow_symlinks=False)
        except FileNotFoundError:
            self._lose(f"{self._path} was deleted; another writer may lock a new one")
            return
        except OSError as exc:
            raise StorageError(f"cannot check the write lock {self._path}: {exc.strerror}") from exc
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            self._lose(f"{self._path} was replaced; another writer may hold the new one")

    def _check_object(self) -> None:
        if self._clock() - self._beat_ok > self._lease:
            self._lose(self._silence())
            return
        current = self._read_current()
        if current is not None:
            self._compare(current[0])

    def _silence(self) -> str:
        return (
            f"no successful heartbeat for {self._clock() - self._beat_ok:.1f} s, longer than "
            f"{self._lease:.1f} s (the process was paused or the store unreachable); another "
            "writer may have taken the lock over"
        )

    def _read_current(self) -> tuple[Any, str | None] | None:
        """The lock object and its ETag; marks the lock lost if it is gone."""
        if self._cond is not None:
            got = self._cond.get()
            if got is None:
                self._lose(f"{LOCK_KEY} was deleted")
                return None
            return _parse(got[0]), got[1]
        try:
            return _read_settled(self.store), None
        except CheckpointNotFoundError:
            self._lose(f"{LOCK_KEY} was deleted")
            return None

    def _compare(self, info: Any) -> None:
        if not isinstance(info, dict) or info.get("token") != self.token:
            self._lose(f"taken over by {_describe(info)}, generation {_generation(info)}")
        elif _generation(info) != self.generation:
            self._lose(f"generation {_generation(info)} in the lock, ours is {self.generation}")

    def _beat(self) -> None:
        """One heartbeat: rewrite the lock object only while it is provably still ours."""
        with self._mutex:
            if self._lost is not None or self._owner is None:
                return
            start = self._clock()
            if start - self._beat_ok > self._lease:
                self._lose(self._silence())
                return
            try:
                self._rewrite(start)
            except ConditionalWritesUnsupported:  # a StorageError: before the line below
                self._lose("the store stopped accepting conditional writes")
                return
            except CheckpointError:
                return  # a failed beat is retried; a long silence loses the lock (above)
            # (A conditional write that succeeded proves nobody took over meanwhile.)
            if self._cond is None and self._clock() - start > self._lease and self._lost is None:
                # Paused between the read and the write: a successor may have been overwritten;
                # it will see our token and stop, and so do we.
                self._lose(f"paused for {self._clock() - start:.1f} s during a heartbeat")

    def _rewrite(self, start: float) -> None:
        assert self._owner is not None
        owner = {**self._owner, "heartbeat_unix": time.time()}
        data = json.dumps(owner).encode()
        if self._cond is not None:
            assert self._etag is not None
            etag = self._cond.replace(data, self._etag)
            if etag is None:
                got = self._cond.get()
                self._compare(_parse(got[0]) if got else None)
                self._lose("the lock object changed under its heartbeat")
                return
            self._etag = etag
        else:
            current = self._read_current()
            if current is None:
                return
            self._compare(current[0])
            if self._lost is not None:
                return
            self.store.write(LOCK_KEY, data)
        self._owner = owner
        self._beat_ok = start

    def _start_heartbeat(self) -> None:
        interval = max(self.stale_seconds / 4, 0.05)

        def run() -> None:
            while not self._stop.wait(interval):
                self._beat()
                if self._lost is not None:
                    return

        self._heartbeat = threading.Thread(target=run, name="cryosnap-lock", daemon=True)
        self._heartbeat.start()

    def release(self) -> None:
        _HELD.discard(self)
        if self._fd is not None:
            import fcntl

            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        if self._heartbeat is not None:
            self._stop.set()
            self._heartbeat.join()
            self._heartbeat = None
        with self._mutex:
            owner, self._owner = self._owner, None
            # A lost lock is someone else's now: never delete it.
            if owner is not None and self._lost is None:
                with contextlib.suppress(CheckpointError):
                    self._delete_own()
            self._lose("released")

    def _delete_own(self) -> None:
        if self._cond is not None:
            assert self._etag is not None
            self._cond.delete(self._etag)
            return
        info = _read_settled(self.store)
        if isinstance(info, dict) and info.get("token") == self.token:
            self.store.delete(LOCK_KEY)


def acquire_run_lock(
    store: Store,
    *,
    stale_seconds: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> RunLock:
    """Take the run's write lock or raise :class:`~cryosnap.errors.RunLockedError` naming the
    run and its holder.

    ``stale_seconds`` (default :data:`STALE_SECONDS`, read at each call): how old a lock object's
    heartbeat must be before it is taken over. ``clock``: the monotonic clock the holder measures
    its own heartbeats with.
    """
    stale = STALE_SECONDS if stale_seconds is None else float(stale_seconds)
    if not stale > 0:
        raise ValueError(f"stale_seconds must be positive, got {stale_seconds!r}")
    lock = RunLock(store, stale_seconds=stale, clock=clock)
    # The store's capabilities decide how to lock; the generic protocol goes through the
    # wrappers (timeouts).
    local = store.capabilities.local_path
    if local is not None:
        _acquire_flock(lock, local)
        return lock
    s3 = _ConditionalLock.of(store, stale)
    try:
        if s3 is not None:
            try:
                _acquire_conditional(lock, s3)
            except ConditionalWritesUnsupported:
                _acquire_claimed(lock)
        else:
            _acquire_claimed(lock)
    except BaseException:
        lock._owner = None
        raise
    lock._start_heartbeat()
    return lock


# The locks of this process not yet released, so that a fork's child lets go of its copies.
_HELD: weakref.WeakSet[RunLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_HELD):
        lock._forked()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _refuse_if_held(lock: RunLock, current: Any) -> None:
    if not isinstance(current, dict):
        return  # a foreign or unreadable object: nobody can be holding it
    pid = current.get("pid")
    dead_here = (
        current.get("host") == socket.gethostname()
        and isinstance(pid, int)
        and pid > 0
        and not _pid_alive(pid)
    )
    last_beat = current.get("heartbeat_unix")
    stale = not isinstance(last_beat, (int, float)) or time.time() - last_beat > lock.stale_seconds
    if not (dead_here or stale):
        raise RunLockedError(
            f"{lock.store.url} is already open for writing by {_describe(current)}; "
            "one writer per run (readers need no lock)"
        )


def _read_settled(store: Store) -> Any:
    """The lock object, parsed. A store without atomic writes may show one half-written: read
    again before calling it unreadable (None). CheckpointNotFoundError if there is none."""
    info = None
    for attempt in range(4):
        if attempt:
            time.sleep(0.05)
        info = _parse(store.read(LOCK_KEY))
        if isinstance(info, dict):
            return info
    return info


# --- local file system ------------------------------------------------------------------------


def _acquire_flock(lock: RunLock, root: Path) -> None:
    import fcntl

    path = root / LOCK_KEY
    fd = _open_lock_file(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise StorageError(f"cannot lock {path}: {exc.strerror}") from exc
            raise RunLockedError(
                f"{lock.store.url} is already open for writing by "
                f"{_describe(_parse(_read_fd(fd)))}; one writer per run (readers need no lock)"
            ) from None
        lock.generation = _generation(_parse(_read_fd(fd))) + 1
        record = json.dumps(_owner(lock.token, lock.generation)).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
        except OSError as exc:
            raise StorageError(f"cannot write the write lock {path}: {exc.strerror}") from exc
    except BaseException:
        os.close(fd)
        raise
    lock._fd, lock._path = fd, path


def _open_lock_file(path: Path) -> int:
    """Open (creating) ``path`` without following a link; refuse anything but a regular file
    with a single link, so that nothing outside the run is ever truncated or written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # lstat first: opening a device or FIFO can itself have effects.
        _refuse_foreign(path, os.lstat(path))
    except FileNotFoundError:
        pass
    except OSError as exc:
        # A file given as the run (or below one) says so rather than "File exists".
        raise not_a_directory(path.parent) or StorageError(
            f"cannot create the write lock {path}: {exc.strerror}"
        ) from exc
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LockFileError(
                f"the write lock {path} is a symbolic link; cryosnap never follows links "
                "inside a run (remove it if the run is yours)",
                path=str(path),
            ) from None
        raise StorageError(f"cannot create the write lock {path}: {exc.strerror}") from exc
    try:
        _refuse_foreign(path, os.fstat(fd))  # replaced between the lstat and the open
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refuse_foreign(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise LockFileError(
            f"the write lock {path} is a symbolic link; cryosnap never follows links inside "
            "a run (remove it if the run is yours)",
            path=str(path),
        )
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else "hard-linked elsewhere"
        raise LockFileError(
            f"the write lock {path} is {what}; cryosnap never writes through it "
            "(remove it if the run is yours)",
            path=str(path),
        )


def _read_fd(fd: int) -> bytes:
    try:
        return os.pread(fd, 1 << 16, 0)
    except OSError:
        return b""


# --- lock objects: claims (any store) ---------------------------------------------------------


def _acquire_claimed(lock: RunLock) -> None:
    """Take the lock object inside the claims protocol (module docstring)."""
    store = lock.store
    for attempt in range(_CLAIM_ATTEMPTS):
        start = lock._clock()
        claim = f"{CLAIMS_PREFIX}/{int(time.time() * 1000):015d}-{lock.token}"
        store.write(claim, b"")
        try:
            if not _rival_claims(lock, claim):
                _take_object(lock, start)
                return
        finally:
            with contextlib.suppress(CheckpointError):
                store.delete(claim)
        # Another writer is opening this run now: let one of us go first.
        time.sleep(random.uniform(0.0, 0.05 * 2**attempt))
    raise RunLockedError(
        f"{store.url} is being opened for writing by other processes at the same time; "
        "one writer per run (readers need no lock)"
    )


def _rival_claims(lock: RunLock, claim: str) -> bool:
    """Whether another fresh claim exists; claims older than stale_seconds are removed."""
    rivals = False
    now_ms = time.time() * 1000
    for key in lock.store.list(CLAIMS_PREFIX):
        if key == claim:
            continue
        stamp = key.rsplit("/", 1)[-1].split("-", 1)[0]
        if stamp.isdigit() and now_ms - int(stamp) > lock.stale_seconds * 1000:
            with contextlib.suppress(CheckpointError):
                lock.store.delete(key)  # left by a contender that died while opening
            continue
        rivals = True
    return rivals


def _take_object(lock: RunLock, start: float) -> None:
    store = lock.store
    try:
        current = _read_settled(store)
    except CheckpointNotFoundError:
        current = None
    _refuse_if_held(lock, current)
    lock.generation = _generation(current) + 1
    owner = _owner(lock.token, lock.generation)
    store.write(LOCK_KEY, json.dumps(owner).encode())
    lock._owner, lock._beat_ok = owner, start
    if lock._clock() - start > lock._lease:
        # Paused while opening: a rival may have judged our claim stale and gone ahead.
        with contextlib.suppress(CheckpointError):
            lock._delete_own()
        raise RunLockedError(
            f"opening {store.url} for writing took longer than {lock._lease:.1f} s; "
            "another writer may have opened it meanwhile",
            path=store.url,
        )
    check = _read_settled(store)
    if not isinstance(check, dict) or check.get("token") != lock.token:
        raise RunLockedError(f"{store.url} was locked by {_describe(check)} at the same time")


# --- lock objects: conditional writes (S3) --------------------------------------------------


class _ConditionalLock:
    """``writer.lock`` kept with the store's conditional writes, each request bounded by
    ``timeout`` (further capped by a TimeoutStore among the store's wrappers)."""

    def __init__(self, writes: ConditionalWrites, url: str, timeout: float) -> None:
        self.writes = writes
        self.url = url
        self.timeout = timeout

    @classmethod
    def of(cls, store: Store, stale_seconds: float) -> _ConditionalLock | None:
        writes = store.capabilities.conditional_writes
        if writes is None:
            return None
        # A lock request that outlives the lease is of no use.
        return cls(writes, store.url, max(stale_seconds / 2, 5.0))

    def get(self) -> tuple[bytes, str] | None:
        return self.writes.get(LOCK_KEY, timeout=self.timeout)

    def create(self, data: bytes) -> str | None:
        return self.writes.create(LOCK_KEY, data, timeout=self.timeout)

    def replace(self, data: bytes, etag: str) -> str | None:
        return self.writes.replace(LOCK_KEY, data, etag, timeout=self.timeout)

    def delete(self, etag: str | None) -> None:
        """Delete the object if its ETag is ``etag`` (None: whatever it holds)."""
        self.writes.delete(LOCK_KEY, etag, timeout=self.timeout)


def _acquire_conditional(lock: RunLock, s3: _ConditionalLock) -> None:
    for _ in range(3):
        start = lock._clock()
        lock.generation = 1
        owner = _owner(lock.token, lock.generation)
        data = json.dumps(owner).encode()
        etag = s3.create(data)
        if etag is not None:
            try:
                # Heartbeats need If-Match: make sure the server takes it before relying on it.
                etag = s3.replace(data, etag)
            except ConditionalWritesUnsupported:
                s3.delete(None)
                raise
            if etag is None:
                raise RunLockedError(f"{lock.store.url} was locked by another writer at once")
        else:
            got = s3.get()
            if got is None:
                continue  # released between our PUT and our GET: try again
            current = _parse(got[0])
            _refuse_if_held(lock, current)
            lock.generation = _generation(current) + 1
            owner = _owner(lock.token, lock.generation)
            etag = s3.replace(json.dumps(owner).encode(), got[1])
            if etag is None:
                raise RunLockedError(
                    f"{lock.store.url} was taken over by another writer at the same time"
                )
        lock._owner, lock._etag, lock._beat_ok, lock._cond = owner, etag, start, s3
        # A server that ignores the conditions would let a rival overwrite us unseen.
        got = s3.get()
        check = _parse(got[0]) if got else None
        if not isinstance(check, dict) or check.get("token") != lock.token:
            lock._owner = None
            raise RunLockedError(
                f"{lock.store.url} was locked by {_describe(check)} at the same time"
            )
        return
    raise RunLockedError(
        f"{lock.store.url}: the write lock keeps changing; try again", path=lock.store.url
    )
