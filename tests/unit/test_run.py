"""cryosnap.Run: the read-only handle on a run (steps, info, verify, diff, load) and removing
versions under the run's write lock, over real runs written by a Checkpointer."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

import cryosnap
from cryosnap import engine
from cryosnap.run import Removal, VersionSummary, committed_steps
from cryosnap.storage import FsspecStore, LocalStore, Store, TimeoutStore
from cryosnap.testing import FaultyStore

from .storage.test_capabilities import CasStore
from .support import assert_same

STEPS = [10, 20, 30, 40]
CHUNK = 4096
MARK = 12345.678  # written into "a" by step 40 only: content no other version holds


def make_states() -> dict[int, dict[str, Any]]:
    """The state of each step: each changes a few chunks of ``a``; ``w`` changes at 30."""
    a = np.zeros(50_000)
    w = torch.arange(1000, dtype=torch.float32)
    states = {}
    for i, step in enumerate(STEPS):
        a[i * 2000 : i * 2000 + 10] = step
        if step == 30:
            w = w * 2
        if step == 40:
            a[30_000:30_010] = MARK
        states[step] = {"a": a.copy(), "w": w.clone(), "meta": {"step": step, "name": "run"}}
    return states


STATES = make_states()


def write_run(where: str | Path | Store, steps: list[int] = STEPS) -> None:
    """One Checkpointer session: the first version full, the others incremental on it."""
    with cryosnap.Checkpointer(where, keep=None, chunk_bytes=CHUNK) as ckpt:
        for step in steps:
            ckpt.save(step, STATES[step]).result()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    write_run(path)
    return path


def files_of(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its content (what "nothing changed" compares)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def flip_byte(run: Path, content: bytes) -> None:
    """Damage the first byte of ``content`` where the run's data files hold it."""
    for data in sorted((run / "data").rglob("*")):
        raw = bytearray(data.read_bytes()) if data.is_file() else bytearray()
        at = raw.find(content)
        if at >= 0:
            raw[at] ^= 0xFF
            data.write_bytes(bytes(raw))
            return
    raise AssertionError(f"no data file holds {content!r:.40}")


# ---------------------------------------------------------------------------------------------
# reading


def test_steps_and_latest(run_dir: Path) -> None:
    run = cryosnap.Run(run_dir)
    assert run.steps() == STEPS and run.latest_step() == 40
    assert run.url == str(run_dir) and repr(run) == f"Run({str(run_dir)!r})"


def test_info_describes_a_version_from_its_manifest(run_dir: Path) -> None:
    run = cryosnap.Run(run_dir)
    newest = run.info()
    assert isinstance(newest, cryosnap.VersionInfo)
    assert (newest.step, newest.world_size, newest.ranks, newest.rank) == (40, 1, (0,), 0)
    assert newest.replicated is None
    assert newest.incremental and newest.base_step == 30
    assert 0 < newest.written_bytes < newest.logical_bytes
    assert newest.chunk_bytes == CHUNK and newest.created_unix > 0
    leaves = {leaf.path: leaf for leaf in newest.leaves}
    assert list(leaves) == ["a", "w", "meta/step", "meta/name"]
    a = leaves["a"]
    assert (a.kind, a.dtype, a.shape, a.nbytes) == ("numpy", "float64", [50_000], 400_000)
    assert (leaves["w"].kind, leaves["w"].dtype, leaves["w"].shape) == ("torch", "float32", [1000])
    assert leaves["meta/step"].value == "40"
    first = run.info(10)
    assert not first.incremental and first.base_step is None
    assert first.written_bytes > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        newest.step = 1  # type: ignore[misc]


def test_summary_describes_a_version_from_its_commit_record(run_dir: Path) -> None:
    run = cryosnap.Run(run_dir)
    summary = run.summary(40)
    info = run.info(40)
    assert isinstance(summary, VersionSummary) and summary.step == 40
    assert (summary.world_size, summary.leaves, summary.chunk_bytes) == (1, 4, CHUNK)
    assert summary.logical_bytes == info.logical_bytes
    assert summary.written_bytes == info.written_bytes
    assert summary.created_unix == info.created_unix and summary.data_files >= 1
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="step 15 not found"):
        run.summary(15)


def test_committed_steps_names_what_holds_no_version(run_dir: Path, tmp_path: Path) -> None:
    assert committed_steps(run_dir) == STEPS
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="holds the run"):
        committed_steps(tmp_path)
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="no checkpoint at"):
        committed_steps(tmp_path / "nope")


def test_load_forwards_to_the_read_path(run_dir: Path) -> None:
    run = cryosnap.Run(run_dir)
    assert_same(STATES[40], run.load())
    assert_same(STATES[20], run.load(20))
    into = {"a": np.zeros(50_000), "w": torch.zeros(1000), "meta": {"step": 0, "name": ""}}
    run.load(30, into=into)
    assert_same(STATES[30]["a"], into["a"])
    assert_same(STATES[30]["w"], into["w"])
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="step 15 not found"):
        run.load(15)
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="rank 3 has no part"):
        run.load(rank=3)
    only = run.load(20, keys=["w", "meta"])
    assert set(only) == {"w", "meta"}
    assert_same(STATES[20]["w"], only["w"])
    with pytest.raises(cryosnap.KeyNotFoundError, match="nope"):
        run.load(keys=["nope"])


def test_diff_names_the_changed_leaves_and_chunks(run_dir: Path) -> None:
    diff = cryosnap.Run(run_dir).diff(10, 20)
    rows = {r.path: r for r in diff.leaves}
    assert set(rows) == {"a", "meta/step"}
    assert (rows["a"].status, rows["a"].changed_chunks, rows["a"].changed_bytes) == (
        "changed",
        1,
        CHUNK,
    )
    assert rows["a"].chunks == -(-400_000 // CHUNK)
    assert diff.changed_bytes == CHUNK and (diff.a, diff.b, diff.rank) == (10, 20, 0)
    later = {r.path for r in cryosnap.Run(run_dir).diff(20, 30).leaves}
    assert later == {"a", "w", "meta/step"}


def test_verify_reports_a_flipped_byte_per_version_and_rank(run_dir: Path) -> None:
    run = cryosnap.Run(run_dir)
    report = run.verify()
    assert isinstance(report, cryosnap.VerifyReport)
    assert report.ok and [c.step for c in report.versions] == STEPS
    flip_byte(run_dir, np.full(10, MARK).tobytes())
    damaged = run.verify()
    assert not damaged.ok and [c.step for c in damaged.damaged] == [40]
    (damage,) = damaged.damaged[0].damage
    assert damage.rank == 0
    assert "step 40" in damage.error and "leaf a" in damage.error and "chunk" in damage.error
    assert run.verify(30).ok and not run.verify(40).ok
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="step 15 not found"):
        run.verify(15)


def test_reading_creates_and_changes_nothing(run_dir: Path) -> None:
    before = files_of(run_dir)
    run = cryosnap.Run(run_dir)
    run.steps(), run.info(), run.verify(), run.diff(10, 40), run.load()
    run.remove(10, dry_run=True)
    assert files_of(run_dir) == before


def test_reading_needs_no_lock(run_dir: Path) -> None:
    with cryosnap.Checkpointer(run_dir, keep=None, chunk_bytes=CHUNK):
        run = cryosnap.Run(run_dir)
        assert run.steps() == STEPS and run.verify().ok
        assert_same(STATES[40], run.load())


@pytest.mark.parametrize("at", ["COMMIT.json", "rank-00000.json"])
def test_verify_says_a_version_retired_while_verified_is_no_damage(tmp_path: Path, at: str) -> None:
    """A live writer's retention deletes step 2 between the listing and the read of its
    commit record, or after it (its record first, then its files): no damage, said."""
    with cryosnap.Checkpointer(tmp_path / "run", incremental=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"a": np.full(10_000, float(step))}).result()
    inner = LocalStore(tmp_path / "run")
    plan = engine.plan_retire(inner, drop=[2])  # what retention deletes of it, in order
    assert plan.data_files and plan.manifests

    def retire_2(op: str, key: str) -> None:
        if op == "read" and key == f"versions/{2:012d}/{at}" and inner.exists(key):
            engine.apply_retire(inner, plan)

    report = cryosnap.Run(FaultyStore(inner, fault=retire_2)).verify()
    assert report.ok and not report.damaged
    checks = [(c.step, c.retired, c.ok) for c in report.versions]
    assert checks == [(1, False, True), (2, True, True), (3, False, True)]
    assert report.versions[1].to_json()["retired"] is True
    assert "retired" not in report.versions[2].to_json()


# ---------------------------------------------------------------------------------------------
# remove


def test_remove_of_the_base_keeps_its_successors_restorable(run_dir: Path) -> None:
    run = cryosnap.Run(run_dir)
    removal = run.remove(10)
    assert isinstance(removal, Removal) and not removal.dry_run
    # Every later version builds on 10: its manifest and data stay, its commit record goes.
    assert removal.removed == (10,) and removal.kept == (20, 30, 40)
    assert removal.manifests == () and removal.data_files == ()
    assert run.steps() == [20, 30, 40]
    assert not (run_dir / "versions" / f"{10:012d}" / "COMMIT.json").exists()
    for step in (20, 30, 40):
        assert_same(STATES[step], run.load(step))
    assert run.verify().ok
    run.remove(20)
    run.remove(30)
    assert run.steps() == [40]
    assert_same(STATES[40], run.load())
    # The run stays writable: the next session saves a full version and restores it.
    with cryosnap.Checkpointer(run_dir, keep=None, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(50, STATES[10]).result()
    assert run.steps() == [40, 50]
    assert_same(STATES[10], run.load(50))
    assert_same(STATES[40], run.load(40))


def test_saving_a_removed_base_step_again_keeps_its_successor(run_dir: Path) -> None:
    run = cryosnap.Run(run_dir)
    run.remove(10)
    with contextlib.suppress(cryosnap.CheckpointExistsError):  # refusing the step is a fix too
        write_run(run_dir, [10])
    assert_same(STATES[40], run.load(40))


def test_remove_of_the_newest_frees_what_only_it_needs(tmp_path: Path) -> None:
    path = tmp_path / "run"
    write_run(path, [10, 20])
    run = cryosnap.Run(path)
    data_before = files_of(path / "data")
    plan = run.remove(20, dry_run=True)
    assert plan.dry_run and plan.removed == (20,) and plan.kept == (10,)
    assert len(plan.data_files) == 1 and plan.freed_bytes > 0
    assert files_of(path / "data") == data_before and run.steps() == [10, 20]
    removal = run.remove(20)
    assert dataclasses.replace(removal, dry_run=True) == plan
    gone = {k.removeprefix("data/") for k in removal.data_files}
    assert set(files_of(path / "data")) == set(data_before) - gone
    assert run.steps() == [10]
    assert_same(STATES[10], run.load())
    last = run.remove(10)
    assert run.steps() == [] and last.kept == () and run.latest_step() is None
    assert not files_of(path / "data")


def test_remove_while_a_checkpointer_holds_the_lock(run_dir: Path) -> None:
    with cryosnap.Checkpointer(run_dir, keep=None, chunk_bytes=CHUNK):
        before = files_of(run_dir)
        with pytest.raises(cryosnap.RunLockedError, match="cannot remove step 40") as info:
            cryosnap.Run(run_dir).remove(40)
        message = str(info.value)
        assert str(run_dir) in message and "already open for writing by pid" in message
        assert isinstance(info.value, cryosnap.CheckpointError)
        assert files_of(run_dir) == before
    assert cryosnap.Run(run_dir).steps() == STEPS


def test_remove_of_a_missing_step_changes_nothing(run_dir: Path) -> None:
    before = files_of(run_dir)
    run = cryosnap.Run(run_dir)
    with pytest.raises(cryosnap.CheckpointNotFoundError, match=f"step 15 not found in {run_dir}"):
        run.remove(15)
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="step 15 not found"):
        run.remove(15, dry_run=True)
    assert files_of(run_dir) == before


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda run: run.remove("10"), TypeError),
        (lambda run: run.remove(True), TypeError),
        (lambda run: run.remove(-1), ValueError),
        (lambda run: run.info(1.0), TypeError),
        (lambda run: run.info(-2), ValueError),
        (lambda run: run.verify("all"), TypeError),
        (lambda run: run.diff(10, -1), ValueError),
        (lambda run: run.load(-1), ValueError),
        (lambda run: run.gc(keep=0), ValueError),
    ],
)
def test_bad_arguments_are_refused(
    run_dir: Path, call: Callable[[cryosnap.Run], object], error: type[Exception]
) -> None:
    before = files_of(run_dir)
    with pytest.raises(error):
        call(cryosnap.Run(run_dir))
    assert files_of(run_dir) == before


def test_gc_keeps_the_newest(run_dir: Path) -> None:
    run = cryosnap.Run(run_dir)
    assert run.gc(keep=2, dry_run=True).removed == (10, 20)
    removal = run.gc(keep=2)
    assert removal.removed == (10, 20) and removal.kept == (30, 40)
    assert_same(STATES[40], run.load())


# ---------------------------------------------------------------------------------------------
# what is not a run


def test_a_missing_path_is_not_found_and_not_created(tmp_path: Path) -> None:
    with pytest.raises(cryosnap.CheckpointNotFoundError, match=r"no checkpoint at .*nope"):
        cryosnap.Run(tmp_path / "nope")
    assert not (tmp_path / "nope").exists()


def test_a_directory_that_is_not_a_run_is_refused_untouched(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="is not a cryosnap run") as info:
        cryosnap.Run(other)
    assert str(other) in str(info.value)
    assert files_of(other) == {"notes.txt": b"mine"}


def test_a_directory_holding_runs_names_them(tmp_path: Path) -> None:
    write_run(tmp_path / "persistent", [10])
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="holds the run"):
        cryosnap.Run(tmp_path)


def test_a_missing_memory_url_creates_nothing() -> None:
    url = f"memory://run-{uuid.uuid4().hex}"
    with pytest.raises(cryosnap.CheckpointNotFoundError, match=f"no checkpoint at {url}"):
        cryosnap.Run(url)
    assert not fsspec.filesystem("memory").exists(url)


def test_an_opened_run_without_versions_lists_none(tmp_path: Path) -> None:
    path = tmp_path / "run"
    cryosnap.Checkpointer(path).close()
    run = cryosnap.Run(path)
    assert run.steps() == [] and run.latest_step() is None and run.verify().ok
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="no committed version"):
        run.info()


# ---------------------------------------------------------------------------------------------
# every store of the conformance suite


def _memory(kind: str) -> Callable[[Path], Store]:
    def make(tmp_path: Path) -> Store:
        url = f"memory://run-{uuid.uuid4().hex}"
        if kind == "cas":
            return CasStore(url)
        store = FsspecStore(url)
        return TimeoutStore(store, 30) if kind == "timeout" else store

    return make


STORES: dict[str, Callable[[Path], Store]] = {
    "local": lambda tmp: LocalStore(tmp / "run"),
    "file-url": lambda tmp: FsspecStore(f"file://{tmp}/run"),
    "memory": _memory("plain"),
    "timeout-memory": _memory("timeout"),
    "cas-memory": _memory("cas"),
    "faulty-local": lambda tmp: FaultyStore(LocalStore(tmp / "run")),
}


@pytest.fixture(params=sorted(STORES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    yield STORES[request.param](tmp_path)
    fs = fsspec.filesystem("memory")
    for key in list(fs.store):
        if key.startswith("/run-"):
            fs.store.pop(key, None)


def test_run_over_every_store(store: Store) -> None:
    write_run(store, [10, 20])
    run = cryosnap.Run(store)
    assert run.steps() == [10, 20] and run.info().base_step == 10
    assert run.verify().ok
    assert {r.path for r in run.diff(10, 20).leaves} == {"a", "meta/step"}
    assert_same(STATES[20], run.load())
    with cryosnap.Checkpointer(store, keep=None), pytest.raises(cryosnap.RunLockedError):
        run.remove(10)
    assert run.remove(10).removed == (10,)
    assert run.steps() == [20]
    assert_same(STATES[20], run.load())
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="step 10 not found"):
        run.remove(10)


@pytest.mark.parametrize(
    "open_it",
    [
        lambda p: cryosnap.Checkpointer(p),
        lambda p: cryosnap.save(p, {"x": 1}, step=1),
        lambda p: cryosnap.load(p),
        lambda p: cryosnap.Run(p),
    ],
    ids=["Checkpointer", "save", "load", "Run"],
)
def test_a_run_path_that_is_a_file_says_so(tmp_path: Path, open_it: Callable[[Path], Any]) -> None:
    f = tmp_path / "f"
    f.write_text("mine")
    with pytest.raises(cryosnap.StorageError, match=f"^{f} is a regular file, not a run") as info:
        open_it(f)
    assert info.value.path == str(f)
    below = f / "run"
    with pytest.raises(cryosnap.StorageError, match=f"{f} is a regular file, not a directory"):
        open_it(below)
    assert f.read_text() == "mine"
