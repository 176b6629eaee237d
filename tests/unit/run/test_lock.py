"""The run's write lock (lock.py): never followed, fenced when lost, exclusive when contended.

Local runs: ``writer.lock`` is never a way out of the run (symlink, hard link, FIFO), and a lock
file deleted or replaced under the holder loses the lock. Lock objects (fsspec stores without
conditional writes): a holder paused past ``stale_seconds`` (real SIGSTOP of a real process)
never overwrites its successor and ``check()`` says it lost; many writers opening at once with
random latency on every lock operation never give two holders.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
import cryosnap._run.lock
from cryosnap._run.lock import LOCK_KEY, RunLock, acquire_run_lock
from cryosnap.errors import CheckpointError, LockLostError, RunLockedError
from cryosnap.storage import FsspecStore, LocalStore
from cryosnap.testing import FaultyStore

_SRC = str(Path(cryosnap.__file__).resolve().parents[1])


@pytest.fixture
def held() -> Iterator[list[RunLock]]:
    """Locks taken by a test, released at its end whatever happened."""
    locks: list[RunLock] = []
    yield locks
    for lock in locks:
        lock.release()


def _lock_info(store: Any) -> dict[str, Any]:
    """The lock object as a reader sees it: a holder's heartbeat rewrites it, and on a store
    without atomic writes a read can catch it half-written (as lock._read_settled allows)."""
    for _ in range(50):
        try:
            info: dict[str, Any] = json.loads(store.read(LOCK_KEY))
            return info
        except ValueError:
            time.sleep(0.02)
    raise AssertionError(f"{LOCK_KEY} never read whole")


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_held_lock_is_refused_with_run_locked_error(
    tmp_path: Path, held: list[RunLock], kind: str
) -> None:
    if kind == "local":
        store: Any = LocalStore(tmp_path / "run")
    else:
        store = FsspecStore(f"memory://lock-held-{random.getrandbits(32)}")
    held.append(acquire_run_lock(store))
    with pytest.raises(RunLockedError, match="already open for writing by pid") as info:
        acquire_run_lock(store)
    assert isinstance(info.value, CheckpointError) and store.url in str(info.value)
    with pytest.raises(RunLockedError, match=str(os.getpid())):
        cryosnap.Checkpointer(store)  # a second writer: the same error through the facade


# --- local runs: flock -----------------------------------------------------------------------


def test_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    outside = tmp_path / "precious.txt"
    outside.write_text("do not truncate me")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_KEY).symlink_to(outside)
    with pytest.raises(cryosnap.LockFileError, match=r"writer\.lock is a symbolic link") as err:
        acquire_run_lock(LocalStore(run))
    assert err.value.path == str(run / LOCK_KEY)
    assert outside.read_text() == "do not truncate me"
    # A dangling link is not followed either: its target is never created.
    (run / LOCK_KEY).unlink()
    (run / LOCK_KEY).symlink_to(tmp_path / "created-outside")
    with pytest.raises(cryosnap.LockFileError, match="symbolic link"):
        cryosnap.Checkpointer(run)
    assert not (tmp_path / "created-outside").exists()


def test_hard_linked_or_fifo_lock_file_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "precious.txt"
    outside.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    os.link(outside, run / LOCK_KEY)
    with pytest.raises(cryosnap.LockFileError, match="hard-linked elsewhere"):
        acquire_run_lock(LocalStore(run))
    assert outside.read_text() == "keep"
    (run / LOCK_KEY).unlink()
    os.mkfifo(run / LOCK_KEY)
    with pytest.raises(cryosnap.LockFileError, match="not a regular file"):
        acquire_run_lock(LocalStore(run))


def test_deleted_or_replaced_lock_file_loses_the_lock(tmp_path: Path, held: list[RunLock]) -> None:
    store = LocalStore(tmp_path / "run")
    first = acquire_run_lock(store)
    held.append(first)
    first.check()
    # Another process deletes the file and locks a new one: both would believe they hold it.
    (store.root / LOCK_KEY).unlink()
    second = acquire_run_lock(store)
    held.append(second)
    with pytest.raises(LockLostError, match=r"was deleted|was replaced"):
        first.check()
    assert first.lost
    second.check()
    # Sticky: even with the original file back in place nothing changes.
    with pytest.raises(LockLostError):
        first.check()

    third = acquire_run_lock(LocalStore(tmp_path / "other"))
    held.append(third)
    (tmp_path / "other" / LOCK_KEY).unlink()
    with pytest.raises(LockLostError, match="was deleted"):
        third.check()


def test_released_lock_checks_as_lost(tmp_path: Path) -> None:
    lock = acquire_run_lock(LocalStore(tmp_path / "run"))
    lock.check()
    lock.release()
    lock.release()
    with pytest.raises(LockLostError, match="released"):
        lock.check()


# --- lock objects: fencing ---------------------------------------------------------------------


def test_silent_heartbeat_by_the_holders_clock_loses_the_lock(held: list[RunLock]) -> None:
    store = FsspecStore(f"memory://lock-clock-{random.getrandbits(32)}")
    now = [0.0]
    lock = acquire_run_lock(store, stale_seconds=1000.0, clock=lambda: now[0])
    held.append(lock)
    lock.check()
    now[0] += 749.0  # within 0.75 * stale_seconds of the last heartbeat
    lock.check()
    now[0] += 2.0
    with pytest.raises(LockLostError, match="no successful heartbeat"):
        lock.check()
    # The lock object itself still names us; a lost holder never deletes it on release.
    lock.release()
    assert _lock_info(store)["token"] == lock.token


def test_heartbeat_never_overwrites_a_new_holder(held: list[RunLock]) -> None:
    store = FsspecStore(f"memory://lock-fence-{random.getrandbits(32)}")
    # A frozen clock: a starved heartbeat thread can never look like a pause here, so the
    # only way to lose the lock is reading the successor's token.
    lock = acquire_run_lock(store, stale_seconds=0.4, clock=lambda: 0.0)
    held.append(lock)
    assert lock.generation == 1
    assert _lock_info(store)["generation"] == 1
    # A successor took over (as after our pause): a new token, the next generation.
    rival = {**_lock_info(store), "token": "rival", "generation": 2, "heartbeat_unix": 1.0}
    store.write(LOCK_KEY, json.dumps(rival).encode())
    deadline = time.monotonic() + 30
    while not lock.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lock.lost
    with pytest.raises(LockLostError, match=r"taken over by .* generation 2"):
        lock.check()
    time.sleep(0.3)  # several heartbeat intervals: none of them may write
    lock.release()
    assert _lock_info(store) == rival


def test_takeover_of_a_stale_lock_increments_the_generation(held: list[RunLock]) -> None:
    store = FsspecStore(f"memory://lock-gen-{random.getrandbits(32)}")
    stale = {"host": "elsewhere", "pid": 1, "token": "old", "generation": 7, "heartbeat_unix": 1.0}
    store.write(LOCK_KEY, json.dumps(stale).encode())
    lock = acquire_run_lock(store, stale_seconds=60.0)
    held.append(lock)
    assert lock.generation == 8
    assert _lock_info(store)["token"] == lock.token
    with pytest.raises(CheckpointError, match="already open for writing by pid"):
        acquire_run_lock(store, stale_seconds=60.0)
    assert not store.list(cryosnap._run.lock.CLAIMS_PREFIX)  # claims are removed after opening


_PAUSED_WRITER = """
import os, signal, sys
import cryosnap._run.lock as L
from cryosnap.errors import LockLostError
from cryosnap.storage import FsspecStore

lock = L.acquire_run_lock(FsspecStore(sys.argv[1]), stale_seconds=1.0)
print("held", lock.token, flush=True)
sys.stdin.readline()
# Stop between two heartbeats (a pause inside one is the window the module documents).
with lock._mutex:
    os.kill(os.getpid(), signal.SIGSTOP)
sys.stdin.readline()  # resumed; the parent says when to look
try:
    lock.check()
    print("still held", flush=True)
except LockLostError as exc:
    print("lost:", exc, flush=True)
lock.release()
print("released", flush=True)
"""


@contextlib.contextmanager
def _spawn(code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A Python child talking over pipes; killed (even if stopped) and reaped at the end."""
    env = {**os.environ, "PYTHONPATH": _SRC}
    with subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as child:
        try:
            yield child
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


def _acquire_when_stale(store: Any, stale: float) -> RunLock:
    deadline = time.monotonic() + 60
    while True:
        try:
            return acquire_run_lock(store, stale_seconds=stale)
        except CheckpointError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_paused_writer_resumes_without_overwriting_its_successor(
    tmp_path: Path, held: list[RunLock]
) -> None:
    url = f"file://{tmp_path}/run"
    with _spawn(_PAUSED_WRITER, url) as writer:
        assert writer.stdin is not None and writer.stdout is not None
        assert writer.stdout.readline().startswith("held")
        writer.stdin.write("pause\n")
        writer.stdin.flush()
        store = FsspecStore(url)
        # Refused while the writer beats; taken over once it has been silent for 1 s.
        successor = _acquire_when_stale(store, 1.0)
        held.append(successor)
        assert successor.generation == 2
        os.kill(writer.pid, signal.SIGCONT)
        time.sleep(0.6)  # two of its heartbeat intervals: it must write nothing
        writer.stdin.write("look\n")
        writer.stdin.flush()
        out = writer.stdout.read()
        assert writer.wait(60) == 0
    assert out.startswith("lost:"), out
    assert "released" in out
    info = _lock_info(store)
    assert (info["token"], info["generation"]) == (successor.token, 2)
    successor.check()


# --- lock objects: simultaneous starts ---------------------------------------------------------


def _race(stores: list[Any]) -> list[RunLock]:
    """Open every store's run at once from its own thread; the locks that were granted."""
    barrier = threading.Barrier(len(stores))
    won: list[RunLock] = []
    errors: list[BaseException] = []

    def contend(store: Any) -> None:
        barrier.wait()
        try:
            won.append(acquire_run_lock(store))
        except CheckpointError as exc:
            if "open for writing" not in str(exc) and "at the same time" not in str(exc):
                errors.append(exc)
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return won


def _slow_lock_ops(seed: int) -> Any:
    rng = random.Random(seed)
    rng_lock = threading.Lock()

    def fault(op: str, key: str) -> None:
        if key.startswith(LOCK_KEY):  # the lock object and the claims
            with rng_lock:
                delay = rng.uniform(0.0, 0.15)
            time.sleep(delay)

    return fault


def test_simultaneous_starts_never_give_two_holders(tmp_path: Path) -> None:
    # 30 runs opened by 3 writers each, all at the same time, 0-150 ms on every lock operation.
    stores: list[Any] = []
    for trial in range(30):
        url = f"file://{tmp_path}/run-{trial}"
        stores += [
            FaultyStore(FsspecStore(url), fault=_slow_lock_ops(trial * 3 + i)) for i in range(3)
        ]
    won = _race(stores)
    try:
        by_run: dict[str, list[RunLock]] = {}
        for lock in won:
            by_run.setdefault(lock.store.url, []).append(lock)
        assert all(len(locks) == 1 for locks in by_run.values()), {
            url: len(locks) for url, locks in by_run.items() if len(locks) > 1
        }
        for url, (lock,) in by_run.items():
            assert _lock_info(FsspecStore(url))["token"] == lock.token
    finally:
        for lock in won:
            lock.release()


# --- end to end: a paused Checkpointer resumes and saves nothing -------------------------------

_PAUSED_CHECKPOINTER = """
import os, signal, sys
import numpy as np
import cryosnap, cryosnap._run.lock as L
from cryosnap.storage import FsspecStore

L.STALE_SECONDS = 1.0
made = []
init = L.RunLock.__init__
def spy(self, *args, **kwargs):
    init(self, *args, **kwargs)
    made.append(self)
L.RunLock.__init__ = spy

ckpt = cryosnap.Checkpointer(FsspecStore(sys.argv[1]), keep=2)
for step in range(1, 4):
    ckpt.save(step, {"x": np.full(1000, step)}).result()
ckpt.wait()
print("idle", flush=True)
sys.stdin.readline()
# Stop between two heartbeats (a pause inside one is the window the module documents).
with made[0]._mutex:
    os.kill(os.getpid(), signal.SIGSTOP)
sys.stdin.readline()
try:
    for step in range(4, 8):
        ckpt.save(step, {"x": np.full(1000, step)}).result()
    print("saved after resuming", flush=True)
except cryosnap.LockLostError as exc:
    print("lost:", exc, flush=True)
try:
    ckpt.close()
except cryosnap.CheckpointError:
    pass
print("closed", flush=True)
"""


def test_paused_checkpointer_resumes_and_saves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"file://{tmp_path}/run"
    with _spawn(_PAUSED_CHECKPOINTER, url) as writer:
        assert writer.stdin is not None and writer.stdout is not None
        assert writer.stdout.readline() == "idle\n"
        writer.stdin.write("pause\n")
        writer.stdin.flush()
        monkeypatch.setattr(cryosnap._run.lock, "STALE_SECONDS", 1.0)
        deadline = time.monotonic() + 60
        while True:
            try:
                successor = cryosnap.Checkpointer(FsspecStore(url))
                break
            except CheckpointError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        with successor:
            before = successor.steps()
            for step in (100, 101):
                successor.save(step, {"x": np.full(1000, step)}).result()
            os.kill(writer.pid, signal.SIGCONT)
            writer.stdin.write("go\n")
            writer.stdin.flush()
            out = writer.stdout.read()
            assert writer.wait(60) == 0
            successor.save(102, {"x": np.full(1000, 102)}).result()
            steps = successor.steps()
            assert set(steps) == set(before) | {100, 101, 102}, (before, steps)
            for step in (100, 101, 102):
                assert int(successor.restore(step)["x"][0]) == step
    assert out.startswith("lost:"), out


# --- forks of the writer ---------------------------------------------------------------------

_FORKING_WRITER = """
import multiprocessing, os, sys, time
from cryosnap._run.lock import acquire_run_lock
from cryosnap.storage import LocalStore

started, running = os.pipe()

def work():
    os.write(running, b"x")
    time.sleep(120)

lock = acquire_run_lock(LocalStore(sys.argv[1]))
worker = multiprocessing.get_context("fork").Process(target=work, daemon=True)
worker.start()
# start() returns once the fork is made; the child's at-fork hooks (which let go of the lock)
# have run once it runs its target.
os.read(started, 1)
print("held", worker.pid, flush=True)
sys.stdin.readline()
"""


def test_a_forked_worker_does_not_keep_a_killed_writers_run_locked(
    tmp_path: Path, held: list[RunLock]
) -> None:
    # A DataLoader worker is a fork of the training process: it must not outlive a SIGKILLed
    # writer holding the run's flock.
    run = tmp_path / "run"
    with _spawn(_FORKING_WRITER, str(run)) as writer:
        assert writer.stdout is not None
        word, pid = writer.stdout.readline().split()
        assert word == "held"
        worker = int(pid)
        try:
            with pytest.raises(RunLockedError):
                acquire_run_lock(LocalStore(run))
            writer.kill()
            writer.wait(60)
            os.kill(worker, 0)  # the forked worker is still alive ...
            held.append(acquire_run_lock(LocalStore(run)))  # ... and the run is free
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_fork_of_the_writer_is_not_the_writer(
    tmp_path: Path, kind: str, held: list[RunLock]
) -> None:
    store: Any = LocalStore(tmp_path / "run") if kind == "local" else FsspecStore("memory://forked")
    lock = acquire_run_lock(store)
    held.append(lock)
    pid = os.fork()
    if pid == 0:  # the child: refuses to act as the writer, and its release changes nothing
        code = 1
        try:
            try:
                lock.check()
            except LockLostError as exc:
                code = 0 if "forked from the writer" in str(exc) else 2
            lock.release()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    lock.check()  # still the parent's
    if kind == "memory":
        assert _lock_info(store)["token"] == lock.token
    else:
        with pytest.raises(RunLockedError):
            acquire_run_lock(LocalStore(tmp_path / "run"))
