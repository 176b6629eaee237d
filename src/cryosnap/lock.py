"""The run's write lock: one writer per run, recovered when its holder dies.

On a local file system the lock is ``flock`` on ``<run>/writer.lock``: the kernel drops it when
the holding process exits in any way, SIGKILL included, so a killed run restarts with no manual
cleanup. The file also records who holds it, for the error message of a second writer.

On other stores (object stores have no locks) the lock is an object ``writer.lock`` naming its
holder, refreshed by a heartbeat thread. A lock whose holder is a dead process on this host, or
whose heartbeat is older than ``stale_seconds``, is taken over.

Runs on the thread that opens the Checkpointer; the heartbeat thread only rewrites the lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import threading
import time
from typing import Any

from .errors import CheckpointError, CheckpointNotFoundError, StorageError
from .storage import LocalStore, Store

__all__ = ["LOCK_KEY", "RunLock", "acquire_run_lock"]

LOCK_KEY = "writer.lock"


def _owner(token: str) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": token,
        "since_unix": time.time(),
        "heartbeat_unix": time.time(),
    }


def _describe(info: Any) -> str:
    if not isinstance(info, dict):
        return "another writer"
    since = info.get("since_unix")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return f"pid {info.get('pid')} on host {info.get('host')} (since {when})"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """A held write lock; :meth:`release` is idempotent."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.token = secrets.token_hex(8)
        self._fd: int | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def release(self) -> None:
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
            with contextlib.suppress(CheckpointError):
                info = json.loads(self.store.read(LOCK_KEY))
                if info.get("token") == self.token:
                    self.store.delete(LOCK_KEY)


def acquire_run_lock(store: Store, *, stale_seconds: float = 120.0) -> RunLock:
    """Take the run's write lock or raise :class:`CheckpointError` naming the holder."""
    lock = RunLock(store)
    if isinstance(store, LocalStore):
        _acquire_flock(lock, store)
    else:
        _acquire_object_lock(lock, store, stale_seconds)
    return lock


def _acquire_flock(lock: RunLock, store: LocalStore) -> None:
    import fcntl

    path = store.root / LOCK_KEY
    try:
        store.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StorageError(f"cannot create the write lock {path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise StorageError(f"cannot lock {path}: {exc.strerror}") from exc
        try:
            holder = json.loads(path.read_text() or "null")
        except (OSError, ValueError):
            holder = None
        raise CheckpointError(
            f"{store.url} is already open for writing by {_describe(holder)}; "
            "one writer per run (readers need no lock)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_owner(lock.token)).encode(), 0)
    lock._fd = fd


def _acquire_object_lock(lock: RunLock, store: Store, stale_seconds: float) -> None:
    try:
        current = json.loads(store.read(LOCK_KEY))
    except CheckpointNotFoundError:
        current = None
    except ValueError:
        current = None  # a torn or foreign lock object: nobody can be holding it
    if isinstance(current, dict):
        dead_here = current.get("host") == socket.gethostname() and not _pid_alive(
            int(current.get("pid", -1))
        )
        last_beat = current.get("heartbeat_unix")
        stale = not isinstance(last_beat, (int, float)) or time.time() - last_beat > stale_seconds
        if not (dead_here or stale):
            raise CheckpointError(
                f"{store.url} is already open for writing by {_describe(current)}; "
                "one writer per run (readers need no lock)"
            )
    owner = _owner(lock.token)
    store.write(LOCK_KEY, json.dumps(owner).encode())
    # Two writers racing on an object store: the last PUT wins, the other sees it and backs off.
    time.sleep(0.05)
    check = json.loads(store.read(LOCK_KEY))
    if check.get("token") != lock.token:
        raise CheckpointError(f"{store.url} was locked by {_describe(check)} at the same time")

    def beat() -> None:
        interval = max(stale_seconds / 4, 0.05)
        while not lock._stop.wait(interval):
            owner["heartbeat_unix"] = time.time()
            with contextlib.suppress(CheckpointError):
                store.write(LOCK_KEY, json.dumps(owner).encode())

    lock._heartbeat = threading.Thread(target=beat, name="cryosnap-lock", daemon=True)
    lock._heartbeat.start()
