"""Run identity: ``Checkpointer(run_id=...)`` records which training saved each version, refuses
to open a run whose newest version another training saved, and ``run_id_of`` reads it back.

The commit record's ``run_id`` field is optional and validated on read; records without it
(every run written before it existed) stay valid.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap._format.commit import CommitRecord
from cryosnap._format.keys import commit_key
from cryosnap.checkpointer import run_id_of
from cryosnap.errors import CheckpointError, CheckpointFormatError, CheckpointNotFoundError
from cryosnap.storage import open_store

from ..support import commit_checksum

STATE = {"w": np.arange(8, dtype=np.float32)}


def _commit_doc(run: Path, step: int) -> dict[str, object]:
    doc: dict[str, object] = json.loads((run / commit_key(step)).read_bytes())
    return doc


def _rewrite_commit(run: Path, step: int, **fields: object) -> None:
    doc = _commit_doc(run, step)
    doc.pop("checksum")
    doc.update(fields)
    doc = {k: v for k, v in doc.items() if v is not None}
    doc["checksum"] = commit_checksum(doc)
    (run / commit_key(step)).write_text(json.dumps(doc))


def test_run_id_is_recorded_with_each_version_and_read_back(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, run_id="train-a") as ckpt:
        assert ckpt.run_id == "train-a"
        ckpt.save(1, STATE)
        ckpt.save(2, STATE)
    for step in (1, 2):
        assert _commit_doc(run, step)["run_id"] == "train-a"
    assert run_id_of(run) == "train-a"
    assert run_id_of(open_store(run)) == "train-a"
    # Resuming with the same id continues the run.
    with cryosnap.Checkpointer(run, run_id=run_id_of(run)) as ckpt:
        ckpt.save(3, STATE)
    assert cryosnap.load(run, step=3)["w"].tolist() == STATE["w"].tolist()


def test_without_run_id_nothing_is_written_or_checked(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run) as ckpt:
        assert ckpt.run_id is None
        ckpt.save(1, STATE)
    assert "run_id" not in _commit_doc(run, 1)
    assert run_id_of(run) is None
    with cryosnap.Checkpointer(run) as ckpt:
        ckpt.save(2, STATE)
    assert run_id_of(run) is None


def test_only_the_newest_version_is_checked(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, run_id="a") as ckpt:
        ckpt.save(1, STATE)
    with cryosnap.Checkpointer(run) as ckpt:  # no run_id: no check, a version without one
        ckpt.save(2, STATE)
    with pytest.raises(CheckpointError, match=r"step 2.*no run id"):
        cryosnap.Checkpointer(run, run_id="a")  # step 1 was "a"'s, step 2 is not
    with cryosnap.Checkpointer(run) as ckpt:
        assert ckpt.steps() == [1, 2]


def test_another_training_is_refused_naming_both_ids(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, run_id="first") as ckpt:
        ckpt.save(10, STATE)
    with pytest.raises(CheckpointError, match=r"step 10.*'first'.*run_id='second'.*new path"):
        cryosnap.Checkpointer(run, run_id="second")
    # The refused open left the run usable: its lock was released, nothing was written.
    with cryosnap.Checkpointer(run, run_id="first") as ckpt:
        assert ckpt.steps() == [10]


def test_versions_without_a_run_id_are_another_training(tmp_path: Path) -> None:
    run = tmp_path / "run"
    cryosnap.save(run, STATE, step=4)
    with pytest.raises(CheckpointError, match=r"no run id.*without run_id"):
        cryosnap.Checkpointer(run, run_id="mine")


def test_the_newest_version_on_scratch_counts(tmp_path: Path) -> None:
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    with cryosnap.Checkpointer(run, scratch=scratch, run_id="a") as ckpt:
        ckpt.save(1, STATE)
    # Scratch holds a newer version of another training, not flushed to the run.
    with cryosnap.Checkpointer(scratch) as ckpt:
        ckpt.save(2, STATE)
    assert run_id_of(run) == "a"
    with pytest.raises(CheckpointError, match=r"step 2.*no run id"):
        cryosnap.Checkpointer(run, scratch=scratch, run_id="a")


def test_run_id_is_validated(tmp_path: Path) -> None:
    for bad in ("", "a b", "x" * 129, "../up", "é"):
        with pytest.raises(ValueError, match="run_id="):
            cryosnap.Checkpointer(tmp_path / "run", run_id=bad)
    with pytest.raises(TypeError, match="run_id must be a str"):
        cryosnap.Checkpointer(tmp_path / "run", run_id=7)  # type: ignore[arg-type]
    with cryosnap.Checkpointer(tmp_path / "run", run_id="A-z_0.9:" + "x" * 120) as ckpt:
        assert len(ckpt.run_id or "") == 128


def test_run_id_of_an_empty_run_raises(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="holds no version"):
        run_id_of(tmp_path / "nothing")


def test_a_malformed_run_id_in_a_commit_record_is_a_format_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, run_id="ok") as ckpt:
        ckpt.save(1, STATE)
    data = (run / commit_key(1)).read_bytes()
    assert CommitRecord.from_json(data, "x").run_id == "ok"
    for bad in (5, "", "a/b", ["ok"]):
        _rewrite_commit(run, 1, run_id=bad)
        with pytest.raises(CheckpointFormatError, match="malformed run_id"):
            CommitRecord.from_json((run / commit_key(1)).read_bytes(), "x")
    # Removing the field gives a valid record of the older kind.
    _rewrite_commit(run, 1, run_id=None)
    assert CommitRecord.from_json((run / commit_key(1)).read_bytes(), "x").run_id is None
    assert cryosnap.load(run)["w"].tolist() == STATE["w"].tolist()


def test_run_id_survives_the_flush_to_the_persistent_tier(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, scratch=tmp_path / "scratch", run_id="flushed") as ckpt:
        ckpt.save(3, STATE).result()
    assert _commit_doc(run, 3)["run_id"] == "flushed"
