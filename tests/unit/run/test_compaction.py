"""keep=K costs K versions (#28 item 6): small live remnants of older data files are copied
forward, so that retention can delete a file that a kept version would otherwise pin for a few
of its bytes. Sizes on disk are asserted, never timings; every kept version restores exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import cryosnap
from cryosnap.engine.write._compact import LIVE_FRACTION

KEEP = 3
VERSIONS = 12
DENSE = 64 * 1024  # float32 elements per dense leaf: 256 KiB
CHUNK = 64 * 1024
SLACK = 64 * 1024  # manifests, commit records, the lock: small beside the data


def _bytes_under(path: Path, sub: str = "") -> int:
    root = path / sub if sub else path
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def _state(step: int, rng_state: np.ndarray) -> dict[str, object]:
    """Dense training: every weight and moment changes, a small RNG state does not."""
    w = np.arange(DENSE, dtype=np.float32) + step
    return {"w": w, "m": w * 0.5, "v": w * 0.25, "rng": rng_state, "it": step}


def _save_versions(ckpt: cryosnap.Checkpointer, rng_state: np.ndarray) -> dict[int, object]:
    states: dict[int, object] = {}
    for step in range(VERSIONS):
        states[step] = _state(step, rng_state)
        ckpt.save(step, states[step]).result()
    return states


def _assert_restores(ckpt: cryosnap.Checkpointer, states: dict[int, object]) -> None:
    for step in ckpt.steps():
        got = ckpt.restore(step)
        want = states[step]
        assert isinstance(got, dict) and isinstance(want, dict)
        assert got.keys() == want.keys()
        for key, value in want.items():
            if isinstance(value, np.ndarray):
                assert got[key].dtype == value.dtype
                assert got[key].tobytes() == value.tobytes(), (step, key)
            else:
                assert got[key] == value


def test_keep_k_costs_k_versions_in_dense_training(tmp_path: Path) -> None:
    rng_state = np.random.default_rng(1).integers(0, 255, 5000, dtype=np.uint8)
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, keep=KEEP, full_every=16, chunk_bytes=CHUNK) as ckpt:
        infos = []
        states: dict[int, object] = {}
        for step in range(VERSIONS):
            states[step] = _state(step, rng_state)
            infos.append(ckpt.save(step, states[step]).result())
        ckpt.wait()  # retention's deletes run after a version is reported
        assert ckpt.steps() == list(range(VERSIONS - KEEP, VERSIONS))
        version = infos[-1].logical_bytes
        # Without compaction the first version's file stays for the RNG state's 5 KB.
        assert _bytes_under(run, "data") <= 1.1 * KEEP * version
        assert _bytes_under(run) <= 1.1 * KEEP * version + SLACK
        # The copy costs the remnant once per version: the RNG state, not a whole file.
        dense_bytes = 3 * DENSE * 4
        assert all(i.incremental for i in infos[1:])
        assert all(i.written_bytes <= dense_bytes + 2 * rng_state.nbytes for i in infos[1:])
        # Each kept version keeps alive only the file it wrote: nothing pinned.
        space = ckpt.status().space["persistent"]
        assert [v.step for v in space] == ckpt.steps()
        assert all(v.referenced_bytes == v.pinned_bytes == 0 for v in space)
        assert sum(v.owned_bytes for v in space) == _bytes_under(run, "data")
        _assert_restores(ckpt, states)
    # A reader of the run sees the same versions.
    assert cryosnap.load(run, step=VERSIONS - KEEP)["rng"].tobytes() == rng_state.tobytes()


def test_remnants_inside_a_blob_and_dedup_references_move_too(tmp_path: Path) -> None:
    """A chunk unchanged in the middle of a changing blob (inherited) and content found by
    hash in an older version (a reference) are moved; the blob reads back exactly."""
    run = tmp_path / "run"
    cb = 4096
    frozen = np.random.default_rng(2).integers(0, 255, cb, dtype=np.uint8)
    toggles = [np.full(cb, 7, np.uint8), np.full(cb, 9, np.uint8)]
    states: dict[int, object] = {}
    with cryosnap.Checkpointer(run, keep=2, full_every=16, chunk_bytes=cb) as ckpt:
        for step in range(10):
            big = np.full(64 * cb, step, np.uint8)
            big[5 * cb : 6 * cb] = frozen  # chunk 5 never changes
            states[step] = {"big": big, "toggle": toggles[step % 2], "x": step}
            ckpt.save(step, states[step]).result()
        ckpt.wait()
        version = 66 * cb
        assert _bytes_under(run, "data") <= 1.1 * 2 * version
        _assert_restores(ckpt, states)


def test_a_file_read_for_much_of_its_bytes_stays_referenced(tmp_path: Path) -> None:
    """Above LIVE_FRACTION the content is referenced, not copied: incremental as before."""
    run = tmp_path / "run"
    frozen = np.random.default_rng(3).standard_normal(DENSE, dtype=np.float32)
    with cryosnap.Checkpointer(run, keep=KEEP, full_every=16, chunk_bytes=CHUNK) as ckpt:
        infos = [
            ckpt.save(
                step, {"frozen": frozen, "w": np.arange(DENSE, dtype=np.float32) + step}
            ).result()
            for step in range(6)
        ]
        assert LIVE_FRACTION < 0.5  # the frozen half of the first file is live
        assert all(i.written_bytes == DENSE * 4 for i in infos[1:])
        got = ckpt.restore(3)
        assert got["frozen"].tobytes() == frozen.tobytes()


def test_keep_all_copies_nothing(tmp_path: Path) -> None:
    """Without retention no file is ever deleted: a copy would only cost."""
    rng_state = np.zeros(5000, np.uint8)
    with cryosnap.Checkpointer(tmp_path / "run", full_every=16, chunk_bytes=CHUNK) as ckpt:
        infos = [ckpt.save(s, _state(s, rng_state)).result() for s in range(4)]
        assert all(i.written_bytes == 3 * DENSE * 4 for i in infos[1:])


def test_scratch_and_persistent_both_keep_k_versions(tmp_path: Path) -> None:
    rng_state = np.random.default_rng(4).integers(0, 255, 5000, dtype=np.uint8)
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    with cryosnap.Checkpointer(
        run, scratch=scratch, keep=KEEP, keep_scratch=2, full_every=16, chunk_bytes=CHUNK
    ) as ckpt:
        states = _save_versions(ckpt, rng_state)
        ckpt.wait()
        version = 3 * DENSE * 4 + rng_state.nbytes
        assert _bytes_under(run, "data") <= 1.1 * KEEP * version
        assert _bytes_under(scratch, "data") <= 1.1 * 2 * version
        space = ckpt.status().space
        assert all(v.pinned_bytes == 0 for tier in space.values() for v in tier)
        _assert_restores(ckpt, states)
    # Every version kept on the persistent tier restores from it alone.
    for step in cryosnap.Run(run).steps():
        got = cryosnap.load(run, step=step)
        want = states[step]
        assert isinstance(want, dict)
        assert got["w"].tobytes() == want["w"].tobytes()  # type: ignore[union-attr]
        assert got["rng"].tobytes() == rng_state.tobytes()


def test_a_damaged_remnant_is_not_copied(tmp_path: Path) -> None:
    """A remnant that does not match its hash is left where it was (the version reads it
    there, as it would without compaction), never certified by a copy."""
    rng_state = np.random.default_rng(5).integers(0, 255, 5000, dtype=np.uint8)
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, keep=KEEP, full_every=16, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(0, _state(0, rng_state)).result()
        (first,) = (run / "data").iterdir()
        with open(first, "r+b") as f:  # the RNG state lies after the dense leaves
            f.seek(3 * DENSE * 4 + 10)
            f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
        info = ckpt.save(1, _state(1, rng_state)).result()
        assert info.written_bytes == 3 * DENSE * 4  # nothing copied
        space = {v.step: v for v in ckpt.status().space["persistent"]}
        assert space[1].referenced_bytes == first.stat().st_size
        with pytest.raises(cryosnap.IntegrityError):
            ckpt.restore(1)
