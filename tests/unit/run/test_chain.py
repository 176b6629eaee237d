"""ChainIndex alone: what the next version builds on, when it is full, and what it forgets."""

from __future__ import annotations

from pathlib import Path

import pytest

from cryosnap._run.chain import ChainIndex
from cryosnap.errors import CheckpointError
from cryosnap.storage import LocalStore

from .rooms import chain, job, level, state, version_writer


def _run(path: Path, steps: list[int], *, full_every: int = 16) -> tuple[LocalStore, ChainIndex]:
    store = LocalStore(path)
    idx = chain(full_every=full_every)
    writer = version_writer(level(store), chain_index=idx)
    for step in steps:
        _info, part = writer.write(job(step, state(step)))
        idx.advance(part)
    return store, idx


def test_the_first_version_of_an_empty_run_is_full(tmp_path: Path) -> None:
    assert chain().base_for_next(LocalStore(tmp_path)) is None


def test_the_next_version_builds_on_the_last_committed(tmp_path: Path) -> None:
    store, idx = _run(tmp_path, [1, 2])
    base = idx.base_for_next(store)
    assert base is not None and base.manifest.step == 2
    assert idx.index


def test_full_every_bounds_the_chain(tmp_path: Path) -> None:
    store, idx = _run(tmp_path, [1, 2], full_every=1)
    assert idx.base_for_next(store) is None


def test_a_new_session_continues_from_the_runs_newest_version(tmp_path: Path) -> None:
    store, _ = _run(tmp_path, [1, 2, 3])
    base = chain().base_for_next(store)
    assert base is not None and base.manifest.step == 3


def test_restart_from_builds_on_the_step_a_restore_rewound_to(tmp_path: Path) -> None:
    store, idx = _run(tmp_path, [1, 2, 3])
    idx.restart_from(1)
    base = idx.base_for_next(store)
    assert base is not None and base.manifest.step == 1


def test_request_full_and_full_make_the_next_version_full(tmp_path: Path) -> None:
    store, idx = _run(tmp_path, [1])
    assert idx.base_for_next(store, full=True) is None
    idx.request_full()
    assert idx.base_for_next(store) is None


def test_an_exact_base_that_is_not_the_chains_is_refused(tmp_path: Path) -> None:
    store, idx = _run(tmp_path, [1, 2])
    with pytest.raises(CheckpointError, match="not the base of this version"):
        idx.base_for_next(store, exact=1)


def test_forget_files_drops_their_chunks_from_the_index(tmp_path: Path) -> None:
    _store, idx = _run(tmp_path, [1])
    files = {loc[0] for loc in idx.index.values()}
    assert files
    idx.forget_files(files)
    assert idx.index == {}
