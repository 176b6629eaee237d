"""_run/open.py: the channels a run's rooms use are the ones CHANNELS names, made first; what
unfinished saves left goes at open (and at gc, counted), never what a version still needs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import cryosnap
import cryosnap.policy
from cryosnap import engine
from cryosnap._run.open import CHANNELS
from cryosnap.dist import LocalCoordinator
from cryosnap.errors import StorageError, StorageTimeoutError
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore


class _Recording(LocalCoordinator):
    """A world of one that records the channels asked of it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def channel(self, name: str) -> LocalCoordinator:
        self.names.append(name)
        return self


def test_a_run_makes_the_channels_of_channels_first_and_uses_no_other(tmp_path: Path) -> None:
    coord = _Recording()
    every = cryosnap.policy.EveryNSteps(2)
    with cryosnap.Checkpointer(tmp_path / "run", comm=coord, keep=1, policy=every) as ckpt:
        ckpt.save(1, {"w": np.zeros(4)}).result()
        ckpt.save(2, {"w": np.ones(4)}).result()  # retention runs
        assert ckpt.should_save(3) is False
        ckpt.restore()
    assert coord.names[: len(CHANNELS)] == list(CHANNELS)
    assert set(coord.names) == set(CHANNELS)  # a room's channel missing there fails here


# -- what unfinished saves left ----------------------------------------------------------------


def _files(root: Path) -> set[str]:
    """The run's files under data/ and versions/ (the lock's file is the writer's)."""
    return {
        str(p.relative_to(root))
        for sub in ("data", "versions")
        for p in (root / sub).rglob("*")
        if p.is_file()
    }


def _keys_of(root: Path, step: int) -> set[str]:
    """The files version ``step`` of the run at ``root`` consists of."""
    record = engine.read_commit(LocalStore(root), step)
    return {record.key, *(m.key for m in record.manifests), *record.data_files}


def _plant_leftovers(run: Path) -> set[str]:
    """What a killed save and a save that failed at its commit record leave: a ``.partial``
    data file, a writer's temporary manifest, and step 2 whole but for its commit record."""
    (run / "versions" / f"{2:012d}" / "COMMIT.json").unlink()
    partial = run / "data" / f"{3:012d}-r00000-0123abcd.dat.partial"
    partial.write_bytes(b"\0" * 5000)
    tmp = run / "versions" / f"{3:012d}" / ".rank-00000.json.0123abcd.tmp"
    tmp.parent.mkdir()
    tmp.write_bytes(b"{")
    return _files(run) - _keys_of(run, 1)


def test_open_removes_what_unfinished_saves_left_and_nothing_else(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, direct_io=False) as ckpt:  # keep=None: retention never runs
        ckpt.save(1, {"w": np.arange(1000.0)}).result()
        ckpt.save(2, {"w": np.arange(1000.0) + 1}).result()
    left = _plant_leftovers(run)
    assert len(left) == 4  # step 2's data file and manifest, the partial file, the temporary
    with cryosnap.Checkpointer(run, direct_io=False) as ckpt:
        assert ckpt.steps() == [1]
        assert _files(run) == _keys_of(run, 1)
        ckpt.save(2, {"w": np.arange(1000.0) + 2}).result()
    np.testing.assert_array_equal(cryosnap.load(run, step=1)["w"], np.arange(1000.0))
    np.testing.assert_array_equal(cryosnap.load(run)["w"], np.arange(1000.0) + 2)


def test_gc_counts_and_removes_what_unfinished_saves_left(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, direct_io=False) as ckpt:
        ckpt.save(1, {"w": np.arange(1000.0)}).result()
        ckpt.save(2, {"w": np.arange(1000.0) + 1}).result()
    left = _plant_leftovers(run)
    left_bytes = sum((run / k).stat().st_size for k in left)
    partial = f"data/{3:012d}-r00000-0123abcd.dat.partial"
    dry = cryosnap.Run(run).gc(keep=5, dry_run=True)
    assert (dry.removed, dry.kept, dry.freed_bytes) == ((), (1,), left_bytes)
    assert partial in dry.incomplete
    assert _files(run) - _keys_of(run, 1) == left  # a dry run deletes nothing
    done = cryosnap.Run(run).gc(keep=5)
    assert (done.freed_bytes, done.incomplete) == (left_bytes, dry.incomplete)
    assert _files(run) == _keys_of(run, 1)
    np.testing.assert_array_equal(cryosnap.load(run)["w"], np.arange(1000.0))


def _full_at_commit(step: int, error: type[Exception]) -> Callable[[str, str], None]:
    """A disk that fills exactly when the commit record of ``step`` is written."""

    def fault(op: str, key: str) -> None:
        if op == "write" and key == f"versions/{step:012d}/COMMIT.json":
            raise error(f"{key}: No space left on device")

    return fault


def test_a_save_that_failed_at_its_commit_record_leaves_nothing(tmp_path: Path) -> None:
    """keep=1 on a full disk: the failed save's files go at once (retention runs only after a
    commit), so the next save has the room they took."""
    run = tmp_path / "run"
    store = FaultyStore(LocalStore(run, direct_io=False), fault=_full_at_commit(2, StorageError))
    with cryosnap.Checkpointer(store, keep=1) as ckpt:
        ckpt.save(1, {"w": np.arange(1000.0)}).result()
        with pytest.raises(StorageError, match="No space left"):
            ckpt.save(2, {"w": np.arange(1000.0) + 1}).result()
        ckpt.wait()
        assert _files(run) == _keys_of(run, 1)
        ckpt.save(3, {"w": np.arange(1000.0) + 3}).result()
        assert ckpt.steps() == [3]


def test_files_of_a_commit_that_may_still_land_stay(tmp_path: Path) -> None:
    """A commit record whose write timed out may still land: the files it names stay."""
    run = tmp_path / "run"
    fault = _full_at_commit(2, StorageTimeoutError)
    store = FaultyStore(LocalStore(run, direct_io=False), fault=fault)
    with cryosnap.Checkpointer(store) as ckpt:
        ckpt.save(1, {"w": np.arange(1000.0)}).result()
        with pytest.raises(StorageTimeoutError):
            ckpt.save(2, {"w": np.arange(1000.0) + 1}).result()
        ckpt.wait()
        assert len(_files(run) - _keys_of(run, 1)) == 2  # its data file and manifest


def test_open_keeps_the_files_a_resumed_flush_reuses(tmp_path: Path) -> None:
    """A flush interrupted after copying the data files: the reopened run's flush finds them
    on the persistent level and copies nothing again; the sweep at open leaves them."""
    persistent, scratch = tmp_path / "persistent", tmp_path / "scratch"
    with cryosnap.Checkpointer(persistent, scratch=scratch, direct_io=False) as ckpt:
        ckpt.save(1, {"w": np.arange(1000.0)}).result()
    copied = _keys_of(persistent, 1) - {engine.read_commit(LocalStore(persistent), 1).key}
    (persistent / "versions" / f"{1:012d}" / "COMMIT.json").unlink()  # the flush's last write
    faulty = FaultyStore(LocalStore(persistent, direct_io=False))
    with cryosnap.Checkpointer(faulty, scratch=scratch, direct_io=False) as ckpt:
        ckpt.wait()
    assert cryosnap.Run(persistent).steps() == [1]
    touched = {key for op, key in faulty.ops if op in ("delete", "open_writer", "write")}
    assert not touched & copied, touched & copied
