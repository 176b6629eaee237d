"""Forks that share storage: ``Run.fork`` (names the ancestor's data files on one file system,
copies only the chunks it reads elsewhere), the holds the ancestor's retention keeps, their
release, forks of forks, and references that were edited (docs/design/lineage.md, "Forks")."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import cryosnap
from cryosnap import engine
from cryosnap._format.forks import FORK_KEY, ForkRecord, Hold, hold_key
from cryosnap.errors import (
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
)
from cryosnap.storage import LocalStore

CHUNK = 64 << 10


def _state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    w = rng.standard_normal(400_000).astype(np.float32)
    w[: step * 1000] += step  # each step changes a few chunks
    return {
        "w": w,
        "t": torch.arange(50_000, dtype=torch.float64) * step,
        "small": {"b": np.full(7, step, np.int16), "s": f"step {step}", "f": 0.5 * step},
        "blob": bytes(range(256)) * 3,
        "step": step,
    }


def _save(path: Path, steps: range, *, keep: int | None = None) -> None:
    with cryosnap.Checkpointer(path, chunk_bytes=CHUNK, keep=keep) as ckpt:
        for s in steps:
            ckpt.save(s, _state(s)).result()


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def _bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _data_files(path: Path) -> set[str]:
    return {p.name for p in (path / "data").glob("*.dat")}


def test_a_fork_is_the_version_bit_for_bit_and_copies_no_data(tmp_path: Path) -> None:
    anc, dest = tmp_path / "anc", tmp_path / "fork"
    _save(anc, range(1, 5))
    before = {p: p.stat().st_mtime_ns for p in (anc / "data").iterdir()}
    fork = cryosnap.Run(anc).fork(3, dest)
    assert fork.steps() == [3]
    _same(cryosnap.load(dest), _state(3))
    assert not (dest / "data").exists()  # no data file: the ancestor's are named
    assert _bytes_under(dest) < 0.01 * cryosnap.Run(anc).summary(3).logical_bytes
    assert {p: p.stat().st_mtime_ns for p in (anc / "data").iterdir()} == before
    assert fork.verify().ok
    lineage = fork.lineage()
    assert (lineage.parent, lineage.step) == (os.path.realpath(anc), 3)
    assert cryosnap.Run(anc).lineage().forks == ((os.path.realpath(dest), lineage.parent, 3),)


def test_the_ancestors_retention_keeps_what_a_fork_reads(tmp_path: Path) -> None:
    anc, dest = tmp_path / "anc", tmp_path / "fork"
    _save(anc, range(1, 4))
    cryosnap.Run(anc).fork(2, dest)
    _save(anc, range(4, 9), keep=1)  # step 2 is long gone from the ancestor
    assert cryosnap.Run(anc).steps() == [8]
    _same(cryosnap.load(dest), _state(2))
    assert cryosnap.Run(dest).verify().ok
    cryosnap.Run(anc).gc(keep=1)
    _same(cryosnap.load(dest), _state(2))


def test_deleting_the_fork_releases_its_files(tmp_path: Path) -> None:
    anc, dest = tmp_path / "anc", tmp_path / "fork"
    _save(anc, range(1, 3))
    cryosnap.Run(anc).fork(2, dest)
    _save(anc, range(3, 6), keep=1)
    kept = {f"data/{n}" for n in _data_files(anc)}
    only_the_fork = kept - set(_record(anc, 5).data_files)
    assert only_the_fork  # step 2's file: version 5 rewrote every chunk of it that it had
    shutil.rmtree(dest)
    cryosnap.Run(anc).gc(keep=1)
    assert not (anc / "forks").exists() or not list((anc / "forks").iterdir())
    assert {f"data/{n}" for n in _data_files(anc)} == set(_record(anc, 5).data_files)


def test_a_fork_saves_incrementally_and_gives_the_hold_back_when_nothing_reads_it(
    tmp_path: Path,
) -> None:
    anc, dest = tmp_path / "anc", tmp_path / "fork"
    _save(anc, range(1, 3))
    cryosnap.Run(anc).fork(2, dest)
    with cryosnap.Checkpointer(dest, chunk_bytes=CHUNK, keep=1) as ckpt:
        state = ckpt.restore()
        assert state is not None
        state["w"][:10] = -1.0  # one chunk
        info = ckpt.save(3, state).result()
        assert info.incremental and info.written_bytes == CHUNK
        assert os.listdir(anc / "forks")  # version 3 still reads the ancestor's chunks
        other = {
            "w": state["w"] * 3,
            "t": state["t"] * 3,
            "small": {"b": state["small"]["b"] + 1, "s": "new", "f": 1.25},
            "blob": bytes(reversed(state["blob"])) + b"!",
            "step": 4,
        }
        ckpt.save(4, other).result()  # nothing of the ancestor's left; keep=1 drops step 3
    _same(cryosnap.load(dest), other)
    assert not any(f.startswith("ancestors/") for f in _record(dest, 4).data_files)
    (hold,) = (anc / "forks").iterdir()
    assert Hold.from_json(hold.read_bytes(), str(hold)).data_files == ()  # released
    _same(cryosnap.load(anc, step=2), _state(2))


def _record(path: Path, step: int) -> Any:
    return engine.read_commit(LocalStore(path), step)


def test_forks_of_forks_read_every_ancestor(tmp_path: Path) -> None:
    anc, f1, f2 = tmp_path / "anc", tmp_path / "f1", tmp_path / "f2"
    _save(anc, range(1, 3))
    cryosnap.Run(anc).fork(2, f1)
    with cryosnap.Checkpointer(f1, chunk_bytes=CHUNK) as ckpt:
        state = ckpt.restore()
        state["w"][-5:] = 7.0
        ckpt.save(3, state).result()
    fork = cryosnap.Run(f1).fork(3, f2)
    _same(cryosnap.load(f2), state)
    assert fork.lineage().ancestors == (os.path.realpath(f1), os.path.realpath(anc))
    files = _record(f2, 3).data_files
    assert {f.split("/")[1] for f in files} == {"0", "1"}  # f1's own file and anc's
    # Both ancestors keep what f2 reads: f1 and anc drop every version of theirs.
    shutil.rmtree(f1 / "versions")
    _save(anc, range(3, 6), keep=1)
    cryosnap.Run(anc).gc(keep=1)
    _same(cryosnap.load(f2), state)
    assert cryosnap.Run(f2).verify().ok


def test_a_fork_elsewhere_copies_only_what_the_version_reads(tmp_path: Path) -> None:
    anc = tmp_path / "anc"
    _save(anc, range(1, 6))  # incremental: the version reads 5 data files in part
    dest = f"memory://cryosnap-fork-test/{tmp_path.name}"
    fork = cryosnap.Run(anc).fork(5, dest)
    try:
        _same(cryosnap.load(dest), _state(5))
        summary = fork.summary(5)
        assert summary.data_files == 1 and fork.info(5).base_step is None  # full, its own
        read = engine.read_commit(LocalStore(anc), 5).data_files
        history = sum((anc / f).stat().st_size for f in read)
        assert summary.written_bytes <= summary.logical_bytes < history
        assert fork.lineage().ancestors == () and fork.lineage().step == 5
        assert fork.verify().ok
    finally:
        import fsspec

        fsspec.filesystem("memory").rm(f"/cryosnap-fork-test/{tmp_path.name}", recursive=True)


def test_bad_forks_are_refused_and_write_nothing(tmp_path: Path) -> None:
    anc = tmp_path / "anc"
    _save(anc, range(1, 3))
    run = cryosnap.Run(anc)
    with pytest.raises(CheckpointNotFoundError, match="step 9"):
        run.fork(9, tmp_path / "a")
    assert not (tmp_path / "a").exists() or not os.listdir(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointExistsError, match="not empty"):
        run.fork(1, tmp_path / "b")
    assert os.listdir(tmp_path / "b") == ["notes.txt"]
    run.fork(1, tmp_path / "c")
    with pytest.raises(CheckpointExistsError):
        run.fork(2, tmp_path / "c")  # a fork is a run: never overwritten
    assert not (anc / "forks").exists() or len(os.listdir(anc / "forks")) == 1


def _damaged() -> Any:
    """load() warns that it skips the (only) version, then raises."""
    return pytest.warns(RuntimeWarning, match="skipping damaged step")


def _edit_record(dest: Path, **fields: Any) -> None:
    """Rewrite the fork's ``FORK.json`` with ``fields`` changed, its checksum made valid (a
    checksum is no signature: anyone who edits a record can recompute it)."""
    doc = json.loads((dest / FORK_KEY).read_bytes())
    doc.pop("checksum")
    doc.update(fields)
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    doc["checksum"] = xxhash.xxh3_128_hexdigest(body)
    (dest / FORK_KEY).write_text(json.dumps(doc))


@pytest.mark.parametrize("target", ["other_run", "relative", "not_a_run", "etc"])
def test_an_edited_reference_is_refused_before_anything_is_read(
    tmp_path: Path, target: str
) -> None:
    anc, dest, other = tmp_path / "anc", tmp_path / "fork", tmp_path / "other"
    _save(anc, range(1, 3))
    _save(other, range(1, 3))  # the same steps and files' names: only the hold tells
    cryosnap.Run(anc).fork(2, dest)
    url = {
        "other_run": os.path.realpath(other),
        "relative": "../anc",
        "not_a_run": str(tmp_path),
        "etc": "/etc",
    }[target]
    _edit_record(dest, ancestors=[url], parent=url)
    with pytest.raises(CheckpointFormatError, match=r"FORK\.json.*(holds no record|absolute)"):
        cryosnap.load(dest, step=2)
    report = cryosnap.Run(dest).verify()
    assert not report.ok and "FORK.json" in report.versions[0].damage[0].error


def test_a_hold_naming_another_fork_is_refused(tmp_path: Path) -> None:
    anc, dest = tmp_path / "anc", tmp_path / "fork"
    _save(anc, range(1, 2))
    cryosnap.Run(anc).fork(1, dest)
    token = ForkRecord.from_json((dest / FORK_KEY).read_bytes(), "x").token
    key = anc / hold_key(token)
    hold = Hold.from_json(key.read_bytes(), "x")
    doc = json.loads(key.read_bytes())
    doc.pop("checksum")
    doc["fork"] = str(tmp_path / "elsewhere")
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    doc["checksum"] = xxhash.xxh3_128_hexdigest(body)
    key.write_text(json.dumps(doc))
    assert hold.fork == os.path.realpath(dest)
    with pytest.raises(CheckpointFormatError, match="names the fork"):
        cryosnap.load(dest, step=1)


def test_a_manifest_edited_to_name_another_ancestor_file_fails_its_hash(tmp_path: Path) -> None:
    anc, dest = tmp_path / "anc", tmp_path / "fork"
    _save(anc, range(1, 2))
    cryosnap.Run(anc).fork(1, dest)
    key = dest / "versions" / f"{1:012d}" / "rank-00000.json"
    doc = json.loads(key.read_bytes())
    doc["data_files"] = ["ancestors/0/data/000000000001-r00000-deadbeef.dat"]
    key.write_text(json.dumps(doc))
    with _damaged(), pytest.raises(IntegrityError, match="recorded hash"):
        cryosnap.load(dest)


def test_a_fork_of_a_fork_whose_chain_names_an_ancestor_it_no_longer_reads(
    tmp_path: Path,
) -> None:
    """f1's step 3 rewrites every chunk of the ancestor's, but its chain's older manifest still
    names the ancestor's files: a fork of it reads them as "no such file", never as an edited
    reference (examples/population_based_training.py found this)."""
    anc, f1, f2 = tmp_path / "anc", tmp_path / "f1", tmp_path / "f2"
    _save(anc, range(1, 2))
    cryosnap.Run(anc).fork(1, f1)
    with cryosnap.Checkpointer(f1, chunk_bytes=CHUNK) as ckpt:
        state = ckpt.restore()
        new = {
            "w": state["w"] + 1,
            "t": state["t"] + 1,
            "small": {"b": state["small"]["b"] + 1, "s": "other", "f": 9.0},
            "blob": b"other",
            "step": 3,
        }
        ckpt.save(3, new).result()
    assert _record(f1, 3).incremental
    assert not any(f.startswith("ancestors/") for f in _record(f1, 3).data_files)
    cryosnap.Run(f1).fork(3, f2)
    _same(cryosnap.load(f2), new)
    assert cryosnap.Run(f2).verify().ok


@pytest.mark.parametrize("at", ["forks/", "rank-", "COMMIT"])
def test_a_fork_that_fails_on_a_full_disk_takes_back_what_it_wrote(tmp_path: Path, at: str) -> None:
    from cryosnap.errors import StorageError
    from cryosnap.testing import FaultyStore

    anc, dest = tmp_path / "anc", tmp_path / "fork"
    _save(anc, range(1, 3))

    def full(op: str, key: str) -> None:
        if op == "write" and at in key:
            raise StorageError(f"writing {key}: [Errno 28] No space left on device")

    source = cryosnap.Run(FaultyStore(LocalStore(anc), fault=full))
    with pytest.raises(StorageError, match="No space left"):
        source.fork(2, FaultyStore(LocalStore(dest), fault=full))
    assert not (anc / "forks").exists() or not os.listdir(anc / "forks")
    assert not (dest / FORK_KEY).exists()
    assert not any(p.name.startswith("COMMIT") for p in dest.rglob("*"))
    cryosnap.Run(anc).fork(2, dest)  # room again: the same dest takes the fork
    _same(cryosnap.load(dest), _state(2))
