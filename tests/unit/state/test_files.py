"""``cryosnap.File`` leaves in the state layer: the skeleton node and blob ``flatten`` makes of a
file, the handles ``Restorer`` builds, ``into=``'s checks, and :class:`FileWrites` (staged
beside each target, renamed all at once, discarded without a trace).

Real files in ``tmp_path``; the save and restore of whole runs are in tests/unit/run/test_files.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap._state import Restorer, check_into, flatten
from cryosnap._state.files import FileWrites, loaded_file
from cryosnap.errors import (
    CheckpointError,
    CheckpointFormatError,
    FileLeafError,
    StateMismatchError,
)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_flatten_maps_the_file_into_one_blob_with_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = os.urandom(10_000)
    _write(tmp_path / "grid.h5", data)
    monkeypatch.chdir(tmp_path)
    flat = flatten({"grid": cryosnap.File("grid.h5"), "it": 3})
    node = flat.skeleton["v"][0]
    assert node == {"t": "file", "path": str(tmp_path / "grid.h5"), "size": 10_000, "b": 0}
    assert flat.files and flat.leaves == 2 and flat.logical_bytes == 10_000
    (blob,) = flat.blobs
    assert blob.key == ("grid",) and blob.nbytes == 10_000 and blob.origin == 0
    assert bytes(blob.host_view()) == data
    assert not blob.source.flags.writeable  # a read-only view of the page cache, no copy


def test_an_empty_file_is_an_empty_blob(tmp_path: Path) -> None:
    flat = flatten([cryosnap.File(_write(tmp_path / "e", b""))])
    assert flat.blobs[0].nbytes == 0 and flat.skeleton["v"][0]["size"] == 0


def test_a_state_without_files_says_so() -> None:
    assert not flatten({"x": np.zeros(3)}).files


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo"])
def test_what_is_no_regular_file_is_refused_naming_the_leaf(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "x"
    if kind == "directory":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)  # opening it for reading must not wait for a writer
    expected = {"missing": "no such file", "directory": "a directory", "fifo": "a FIFO"}[kind]
    with pytest.raises(FileLeafError, match=expected) as info:
        flatten({"out": [1, cryosnap.File(target)]})
    assert "out/1" in str(info.value) and str(target) in str(info.value)
    assert isinstance(info.value, (CheckpointError, ValueError))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files of mode 000")
def test_an_unreadable_file_is_refused(tmp_path: Path) -> None:
    target = _write(tmp_path / "secret", b"x")
    target.chmod(0)
    try:
        with pytest.raises(FileLeafError, match="permission denied"):
            flatten({"s": cryosnap.File(target)})
    finally:
        target.chmod(0o600)


def test_file_wants_a_path() -> None:
    with pytest.raises(TypeError, match="path"):
        cryosnap.File("")
    with pytest.raises(TypeError):
        cryosnap.File(3)  # type: ignore[arg-type]


def test_a_file_handle_reads_the_file_until_loaded(tmp_path: Path) -> None:
    target = _write(tmp_path / "f", b"abc")
    f = cryosnap.File(target)
    assert (f.path, f.size, f.read_bytes()) == (str(target), 3, b"abc")
    loaded = loaded_file("/saved/at", bytearray(b"xyz!"))
    assert (loaded.path, loaded.size, loaded.read_bytes()) == ("/saved/at", 4, b"xyz!")
    assert "loaded, 4 bytes" in repr(loaded) and repr(f) == f"cryosnap.File({str(target)!r})"


def test_a_loaded_handle_saved_again_stores_its_own_bytes() -> None:
    flat = flatten({"f": loaded_file("/gone/away", bytearray(b"12345"))})
    assert flat.skeleton["v"][0] == {"t": "file", "path": "/gone/away", "size": 5, "b": 0}
    assert bytes(flat.blobs[0].host_view()) == b"12345"


def test_restorer_builds_handles_over_the_filled_bytes(tmp_path: Path) -> None:
    flat = flatten({"f": cryosnap.File(_write(tmp_path / "f", b"hello"))})
    restorer = Restorer(flat.skeleton, [5], allow_pickle=False)
    (view,) = restorer.allocate()
    view[:] = b"hello"
    f = restorer.build()["f"]
    assert isinstance(f, cryosnap.File)
    assert (f.path, f.read_bytes()) == (str(tmp_path / "f"), b"hello")


@pytest.mark.parametrize(
    "node",
    [
        {"t": "file", "path": "/a", "size": 4, "b": 0},  # the blob has 5
        {"t": "file", "path": 7, "size": 5, "b": 0},
        {"t": "file", "size": 5, "b": 0},
        {"t": "file", "path": "/a", "size": "5", "b": 0},
    ],
)
def test_a_malformed_file_node_is_a_format_error(node: dict[str, object]) -> None:
    skeleton = {"t": "dict", "k": ["f"], "v": [node]}
    with pytest.raises(CheckpointFormatError, match="leaf f: malformed file node"):
        Restorer(skeleton, [5], allow_pickle=False).allocate()


def test_into_wants_a_file_where_one_was_saved_and_only_there(tmp_path: Path) -> None:
    source = _write(tmp_path / "f", b"1")
    skeleton = flatten({"f": cryosnap.File(source), "x": 1}).skeleton
    check_into(skeleton, {"f": cryosnap.File(tmp_path / "elsewhere"), "x": 0})
    with pytest.raises(StateMismatchError, match="at f: saved a file, into= has bytes"):
        check_into(skeleton, {"f": b"1", "x": 0})
    with pytest.raises(StateMismatchError, match="at x: saved a int leaf, into= has a cryosnap"):
        check_into(skeleton, {"f": cryosnap.File(source), "x": cryosnap.File(source)})


def test_file_writes_change_no_target_before_commit(tmp_path: Path) -> None:
    a, b = _write(tmp_path / "a", b"old a"), tmp_path / "sub" / "b"
    b.parent.mkdir()
    writes = FileWrites()
    writes.stage(cryosnap.File(a), loaded_file("/x", bytearray(b"new a")), ("a",))
    writes.stage(cryosnap.File(b), loaded_file("/y", bytearray(b"new b")), ("b",))
    assert a.read_bytes() == b"old a" and not b.exists()
    writes.commit()
    assert a.read_bytes() == b"new a" and b.read_bytes() == b"new b"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "sub"]  # no temp left


def test_file_writes_discarded_leave_nothing(tmp_path: Path) -> None:
    a = _write(tmp_path / "a", b"old")
    writes = FileWrites()
    writes.stage(cryosnap.File(a), loaded_file("/x", bytearray(b"new")), ("a",))
    writes.discard()
    assert a.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["a"]


def test_a_target_that_cannot_be_written_is_named(tmp_path: Path) -> None:
    writes = FileWrites()
    with pytest.raises(FileLeafError, match=r"restoring k: cannot write .*no-dir/f"):
        writes.stage(
            cryosnap.File(tmp_path / "no-dir" / "f"), loaded_file("/x", bytearray()), ("k",)
        )


def test_one_target_for_two_leaves_is_refused(tmp_path: Path) -> None:
    writes = FileWrites()
    target = cryosnap.File(tmp_path / "t")
    writes.stage(target, loaded_file("/x", bytearray(b"1")), ("a",))
    with pytest.raises(StateMismatchError, match="for two leaves: a and b"):
        writes.stage(target, loaded_file("/y", bytearray(b"2")), ("b",))
    writes.discard()
    assert list(tmp_path.iterdir()) == []


def test_file_writes_keep_the_mode_and_write_through_links(tmp_path: Path) -> None:
    real = _write(tmp_path / "real", b"old")
    real.chmod(0o640)
    link = tmp_path / "link"
    link.symlink_to(real)
    writes = FileWrites()
    writes.stage(cryosnap.File(link), loaded_file("/x", bytearray(b"new")), ("f",))
    writes.commit()
    assert link.is_symlink() and real.read_bytes() == b"new"
    assert real.stat().st_mode & 0o777 == 0o640
