"""RunOptions alone (no I/O, frozen, idempotent) and open_run's rollback."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import cryosnap
from cryosnap._run.open import open_run
from cryosnap._run.options import RunOptions
from cryosnap.policy import KeepLast
from cryosnap.storage.striped import Tier


def test_options_validate_without_touching_storage(tmp_path: Path) -> None:
    options = RunOptions(path=tmp_path / "run", scratch=tmp_path / "s", keep=3)
    assert not (tmp_path / "run").exists() and not (tmp_path / "s").exists()
    assert isinstance(options.keep, KeepLast) and options.keep.n == 3
    assert options.retention is options.keep
    assert options.scratch == (Tier(tmp_path / "s"),) and options.keep_scratch == 2
    assert RunOptions(
        **{f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    ) == (options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.keep = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"chunk_bytes": 3}, ValueError, "chunk_bytes"),
        ({"staging_bytes": 4096, "chunk_bytes": 8192}, ValueError, "smaller than one chunk"),
        ({"keep_scratch": 1}, ValueError, "needs scratch="),
        ({"partner": True}, ValueError, "partner=True"),
        ({"comm": object()}, TypeError, "comm must be"),
        ({"run_id": "a b"}, ValueError, "run_id="),
        ({"device_diff": True, "incremental": False}, ValueError, "needs incremental=True"),
        ({"storage_options": []}, TypeError, "storage_options must be a dict"),
        ({"scratch": []}, ValueError, r"scratch=\[\] is invalid"),
    ],
)
def test_bad_options_say_which_argument(
    tmp_path: Path, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        RunOptions(path=tmp_path, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(error, match=match):
        cryosnap.Checkpointer(tmp_path, **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "writer.lock").exists()


def test_partner_needs_several_participants(tmp_path: Path) -> None:
    options = RunOptions(path=tmp_path, scratch=tmp_path / "s", partner=True)
    with pytest.raises(ValueError, match="several participants"):
        options.check_world(1)


def test_the_checkpointers_options_are_read_only(tmp_path: Path) -> None:
    with cryosnap.Checkpointer(tmp_path, keep=2, incremental=False) as ckpt:
        assert isinstance(ckpt.keep, KeepLast) and ckpt.keep.n == 2
        assert ckpt.options.keep is ckpt.keep
        assert ckpt.incremental is False and ckpt.chunk_bytes == 1 << 20
        for name in ("keep", "incremental", "chunk_bytes", "store", "coordinator"):
            with pytest.raises(AttributeError):
                setattr(ckpt, name, None)


def test_a_failed_open_releases_every_lock_it_took(tmp_path: Path) -> None:
    holder = cryosnap.Checkpointer(tmp_path / "scratch")  # holds the scratch device's lock
    try:
        with pytest.raises(cryosnap.RunLockedError):
            open_run(RunOptions(path=tmp_path / "run", scratch=tmp_path / "scratch"))
    finally:
        holder.close()
    # The persistent level's lock, taken first, was given back.
    run = open_run(RunOptions(path=tmp_path / "run"))
    run.writer.stop()
    run.levels.close_handoffs()
    run.levels.release_locks()
