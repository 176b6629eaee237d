"""The write lock on S3 (moto): conditional requests make it exclusive and fence a paused holder.

Writers opening one run at the same time (a free lock, or a stale one to take over) never both
win, because the lock object is created with ``If-None-Match: *`` and replaced with ``If-Match``;
a holder whose heartbeats stopped past ``stale_seconds`` cannot overwrite its successor even when
its own clock did not notice the pause.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from cryosnap._run.lock import CLAIMS_PREFIX, LOCK_KEY, RunLock, acquire_run_lock
from cryosnap.errors import CheckpointError, LockLostError
from cryosnap.storage import FsspecStore

from .conftest import S3Bucket


def _store(bucket: S3Bucket, path: str = "run") -> FsspecStore:
    return FsspecStore(bucket.url(path), **bucket.storage_options)


def _lock_info(bucket: S3Bucket, path: str = "run") -> dict[str, Any]:
    info: dict[str, Any] = json.loads(bucket.admin.cat_file(f"{bucket.name}/{path}/{LOCK_KEY}"))
    return info


def test_lock_object_is_created_once_and_released_conditionally(s3_bucket: S3Bucket) -> None:
    lock = acquire_run_lock(_store(s3_bucket), stale_seconds=60.0)
    try:
        assert (_lock_info(s3_bucket)["token"], lock.generation) == (lock.token, 1)
        with pytest.raises(CheckpointError, match="already open for writing by pid"):
            acquire_run_lock(_store(s3_bucket), stale_seconds=60.0)
        lock.check()
        # Conditional requests need no claims.
        assert not s3_bucket.admin.find(f"{s3_bucket.name}/run/{CLAIMS_PREFIX}")
    finally:
        lock.release()
    assert not s3_bucket.admin.exists(f"{s3_bucket.name}/run/{LOCK_KEY}")


def _stale_lock(bucket: S3Bucket, path: str) -> None:
    stale = {"host": "elsewhere", "pid": 1, "token": "old", "generation": 4, "heartbeat_unix": 1.0}
    bucket.admin.pipe_file(f"{bucket.name}/{path}/{LOCK_KEY}", json.dumps(stale).encode())


def test_simultaneous_starts_never_give_two_holders(s3_bucket: S3Bucket) -> None:
    # 30 runs, 3 writers each, all at once; every other run starts with a stale lock to take over.
    runs = [f"run-{i}" for i in range(30)]
    for path in runs[::2]:
        _stale_lock(s3_bucket, path)
    contenders = [(path, _store(s3_bucket, path)) for path in runs for _ in range(3)]
    barrier = threading.Barrier(len(contenders))
    won: list[tuple[str, RunLock]] = []
    errors: list[BaseException] = []

    def contend(path: str, store: FsspecStore) -> None:
        barrier.wait()
        try:
            won.append((path, acquire_run_lock(store, stale_seconds=60.0)))
        except CheckpointError as exc:
            if "open for writing" not in str(exc) and "at the same time" not in str(exc):
                errors.append(exc)
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=c) for c in contenders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert not errors, errors
        paths = [path for path, _ in won]
        assert len(paths) == len(set(paths)), sorted(paths)
        for path, lock in won:
            info = _lock_info(s3_bucket, path)
            assert info["token"] == lock.token
            assert info["generation"] == (5 if path in runs[::2] else 1)
    finally:
        for _, lock in won:
            lock.release()


def test_paused_holder_cannot_overwrite_its_successor(s3_bucket: S3Bucket) -> None:
    # The holder's clock never moves: only the conditional heartbeat can stop it.
    holder = acquire_run_lock(_store(s3_bucket), stale_seconds=1.0, clock=lambda: 0.0)
    successor: RunLock | None = None
    try:
        with holder._mutex:  # its heartbeats wait here: paused, as by SIGSTOP
            deadline = time.monotonic() + 60
            while successor is None:
                try:
                    # Its clock is frozen too: under load its own heartbeats may lag past
                    # its 0.8 s lease, which is not what this test is about; check() still
                    # reads the lock object and compares its token.
                    successor = acquire_run_lock(
                        _store(s3_bucket), stale_seconds=1.0, clock=lambda: 0.0
                    )
                except CheckpointError:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
        assert successor.generation == 2
        deadline = time.monotonic() + 60
        while not holder.lost:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(LockLostError, match=r"taken over by .* generation 2"):
            holder.check()
        holder.release()
        info = _lock_info(s3_bucket)
        assert (info["token"], info["generation"]) == (successor.token, 2)
        successor.check()
    finally:
        holder.release()
        if successor is not None:
            successor.release()
    assert not s3_bucket.admin.exists(f"{s3_bucket.name}/run/{LOCK_KEY}")
