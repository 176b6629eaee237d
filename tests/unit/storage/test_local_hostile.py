"""LocalStore against a hostile run directory: symlinks, FIFOs and stray names planted in it.

A run is a closed world (see cryosnap.storage._local): nothing in it makes cryosnap read, write
or delete outside it, nothing in it blocks a reader, and crash leftovers are reclaimed.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap.engine import list_steps, read_commit
from cryosnap.errors import CheckpointError, CheckpointFormatError, StorageError
from cryosnap.storage import LocalStore

PAYLOAD = bytes(range(256)) * 8


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "run")


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the run holding a file no run may touch."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.dat").write_bytes(PAYLOAD)
    return out


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}


def _bounded(call: Callable[[], Any], seconds: float = 20.0) -> tuple[bool, BaseException | None]:
    """Run ``call`` on a thread: whether it returned within ``seconds`` (it did not if it is
    blocked on a FIFO), and what it raised."""
    raised: list[BaseException | None] = [None]

    def target() -> None:
        try:
            call()
        except BaseException as exc:
            raised[0] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive(), raised[0]


def _release_fifo(path: Path) -> None:
    """Unblock a reader stuck opening the FIFO ``path`` (it gets EOF)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:
        assert exc.errno == errno.ENXIO  # nobody was waiting


# -- symlinks --------------------------------------------------------------------------------


def test_symlinked_data_file_is_never_read(store: LocalStore, outside: Path) -> None:
    store.write("data/f.dat", b"inside")
    link = store.root / "data" / "f.dat"
    link.unlink()
    link.symlink_to(outside / "secret.dat")
    calls: dict[str, Callable[[], Any]] = {
        "read": lambda: store.read("data/f.dat"),
        "read_into": lambda: store.read_into("data/f.dat", 0, [memoryview(bytearray(4))]),
        "size": lambda: store.size("data/f.dat"),
    }
    for op, call in calls.items():
        with pytest.raises(CheckpointFormatError, match="symlink, not a regular file") as info:
            call()
        assert "data/f.dat" in str(info.value) and store.url in str(info.value), op
    assert not store.exists("data/f.dat")
    assert store.list() == []
    # Writing the key replaces the link itself; the file it pointed to is untouched.
    store.write("data/f.dat", b"new")
    assert not link.is_symlink() and store.read("data/f.dat") == b"new"
    assert _snapshot(outside) == {"secret.dat": PAYLOAD}


def test_symlinked_directory_is_never_entered(store: LocalStore, outside: Path) -> None:
    store.write("data/mine.dat", b"1")
    shutil.rmtree(store.root / "data")
    (store.root / "data").symlink_to(outside, target_is_directory=True)
    (outside / "x.dat.partial").write_bytes(b"p")
    before = _snapshot(outside)

    assert store.list() == [] and store.list("data") == []
    assert not store.exists("data/secret.dat")
    with pytest.raises(CheckpointFormatError, match="data is a symlink, not a directory"):
        store.read("data/secret.dat")
    with pytest.raises(StorageError, match="data is a symlink"):
        store.delete("data/secret.dat")
    with pytest.raises(StorageError, match="data is a symlink"):
        store.write("data/new.dat", b"2")
    with pytest.raises(StorageError, match="data is a symlink"):
        store.open_writer("data/new.dat")
    assert store.remove_incomplete() == [] and store.remove_incomplete("data") == []
    assert _snapshot(outside) == before


def test_symlink_deeper_in_the_key(store: LocalStore, outside: Path) -> None:
    (outside / "sub").mkdir()
    (outside / "sub" / "k").write_bytes(b"outside")
    store.write("a/b", b"1")
    (store.root / "a" / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointFormatError, match="a/link is a symlink"):
        store.read("a/link/sub/k")
    with pytest.raises(StorageError, match="a/link is a symlink"):
        store.write("a/link/sub/k", b"overwritten")
    assert (outside / "sub" / "k").read_bytes() == b"outside"
    assert store.list() == ["a/b"]


def test_symlinked_commit_record(store: LocalStore, outside: Path) -> None:
    key = "versions/000000000001/COMMIT.json"
    store.write(key, b"{}")
    commit = store.root / key
    (outside / "COMMIT.json").write_bytes(b"{}")
    commit.unlink()
    commit.symlink_to(outside / "COMMIT.json")
    with pytest.raises(CheckpointFormatError, match="symlink"):
        store.read(key)
    assert store.list("versions") == []
    store.delete(key)  # removes the link, never its target
    assert (outside / "COMMIT.json").read_bytes() == b"{}"
    assert not (store.root / "versions").exists()


def test_the_root_may_be_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "run").symlink_to(real, target_is_directory=True)
    store = LocalStore(tmp_path / "run")
    store.write("data/f.dat", b"1")
    assert store.list() == ["data/f.dat"] and store.read("data/f.dat") == b"1"
    assert (real / "data" / "f.dat").read_bytes() == b"1"


# -- FIFOs and other special files -----------------------------------------------------------


@pytest.mark.parametrize("op", ["read", "read_ranges", "size"])
def test_fifo_in_place_of_a_data_file_does_not_block(store: LocalStore, op: str) -> None:
    store.write("data/f.dat", PAYLOAD)
    fifo = store.root / "data" / "f.dat"
    fifo.unlink()
    os.mkfifo(fifo)
    calls: dict[str, Callable[[], Any]] = {
        "read": lambda: store.read("data/f.dat"),
        "read_ranges": lambda: store.read_ranges("data/f.dat", [(0, [memoryview(bytearray(4))])]),
        "size": lambda: store.size("data/f.dat"),
    }
    try:
        finished, raised = _bounded(calls[op])
    finally:
        _release_fifo(fifo)
    assert finished, f"{op} blocked on a FIFO"
    assert isinstance(raised, CheckpointFormatError), raised
    assert "FIFO, not a regular file" in str(raised)
    assert not store.exists("data/f.dat")


def test_special_files_are_not_listed(
    store: LocalStore, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store.write("data/ok.dat", b"1")
    os.mkfifo(store.root / "data" / "pipe")
    (store.root / "data" / "link.dat").symlink_to(outside / "secret.dat")
    with caplog.at_level(logging.WARNING, logger="cryosnap"):
        assert store.list("data") == ["data/ok.dat"]
        assert store.list() == ["data/ok.dat"]
    messages = [r.getMessage() for r in caplog.records if r.name == "cryosnap"]
    assert sum("stray file data/pipe ignored: a FIFO" in m for m in messages) == 1
    assert sum("stray file data/link.dat ignored: a symlink" in m for m in messages) == 1


# -- stray names -----------------------------------------------------------------------------


def test_stray_name_is_ignored_with_one_warning(
    store: LocalStore, caplog: pytest.LogCaptureFixture
) -> None:
    store.write("data/a.dat", b"1")
    (store.root / "data" / "#notes#").write_text("mine")
    (store.root / "bad name").mkdir()
    (store.root / "bad name" / "f").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="cryosnap"):
        for _ in range(3):
            assert store.list("data") == ["data/a.dat"]
            assert store.list() == ["data/a.dat"]
    warned = [r.getMessage() for r in caplog.records if r.name == "cryosnap"]
    assert len(warned) == 2, warned  # one per stray name, however often it is listed
    assert "stray file data/#notes# ignored: not a valid key" in warned[0]
    assert "bad name/f" in warned[1]
    assert (store.root / "data" / "#notes#").read_text() == "mine"


def test_retention_survives_a_stray_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    with (
        caplog.at_level(logging.WARNING, logger="cryosnap"),
        cryosnap.Checkpointer(run, keep=1) as ckpt,
    ):
        ckpt.save(0, {"w": np.arange(1000)}).result()
        (run / "data" / "#notes#").write_text("mine")
        for step in (1, 2):
            ckpt.save(step, {"w": np.arange(1000) + step}).result()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    store = LocalStore(run)
    assert list_steps(store) == [2]
    # Every earlier version's data file is gone; the stray file is left alone.
    assert store.list("data") == sorted(read_commit(store, 2).data_files)
    assert (run / "data" / "#notes#").read_text() == "mine"
    np.testing.assert_array_equal(cryosnap.load(run)["w"], np.arange(1000) + 2)


# -- crash leftovers -------------------------------------------------------------------------


def test_remove_incomplete_removes_only_leftovers(store: LocalStore, outside: Path) -> None:
    keep = ["data/a.dat", "data/a.tmp", "data/.hidden", "versions/000000000001/COMMIT.json"]
    for k in keep:
        store.write(k, b"k")
    leftovers = [
        "data/b.dat.partial",
        "data/.a.dat.abcd1234.tmp",
        "versions/000000000001/.COMMIT.json.1234abcd.tmp",
        "x.partial",
    ]
    for k in leftovers:
        (store.root / k).write_bytes(b"crashed")
    (store.root / "data" / "dir.partial").mkdir()  # not a file: left alone
    (store.root / "data" / "link.partial").symlink_to(outside / "secret.dat")
    os.mkfifo(store.root / "data" / "pipe.partial")

    assert store.remove_incomplete("data") == sorted(leftovers[:2])
    assert store.remove_incomplete() == sorted(leftovers[2:])
    assert store.remove_incomplete() == []
    assert store.list() == sorted(keep)
    assert (store.root / "data" / "dir.partial").is_dir()
    assert (store.root / "data" / "link.partial").is_symlink()
    assert stat.S_ISFIFO((store.root / "data" / "pipe.partial").lstat().st_mode)
    assert _snapshot(outside) == {"secret.dat": PAYLOAD}
    assert store.remove_incomplete("no/such/dir") == []


def test_writer_never_reuses_a_planted_partial_name(store: LocalStore, outside: Path) -> None:
    (store.root / "data").mkdir(parents=True)
    (store.root / "data" / "f.dat.partial").symlink_to(outside / "secret.dat")
    w = store.open_writer("data/f.dat")
    w.write([b"new"])
    w.commit()
    assert store.read("data/f.dat") == b"new"
    assert _snapshot(outside) == {"secret.dat": PAYLOAD}


# -- durable directory creation --------------------------------------------------------------


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """(st_dev, st_ino) of every directory fsynced while the test runs."""
    seen: list[tuple[int, int]] = []
    real = os.fsync

    def recording(fd: Any) -> None:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            seen.append((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    yield seen


def _ids(*paths: Path) -> set[tuple[int, int]]:
    return {(os.stat(p).st_dev, os.stat(p).st_ino) for p in paths}


@pytest.mark.parametrize("streamed", [False, True])
def test_every_created_directory_is_fsynced_in_its_parent(
    tmp_path: Path, fsynced: list[tuple[int, int]], streamed: bool
) -> None:
    store = LocalStore(tmp_path / "new" / "run")
    key = "versions/000000000007/x.dat"
    if streamed:
        w = store.open_writer(key)
        w.write([b"abc"])
        w.commit()
    else:
        store.write(key, b"abc")
    root = store.root
    parents = [tmp_path, tmp_path / "new", root, root / "versions", root / "versions/000000000007"]
    assert _ids(*parents) <= set(fsynced)


def test_remove_incomplete_fsyncs_what_it_touched(
    store: LocalStore, fsynced: list[tuple[int, int]]
) -> None:
    store.write("data/a.dat", b"1")
    (store.root / "data" / "a.dat.partial").write_bytes(b"x")
    fsynced.clear()
    assert store.remove_incomplete() == ["data/a.dat.partial"]
    assert set(fsynced) == _ids(store.root / "data")


# -- end to end: an attacker edits a saved run -----------------------------------------------


def _data_files(run: Path) -> list[Path]:
    return sorted(p for p in (run / "data").iterdir() if p.is_file())


def test_load_refuses_a_data_file_linked_outside(tmp_path: Path) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    cryosnap.save(run, {"w": np.arange(5000)}, step=0)
    (data,) = _data_files(run)
    # The right bytes, but outside the run: a reader must not be led there.
    copy = elsewhere / data.name
    shutil.copyfile(data, copy)
    data.unlink()
    data.symlink_to(copy)
    with (
        pytest.raises(CheckpointError, match="symlink"),
        pytest.warns(RuntimeWarning, match="skipping damaged step 0"),
    ):
        cryosnap.load(run)


def test_load_falls_back_past_a_linked_or_fifo_data_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cryosnap.save(run, {"w": np.arange(5000)}, step=0)
    first = set(_data_files(run))
    cryosnap.save(run, {"w": np.arange(5000) + 1}, step=1)
    (newest,) = set(_data_files(run)) - first
    newest.unlink()
    os.mkfifo(newest)
    loaded: list[Any] = []
    try:
        with pytest.warns(RuntimeWarning, match="skipping damaged step 1.*FIFO"):
            finished, raised = _bounded(lambda: loaded.append(cryosnap.load(run)))
    finally:
        _release_fifo(newest)
    assert finished, "load blocked on a FIFO"
    assert raised is None, raised
    np.testing.assert_array_equal(loaded[0]["w"], np.arange(5000))
