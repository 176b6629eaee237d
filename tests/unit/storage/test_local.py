"""LocalStore: the conformance suite plus what only a POSIX directory can show."""

from __future__ import annotations

from pathlib import Path

import pytest

from cryosnap.errors import StorageError
from cryosnap.storage import LocalStore, open_store, unwrap
from cryosnap.testing.store import StoreTests


def _files(root: Path) -> list[str]:
    """Every file under ``root`` (temporaries included), relative, sorted."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> LocalStore:
        return LocalStore(tmp_path / "run")

    def test_list_shows_every_valid_key(self, store: LocalStore) -> None:
        super().test_list_shows_every_valid_key(store)

    # -- local only --------------------------------------------------------------------------

    def test_root_is_created_lazily(self, tmp_path: Path) -> None:
        store = LocalStore(tmp_path / "a" / "b")
        assert store.list() == []
        assert not (tmp_path / "a").exists()
        store.write("k", b"1")
        assert (tmp_path / "a" / "b" / "k").read_bytes() == b"1"

    def test_url_and_equality(self, tmp_path: Path) -> None:
        store = LocalStore(tmp_path / "run")
        assert store.url == str(tmp_path / "run")
        assert store == LocalStore(str(tmp_path / "run"))
        assert hash(store) == hash(LocalStore(str(tmp_path / "run")))
        assert store != LocalStore(tmp_path / "other")

    def test_relative_and_home_roots_are_absolute(self, tmp_path: Path) -> None:
        assert Path(LocalStore("rel/run").url).is_absolute()
        assert not LocalStore("~/run").url.startswith("~")

    def test_write_leaves_no_temporary(self, store: LocalStore) -> None:
        for i in range(3):
            store.write("versions/000000000001/COMMIT.json", b"x" * i)
        store.write("top", b"y")
        assert _files(store.root) == ["top", "versions/000000000001/COMMIT.json"]

    def test_writer_uses_a_partial_file_until_commit(self, store: LocalStore) -> None:
        w = store.open_writer("data/f.dat")
        w.write([b"abc"])
        assert _files(store.root) == ["data/f.dat.partial"]
        w.commit()
        assert _files(store.root) == ["data/f.dat"]
        assert (store.root / "data" / "f.dat").read_bytes() == b"abc"

    def test_abort_removes_the_partial_file(self, store: LocalStore) -> None:
        w = store.open_writer("data/f.dat")
        w.write([b"abc" * 1000])
        w.abort()
        assert _files(store.root) == []

    def test_writer_handles_many_buffers(self, store: LocalStore) -> None:
        # More buffers than one writev call takes (IOV_MAX is 1024 on Linux).
        parts = [bytes([i % 256]) * (i % 7 + 1) for i in range(3000)]
        w = store.open_writer("data/many.dat")
        w.write(parts)
        w.commit()
        assert store.read("data/many.dat") == b"".join(parts)
        bufs = [memoryview(bytearray(len(p))) for p in parts]
        store.read_into("data/many.dat", 0, bufs)
        assert [bytes(b) for b in bufs] == parts

    def test_os_errors_become_storage_errors(self, store: LocalStore) -> None:
        store.write("file", b"x")
        with pytest.raises(StorageError, match="file/child") as info:
            store.write("file/child", b"y")  # a parent that is a file
        assert isinstance(info.value, OSError) and info.value.__cause__ is not None


@pytest.mark.parametrize("form", ["str", "path", "file-url"])
def test_open_store_gives_local_store(tmp_path: Path, form: str) -> None:
    location: str | Path = {
        "str": str(tmp_path),
        "path": tmp_path,
        "file-url": f"file://{tmp_path}",
    }[form]
    store = unwrap(open_store(location))  # under the TimeoutStore that bounds every call
    assert isinstance(store, LocalStore)
    assert store.root == tmp_path
