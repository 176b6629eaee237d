"""FsspecStore: the conformance suite over ``memory://`` and ``file://``, plus open_store."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from cryosnap.errors import StorageError
from cryosnap.storage import FsspecStore, LocalStore, open_store, unwrap
from cryosnap.storage._fsspec import _s3_defaults
from cryosnap.testing.store import StoreTests


class FsspecStoreTests(StoreTests):
    """The conformance suite, as every store runs it (the fixture names the backend)."""


class TestMemoryStore(FsspecStoreTests):
    @pytest.fixture
    def store(self) -> Iterator[FsspecStore]:
        url = f"memory://cryosnap-test-{uuid.uuid4().hex}"
        store = FsspecStore(url)
        yield store
        if store.fs.exists(store.root):
            store.fs.rm(store.root, recursive=True)

    def test_stores_are_isolated(self) -> None:
        a = FsspecStore(f"memory://iso-{uuid.uuid4().hex}")
        b = FsspecStore(f"memory://iso-{uuid.uuid4().hex}")
        try:
            a.write("k", b"a")
            assert b.list() == [] and not b.exists("k")
            assert FsspecStore(a.url + "/").read("k") == b"a"  # a trailing slash is the same
        finally:
            for s in (a, b):
                if s.fs.exists(s.root):
                    s.fs.rm(s.root, recursive=True)


class TestFileUrlStore(FsspecStoreTests):
    """FsspecStore over fsspec's LocalFileSystem (open_store would pick LocalStore instead)."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> FsspecStore:
        return FsspecStore(f"file://{tmp_path}/run")


def test_backend_failures_become_storage_errors() -> None:
    store = FsspecStore(f"memory://cryosnap-test-{uuid.uuid4().hex}")
    try:
        store.write("file", b"x")
        with pytest.raises(StorageError, match="file/child") as info:
            store.write("file/child", b"y")  # a parent that is a file
        assert isinstance(info.value, OSError) and info.value.__cause__ is not None
    finally:
        store.fs.rm(store.root, recursive=True)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_remove_incomplete_reclaims_a_crashed_writers_temporary(tmp_path: Path, kind: str) -> None:
    url = f"memory://cryosnap-test-{uuid.uuid4().hex}" if kind == "memory" else f"file://{tmp_path}"
    store = FsspecStore(url)
    try:
        store.write("data/kept.dat", b"k")
        w = store.open_writer("data/x.dat")
        w.write([b"never committed"])
        w._file.close()  # the process died here: its temporary stays, the writer is gone
        (leftover,) = [p for p in store.fs.find(store.root) if p.endswith(".tmp")]
        name = leftover.rsplit("/", 1)[-1]
        assert name.startswith(".x.dat.") and store.list() == ["data/kept.dat"]
        assert store.remove_incomplete("versions") == []
        assert store.remove_incomplete("data") == [f"data/{name}"]
        assert not any(p.endswith(".tmp") for p in store.fs.find(store.root))
        assert store.remove_incomplete() == []
        assert store.list() == ["data/kept.dat"] and store.read("data/kept.dat") == b"k"
    finally:
        if kind == "memory":
            store.fs.rm(store.root, recursive=True)


def test_remove_incomplete_of_a_missing_directory(tmp_path: Path) -> None:
    assert FsspecStore(f"file://{tmp_path}/none").remove_incomplete() == []
    with pytest.raises(ValueError, match="invalid storage key"):
        FsspecStore(f"file://{tmp_path}").remove_incomplete("../up")


def test_s3_requests_are_bounded_by_default() -> None:
    config = _s3_defaults({"key": "k"})["config_kwargs"]
    assert config["connect_timeout"] > 0 and config["read_timeout"] > 0
    assert config["retries"]["total_max_attempts"] <= 3
    # The caller's choices win, and its options are not modified.
    mine = {"config_kwargs": {"read_timeout": 300, "retries": {"max_attempts": 9}}}
    config = _s3_defaults(mine)["config_kwargs"]
    assert config["read_timeout"] == 300 and config["retries"] == {"max_attempts": 9}
    assert mine == {"config_kwargs": {"read_timeout": 300, "retries": {"max_attempts": 9}}}


def test_s3_retries_from_the_environment_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    assert "retries" not in _s3_defaults({})["config_kwargs"]


def test_unknown_protocol_is_a_storage_error() -> None:
    with pytest.raises(StorageError, match="nosuchproto://x"):
        FsspecStore("nosuchproto://x")


# ---------------------------------------------------------------------------------------------
# open_store dispatch


def test_open_store_dispatch(tmp_path: Path) -> None:
    assert isinstance(unwrap(open_store(str(tmp_path))), LocalStore)
    assert isinstance(unwrap(open_store(tmp_path)), LocalStore)
    local = unwrap(open_store(f"file://{tmp_path}"))
    assert isinstance(local, LocalStore) and local.root == tmp_path
    mem = unwrap(open_store("memory://cryosnap-dispatch"))
    assert isinstance(mem, FsspecStore) and mem.url == "memory://cryosnap-dispatch"
    assert isinstance(unwrap(open_store("memory:cryosnap-dispatch")), FsspecStore)
    assert isinstance(fsspec.filesystem("memory"), type(mem.fs))


def test_open_store_passes_a_store_through(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    assert open_store(store) is store
    mem = FsspecStore("memory://cryosnap-dispatch")
    assert open_store(mem) is mem


@pytest.mark.parametrize("location", [None, 3, b"/tmp/x", "", ["a"], object()])
def test_open_store_rejects_other_types(location: Any) -> None:
    with pytest.raises(TypeError, match="checkpoint path"):
        open_store(location)
