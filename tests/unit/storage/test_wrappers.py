"""Store wrappers: the conformance suite over TimeoutStore, FaultyStore and StripedStore, and
TimeoutStore's bounds (stalled calls, stalled writers, abandoned threads, late results)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cryosnap.errors import CheckpointNotFoundError, StorageError, StorageTimeoutError
from cryosnap.storage import (
    DEFAULT_TIMEOUT_SECONDS,
    BlobWriter,
    FsspecStore,
    LocalStore,
    Store,
    TimeoutStore,
    WrapperStore,
    open_store,
    unwrap,
)
from cryosnap.storage.striped import LAYOUT_KEY, StripedStore
from cryosnap.testing import FaultyStore
from cryosnap.testing.store import StoreTests

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------------
# The Store contract through every wrapper


class TestTimeoutLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return TimeoutStore(LocalStore(tmp_path / "run"), 30)


class TestTimeoutMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> Iterator[Store]:
        inner = FsspecStore(f"memory://cryosnap-test-{uuid.uuid4().hex}")
        yield TimeoutStore(inner, 30)
        if inner.fs.exists(inner.root):
            inner.fs.rm(inner.root, recursive=True)


class TestFaultyStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return FaultyStore(LocalStore(tmp_path / "run"))


class TestStripedStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        devices = [LocalStore(tmp_path / "d0"), LocalStore(tmp_path / "d1")]
        store = StripedStore(devices, [None, None])
        # The layout record is the tier's own bookkeeping, read only when it is opened: the
        # contract's listings start from an empty store.
        devices[0].delete(LAYOUT_KEY)
        return store


class TestStripedOneDeviceStore(StoreTests):
    """One device: the striped store is that device, its local_path included."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        device = TimeoutStore(LocalStore(tmp_path / "d0"), 30)
        store = StripedStore([FaultyStore(device)], [None])
        device.delete(LAYOUT_KEY)
        return store


# ---------------------------------------------------------------------------------------------
# Helpers: a store whose chosen calls stall until released


class Stall:
    """A FaultyStore fault that blocks the chosen operations until :meth:`release`."""

    def __init__(self, *ops: str, key: str | None = None) -> None:
        self.ops = set(ops)
        self.key = key
        self.released = threading.Event()

    def __call__(self, op: str, key: str) -> None:
        if op in self.ops and (self.key is None or key == self.key):
            self.released.wait(60)

    def release(self) -> None:
        self.released.set()


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` (the late end of an abandoned call) for up to 30 s."""
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def local(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "run")


# The stalled call waits this long; every other call must finish within it on a loaded machine
# (a real open/write/fsync on a worker thread: 0.2 s was too short beside other work).
LIMIT = 1.0


def stalled(local: LocalStore, stall: Stall, **options: int) -> tuple[TimeoutStore, FaultyStore]:
    faulty = FaultyStore(local, fault=stall)
    return TimeoutStore(faulty, LIMIT, **options), faulty


def files(root: Path) -> list[str]:
    """Every file under ``root``, hidden and in-progress ones included."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------
# Stalled calls


def test_stalled_call_times_out_and_later_calls_work(local: LocalStore) -> None:
    stall = Stall("read", key="slow")
    store, _ = stalled(local, stall)
    store.write("slow", b"s")
    store.write("k", b"v")
    with pytest.raises(StorageTimeoutError) as info:
        store.read("slow")
    msg = str(info.value)
    assert f"reading slow in {local.url} did not return within {LIMIT:g} s" in msg, msg
    assert "unresponsive" in msg
    assert isinstance(info.value, StorageError) and isinstance(info.value, TimeoutError)
    assert store.stuck_calls == 1
    # The tier answers other calls meanwhile.
    assert store.read("k") == b"v"
    assert store.exists("k") and store.list() == ["k", "slow"]
    stall.release()
    wait_for(lambda: store.stuck_calls == 0, "the stalled read to return")
    assert store.read("slow") == b"s"


@pytest.mark.parametrize(
    ("op", "call"),
    [
        ("read_into", lambda s: s.read_into("k", 0, [memoryview(bytearray(1))])),
        ("write", lambda s: s.write("k", b"x")),
        ("open_writer", lambda s: s.open_writer("data/k.dat")),
        ("exists", lambda s: s.exists("k")),
        ("list", lambda s: s.list("data")),
        ("size", lambda s: s.size("k")),
        ("delete", lambda s: s.delete("k")),
        ("remove_incomplete", lambda s: s.remove_incomplete("data")),
    ],
)
def test_every_primitive_is_bounded(
    local: LocalStore, op: str, call: Callable[[Store], object]
) -> None:
    local.write("k", b"v")
    stall = Stall(op)
    store, _ = stalled(local, stall)
    try:
        with pytest.raises(StorageTimeoutError, match=f"in {local.url} did not return"):
            call(store)
    finally:
        stall.release()


def test_abandoned_calls_are_bounded(local: LocalStore) -> None:
    stall = Stall("read")
    store, faulty = stalled(local, stall, max_stuck_calls=3)
    local.write("k", b"v")
    for _ in range(3):
        with pytest.raises(StorageTimeoutError, match="did not return"):
            store.read("k")
    assert store.stuck_calls == 3
    attempted = len(faulty.ops)
    # A dead tier: further calls fail at once, without starting another thread on it.
    threads = threading.active_count()
    with pytest.raises(StorageTimeoutError, match="not attempted: 3 earlier calls") as info:
        store.exists("k")
    assert "unresponsive" in str(info.value) and local.url in str(info.value)
    assert len(faulty.ops) == attempted
    assert threading.active_count() == threads
    stall.release()
    wait_for(lambda: store.stuck_calls == 0, "the stalled reads to return")
    assert store.exists("k") and store.read("k") == b"v"


def test_stuck_calls_of_one_store_do_not_block_another(local: LocalStore, tmp_path: Path) -> None:
    stall = Stall("read")
    store, _ = stalled(local, stall, max_stuck_calls=1)
    local.write("k", b"v")
    other = TimeoutStore(LocalStore(tmp_path / "other"), LIMIT)
    try:
        with pytest.raises(StorageTimeoutError):
            store.read("k")
        other.write("k", b"w")
        assert other.read("k") == b"w"
    finally:
        stall.release()


# ---------------------------------------------------------------------------------------------
# Writers


def test_stalled_writer_write_times_out_and_the_writer_is_aborted_later(
    local: LocalStore,
) -> None:
    stall = Stall("writer.write")
    store, faulty = stalled(local, stall)
    w = store.open_writer("data/x.dat")
    with pytest.raises(StorageTimeoutError, match=r"writing data/x\.dat in .* did not return"):
        w.write([b"abc"])
    # The writer cannot be used any more: its file's content is unknown.
    with pytest.raises(StorageTimeoutError, match="refused"):
        w.commit()
    assert ("writer.commit", "data/x.dat") not in faulty.ops
    w.abort()  # returns at once; the inner abort waits for the stalled write
    assert files(local.root) == ["data/x.dat.partial"]
    stall.release()
    wait_for(lambda: files(local.root) == [], "the late abort to remove the partial file")
    assert not store.exists("data/x.dat")


def test_stalled_commit_times_out(local: LocalStore) -> None:
    stall = Stall("writer.commit")
    store, _ = stalled(local, stall)
    w = store.open_writer("data/x.dat")
    w.write([b"abc"])
    with pytest.raises(StorageTimeoutError, match=r"committing data/x\.dat"):
        w.commit()
    w.abort()
    stall.release()
    # The commit went through after its timeout ("timed out" means "unknown"); the abort
    # scheduled behind it found nothing left to discard.
    wait_for(lambda: store.stuck_calls == 0, "the stalled commit to return")
    assert store.read("data/x.dat") == b"abc"
    assert files(local.root) == ["data/x.dat"]


def test_stalled_abort_does_not_raise(local: LocalStore) -> None:
    released = threading.Event()

    class SlowAbort(WrapperStore):
        def open_writer(self, key: str) -> BlobWriter:
            inner = self.inner.open_writer(key)
            abort = inner.abort

            def slow() -> None:
                released.wait(60)
                abort()

            inner.abort = slow  # type: ignore[method-assign]
            return inner

    store = TimeoutStore(SlowAbort(local), LIMIT)
    w = store.open_writer("data/x.dat")
    w.write([b"abc"])
    w.abort()  # a cleanup step: no new error that would mask the one being handled
    assert store.stuck_calls == 1
    released.set()
    wait_for(lambda: files(local.root) == [], "the abort to finish")


def test_interrupted_writer_call_is_abandoned_like_a_timeout(local: LocalStore) -> None:
    import signal

    stall = Stall("writer.write")
    entered = threading.Event()

    def fault(op: str, key: str) -> None:
        if op == "writer.write":
            entered.set()
        stall(op, key)

    faulty = FaultyStore(local, fault=fault)
    store = TimeoutStore(faulty, 30)
    w = store.open_writer("data/x.dat")

    def interrupt() -> None:
        # Once the write is stuck in the store (the caller is waiting for it), not before:
        # on a loaded machine a fixed delay can fire before the call even started.
        if entered.wait(30):
            os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C handler, whatever an earlier test (a framework) left installed.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    sender = threading.Thread(target=interrupt, daemon=True)
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            w.write([b"abc"])
    finally:
        signal.signal(signal.SIGINT, previous)
        sender.join(30)
    assert store.stuck_calls == 1
    w.abort()  # must not close the file under the write still running
    assert files(local.root) == ["data/x.dat.partial"]
    stall.release()
    wait_for(lambda: files(local.root) == [], "the late abort to remove the partial file")


def test_open_writer_that_returns_late_is_aborted(local: LocalStore) -> None:
    stall = Stall("open_writer")
    store, _ = stalled(local, stall)
    with pytest.raises(StorageTimeoutError, match=r"creating data/x\.dat"):
        store.open_writer("data/x.dat")
    stall.release()
    wait_for(lambda: store.stuck_calls == 0, "the stalled open_writer to return")
    wait_for(lambda: files(local.root) == [], "the late writer to be aborted")


# ---------------------------------------------------------------------------------------------
# What an abandoned call may not do


def test_read_into_fills_every_kind_of_buffer(local: LocalStore) -> None:
    import numpy as np

    data = bytes(range(256)) * 8
    local.write("k", data)
    store = TimeoutStore(local, 30)
    arr = np.zeros((4, 8), np.float32)  # 128 bytes, not a byte format
    tail = memoryview(bytearray(20))[5:15]
    store.read_into("k", 100, [memoryview(arr), tail])
    assert arr.tobytes() == data[100:228] and bytes(tail) == data[228:238]


def test_late_write_stores_the_bytes_that_were_passed(local: LocalStore) -> None:
    stall = Stall("write", key="k")
    store, _ = stalled(local, stall)
    data = bytearray(b"first")
    with pytest.raises(StorageTimeoutError):
        store.write("k", data)
    data[:] = b"later"
    stall.release()
    wait_for(lambda: local.exists("k"), "the stalled write to land")
    assert local.read("k") == b"first"


# ---------------------------------------------------------------------------------------------
# Errors, threads, process exit


def test_errors_of_the_inner_call_propagate_unchanged(local: LocalStore) -> None:
    store = TimeoutStore(local, 30)
    with pytest.raises(CheckpointNotFoundError, match="absent") as info:
        store.read("absent")
    assert isinstance(info.value.__cause__, FileNotFoundError)
    with pytest.raises(ValueError, match="invalid storage key"):
        store.write("../escape", b"x")
    boom = OSError("injected")

    def fail(op: str, key: str) -> None:
        raise boom

    with pytest.raises(OSError) as raised:
        TimeoutStore(FaultyStore(local, fault=fail), 30).exists("k")
    assert raised.value is boom


def test_workers_are_shared_and_reused(tmp_path: Path) -> None:
    stores = [TimeoutStore(LocalStore(tmp_path / f"s{i}"), 30) for i in range(50)]
    for s in stores:
        s.write("k", b"v")
    before = threading.active_count()
    for _ in range(20):
        for s in stores:
            assert s.exists("k")
    # One caller at a time: at most one more worker, whatever the number of stores and calls.
    assert threading.active_count() <= before + 1


def test_a_stuck_call_does_not_block_process_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import threading
        from cryosnap.errors import StorageTimeoutError
        from cryosnap.storage import LocalStore, TimeoutStore
        from cryosnap.testing import FaultyStore

        never = threading.Event()
        store = TimeoutStore(
            FaultyStore(LocalStore({str(tmp_path)!r}), fault=lambda op, key: never.wait()), 0.1
        )
        try:
            store.exists("k")
        except StorageTimeoutError:
            print("timed out")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "timed out"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_starts_with_no_stuck_calls(local: LocalStore) -> None:
    stall = Stall("read")
    store, _ = stalled(local, stall, max_stuck_calls=1)
    local.write("k", b"v")
    try:
        with pytest.raises(StorageTimeoutError):
            store.read("k")
        pid = os.fork()
        if pid == 0:  # the child: the parent's stuck thread is not here
            ok = False
            try:
                stall.release()  # the child's copy of the event: unblocks the child's calls
                ok = store.exists("k") and store.read("k") == b"v"
            finally:
                os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        stall.release()


# ---------------------------------------------------------------------------------------------
# Arguments, open_store, unwrap


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan")])
def test_invalid_timeout(local: LocalStore, timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout_seconds"):
        TimeoutStore(local, timeout)


@pytest.mark.parametrize("timeout", [True, "5", None])
def test_timeout_of_another_type(local: LocalStore, timeout: object) -> None:
    with pytest.raises(TypeError, match="timeout_seconds"):
        TimeoutStore(local, timeout)  # type: ignore[arg-type]


@pytest.mark.parametrize("stuck", [0, -1])
def test_invalid_max_stuck_calls(local: LocalStore, stuck: int) -> None:
    with pytest.raises(ValueError, match="max_stuck_calls"):
        TimeoutStore(local, 1, max_stuck_calls=stuck)


def test_open_store_bounds_every_backend(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    assert isinstance(store, TimeoutStore) and store.timeout_seconds == DEFAULT_TIMEOUT_SECONDS
    assert isinstance(unwrap(store), LocalStore) and store.url == str(tmp_path)
    short = open_store(f"memory://cryosnap-test-{uuid.uuid4().hex}", timeout_seconds=5)
    assert isinstance(short, TimeoutStore) and short.timeout_seconds == 5
    assert isinstance(unwrap(short), FsspecStore)
    assert isinstance(open_store(tmp_path, timeout_seconds=None), LocalStore)
    with pytest.raises(ValueError, match="timeout_seconds"):
        open_store(tmp_path, timeout_seconds=0)


def test_open_store_passes_a_store_through_unbounded(local: LocalStore) -> None:
    assert open_store(local) is local
    assert open_store(local, timeout_seconds=5) is local


def test_unwrap(local: LocalStore, tmp_path: Path) -> None:
    stack = FaultyStore(TimeoutStore(FaultyStore(local), 5))
    assert unwrap(stack) is local
    assert unwrap(local) is local
    striped = StripedStore([stack], [None])
    assert unwrap(striped) is striped
    assert repr(stack).startswith("FaultyStore(TimeoutStore(FaultyStore(LocalStore(")


def test_faulty_store_sees_remove_incomplete(local: LocalStore) -> None:
    faulty = FaultyStore(local)
    assert faulty.remove_incomplete("data") == []
    assert faulty.ops == [("remove_incomplete", "data")]


# ---------------------------------------------------------------------------------------------
# StripedStore: every device


def test_striped_store_removes_incomplete_files_on_every_device(tmp_path: Path) -> None:
    d0, d1 = LocalStore(tmp_path / "d0"), LocalStore(tmp_path / "d1")
    store = StripedStore([d0, d1], [None, None])
    store.write("data/a-d1.dat", b"kept")  # on d1
    for dev, name in [(d0, "b-d0.dat"), (d1, "c-d1.dat")]:
        (dev.root / "data").mkdir(parents=True, exist_ok=True)
        (dev.root / "data" / f"{name}.partial").write_bytes(b"crashed")  # a killed writer's
    assert store.remove_incomplete("data") == ["data/b-d0.dat.partial", "data/c-d1.dat.partial"]
    assert files(tmp_path / "d1") == ["data/a-d1.dat"]
    assert files(tmp_path / "d0") == [LAYOUT_KEY]
    assert store.remove_incomplete() == []
