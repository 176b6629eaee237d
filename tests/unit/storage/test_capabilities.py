"""Declared store capabilities: what each store declares, how wrappers forward it, and the run
lock choosing its protocol from it (never from the store's class).

``CasStore`` is a backend the way a third party would add one: Store primitives plus conditional
writes, declared in its capabilities and checked by the conformance suite shipped in
``cryosnap.testing.store``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosnap._run.lock import CLAIMS_PREFIX, LOCK_KEY, acquire_run_lock
from cryosnap.errors import CheckpointError, CheckpointNotFoundError
from cryosnap.storage import (
    _STORE_MEMBERS,
    FsspecStore,
    LocalStore,
    Store,
    StoreCapabilities,
    TimeoutStore,
    WrapperStore,
    open_store,
)
from cryosnap.storage.striped import StripedStore
from cryosnap.testing import FaultyStore
from cryosnap.testing.store import StoreTests

pytestmark = pytest.mark.timeout(120)


class _LockedCas:
    """Compare-and-swap on a store's keys, tags being content hashes (as S3's ETags are);
    serialised by one lock, so exclusive among the users of this object. Records the timeout
    of every request."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.timeouts: list[float] = []
        self._lock = threading.Lock()

    def _current(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = self.store.read(key)
        except CheckpointNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def get(self, key: str, *, timeout: float) -> tuple[bytes, str] | None:
        self.timeouts.append(timeout)
        with self._lock:
            return self._current(key)

    def create(self, key: str, data: bytes, *, timeout: float) -> str | None:
        self.timeouts.append(timeout)
        with self._lock:
            if self._current(key) is not None:
                return None
            self.store.write(key, data)
            return hashlib.sha256(data).hexdigest()

    def replace(self, key: str, data: bytes, tag: str, *, timeout: float) -> str | None:
        self.timeouts.append(timeout)
        with self._lock:
            current = self._current(key)
            if current is None or current[1] != tag:
                return None
            self.store.write(key, data)
            return hashlib.sha256(data).hexdigest()

    def delete(self, key: str, tag: str | None, *, timeout: float) -> None:
        self.timeouts.append(timeout)
        with self._lock:
            current = self._current(key)
            if current is not None and (tag is None or current[1] == tag):
                self.store.delete(key)


class CasStore(WrapperStore):
    """A backend with conditional writes: an in-memory fsspec store's primitives plus
    compare-and-swap on its keys."""

    def __init__(self, url: str) -> None:
        super().__init__(FsspecStore(url))
        self.cas = _LockedCas(self.inner)

    @property
    def capabilities(self) -> StoreCapabilities:
        return StoreCapabilities(conditional_writes=self.cas)


def _memory_url() -> str:
    return f"memory://cryosnap-cas-{uuid.uuid4().hex}"


@pytest.fixture
def cas_store() -> Iterator[CasStore]:
    store = CasStore(_memory_url())
    yield store
    inner = store.inner
    assert isinstance(inner, FsspecStore)
    if inner.fs.exists(inner.root):
        inner.fs.rm(inner.root, recursive=True)


# ---------------------------------------------------------------------------------------------
# The conformance suite over a third-party backend, bare and wrapped


class TestCasStore(StoreTests):
    @pytest.fixture
    def store(self, cas_store: CasStore) -> Store:
        return cas_store


class TestTimeoutCasStore(StoreTests):
    @pytest.fixture
    def store(self, cas_store: CasStore) -> Store:
        return FaultyStore(TimeoutStore(cas_store, 30))


# ---------------------------------------------------------------------------------------------
# What each store declares, and the wrappers


def test_each_store_declares_what_it_offers(tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "run")
    assert local.capabilities == StoreCapabilities(local_path=tmp_path / "run")
    # fsspec's local file system keeps the fsspec lock protocol: no local_path.
    assert FsspecStore(f"file://{tmp_path}/other").capabilities == StoreCapabilities()
    assert FsspecStore(_memory_url()).capabilities == StoreCapabilities()


def test_wrappers_forward_capabilities(tmp_path: Path) -> None:
    local = LocalStore(tmp_path / "run")
    stack = FaultyStore(TimeoutStore(FaultyStore(local), 5))
    assert stack.capabilities == local.capabilities
    assert StripedStore([stack], [None]).capabilities == local.capabilities
    # Over several devices no directory holds every key.
    two = StripedStore([LocalStore(tmp_path / "d0"), stack], [None, None])
    assert two.capabilities == StoreCapabilities()


def test_timeout_store_bounds_conditional_writes(cas_store: CasStore) -> None:
    cas = TimeoutStore(cas_store, 3).capabilities.conditional_writes
    assert cas is not None
    assert cas.create("k", b"1", timeout=10) is not None
    assert cas.get("k", timeout=2) == (b"1", hashlib.sha256(b"1").hexdigest())
    assert cas_store.cas.timeouts == [3, 2]  # the smaller of the caller's and the store's


# ---------------------------------------------------------------------------------------------
# The run lock follows the declared capabilities


def test_lock_takes_an_flock_in_the_declared_local_path(tmp_path: Path) -> None:
    store = FaultyStore(TimeoutStore(LocalStore(tmp_path / "run"), 30))
    lock = acquire_run_lock(store)
    try:
        assert store.ops == []  # no lock object, no claims: the kernel's flock
        held = json.loads((tmp_path / "run" / LOCK_KEY).read_bytes())
        assert held["token"] == lock.token
        with pytest.raises(CheckpointError, match="already open for writing"):
            acquire_run_lock(LocalStore(tmp_path / "run"))
        lock.check()
    finally:
        lock.release()


def test_lock_uses_declared_conditional_writes(cas_store: CasStore) -> None:
    store = FaultyStore(TimeoutStore(cas_store, 7))
    lock = acquire_run_lock(store, stale_seconds=60.0)
    try:
        # Every change of the lock object went through compare-and-swap, none through claims.
        assert not [op for op in store.ops if op[0] in ("write", "delete")]
        assert not cas_store.list(CLAIMS_PREFIX)
        assert set(cas_store.cas.timeouts) == {7}  # min(store's 7 s, the lock's 30 s)
        assert json.loads(cas_store.read(LOCK_KEY))["token"] == lock.token
        with pytest.raises(CheckpointError, match="already open for writing"):
            acquire_run_lock(cas_store, stale_seconds=60.0)
        lock.check()
    finally:
        lock.release()
    assert not cas_store.exists(LOCK_KEY)


def test_lock_without_capabilities_uses_claims() -> None:
    store = FaultyStore(FsspecStore(_memory_url()))
    lock = acquire_run_lock(store, stale_seconds=60.0)
    try:
        written = [key for op, key in store.ops if op == "write"]
        assert written[0].startswith(CLAIMS_PREFIX + "/") and LOCK_KEY in written
    finally:
        lock.release()


# ---------------------------------------------------------------------------------------------
# A would-be store without capabilities


class _OldStore(WrapperStore):
    """A store written before ``capabilities``: every primitive, no declaration."""

    @property
    def capabilities(self) -> StoreCapabilities:
        raise AttributeError("capabilities")  # hasattr() is False, as for a class without it


def test_a_store_without_capabilities_is_named_as_such(tmp_path: Path) -> None:
    old = _OldStore(LocalStore(tmp_path / "run"))
    assert not isinstance(old, Store)
    with pytest.raises(TypeError, match=r"lacks capabilities .*StoreCapabilities\(\)"):
        open_store(old)


def test_the_message_knows_every_member_of_the_protocol() -> None:
    assert set(_STORE_MEMBERS) == {name for name in vars(Store) if not name.startswith("_")}
