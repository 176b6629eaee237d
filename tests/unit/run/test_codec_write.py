"""Checkpointer(codec=) on the write path: a run without scratch, and the ranks' rewrite of
node-local scratch, store the persistent level's data files coded as the flush does (same
frames, same manifest fields); readers get the plain bytes back, incremental versions
de-duplicate against coded chunks, damage is found and named, "auto" codes only where the
level is slow, old readers refuse by version, and scratch and memory stay plain."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cryosnap
import cryosnap._run.redundancy.partner as _partner
from cryosnap import engine
from cryosnap._format import manifest as manifest_format
from cryosnap.dist import Coordinator
from cryosnap.errors import CheckpointFormatError, IntegrityError
from cryosnap.storage import LocalStore, read_index
from cryosnap.storage import _codec as store_codec

from ..distributed.test_coordinator import run_ranks
from ..support import assert_same, state_trees
from .test_codec import ThrottledStore, _floats, load_with_cryosnap_before_codecs

CHUNK = 4096


def _manifest(run: Path, step: int, rank: int = 0) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(
        (run / f"versions/{step:012d}/rank-{rank:05d}.json").read_bytes()
    )
    return doc


def _coded_files(run: Path, step: int, rank: int = 0) -> list[str]:
    doc = _manifest(run, step, rank)
    return [doc["data_files"][i] for i in doc.get("coded", [])]


def _plain_bytes(run: Path, key: str) -> int:
    return read_index(LocalStore(run), key).plain_size


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=state_trees())
def test_round_trip_without_scratch(state: Any) -> None:
    tree = {"tree": state, "floats": _floats(0, 3000), "zeros": np.zeros(2000, np.float64)}
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        mp.setattr(store_codec, "FRAME_BYTES", 5000)  # frames across chunks and blobs
        run = Path(d, "run")
        with cryosnap.Checkpointer(run, chunk_bytes=CHUNK, codec="zstd", allow_pickle=True) as c:
            info = c.save(3, tree).result()
            assert info.tiers == ("persistent",)
        doc = _manifest(run, 3)
        assert doc["format_version"] == 8 and doc["codec"] == "shuffle-zstd"
        coded = _coded_files(run, 3)
        assert coded and set(coded) == set(doc["data_files"])
        for key in coded:  # on disk: the frames, index and trailer
            assert read_index(LocalStore(run), key).stored_size == (run / key).stat().st_size
        assert_same(tree, cryosnap.load(run, step=3, allow_pickle=True))
        assert cryosnap.Run(run).verify().ok


def _two_versions(run: Path | Any, **options: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"w": _floats(1, 256 * 1024), "step": 1}
    with cryosnap.Checkpointer(run, chunk_bytes=CHUNK, **options) as ckpt:
        ckpt.save(1, state).result()
        state["w"][:10] += 1.0  # one chunk of 256 changes
        state["step"] = 2
        info = ckpt.save(2, state).result()
        assert info.incremental and info.written_bytes == CHUNK
    return state


def test_an_incremental_version_deduplicates_against_coded_chunks(tmp_path: Path) -> None:
    run = tmp_path / "run"
    state = _two_versions(run, codec="zstd")
    (first,), (own,) = _coded_files(run, 1), _coded_files(run, 2)
    # Version 2 inherits the unchanged chunks from version 1's coded file; its own coded file
    # holds the changed chunk (and the small leaves' pack) only.
    assert _manifest(run, 2)["base"]["step"] == 1 and own != first
    assert _plain_bytes(run, first) >= 256 * 1024 * 4
    assert _plain_bytes(run, own) <= 2 * CHUNK
    stored = (run / first).stat().st_size
    assert stored < 0.95 * _plain_bytes(run, first)  # compressed: these floats shrink ~1.2x
    assert_same(state, cryosnap.load(run, step=2))
    assert cryosnap.load(run, step=1)["step"] == 1
    assert cryosnap.Run(run).verify().ok


def test_a_reopened_run_builds_on_its_coded_versions(tmp_path: Path) -> None:
    """A new session's first version is incremental against the coded chain it finds, and one
    without the codec writes its own file plain, naming the older ones coded."""
    run = tmp_path / "run"
    state = _two_versions(run, codec="zstd")
    with cryosnap.Checkpointer(run, chunk_bytes=CHUNK) as ckpt:
        assert ckpt.restore(step=2)["step"] == 2
        state["w"][5000:5010] -= 1.0
        state["step"] = 3
        info = ckpt.save(3, state).result()
        assert info.incremental and info.written_bytes == CHUNK
    assert not _coded_files(run, 3) and _manifest(run, 3)["base"]["step"] == 2
    assert _manifest(run, 3)["format_version"] < 8
    assert_same(state, cryosnap.load(run, step=3))
    assert cryosnap.Run(run).verify().ok


def test_damage_in_a_coded_frame_is_found_and_named(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _two_versions(run, codec="zstd")
    (key,) = _coded_files(run, 1)
    raw = bytearray((run / key).read_bytes())
    raw[len(raw) // 3] ^= 0x01  # inside the first frame's zstd bytes
    (run / key).write_bytes(bytes(raw))
    report = cryosnap.Run(run).verify()
    assert not report.ok
    assert {v.step for v in report.versions if v.damage} == {1, 2}
    with pytest.raises(IntegrityError, match=rf"{key.split('/')[1]}.*frame 0 is damaged"):
        cryosnap.load(run, step=1)


def test_a_reader_without_codecs_refuses_by_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    _two_versions(run, codec="zstd")
    monkeypatch.setattr(manifest_format, "_MANIFEST_VERSIONS", tuple(range(1, 7)))
    with pytest.raises(CheckpointFormatError, match="format_version 8 is not supported"):
        cryosnap.load(run, step=2)


@pytest.mark.timeout(120)
def test_a_cryosnap_from_before_codecs_refuses_a_run_written_without_scratch(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    _two_versions(run, codec="zstd")
    proc = load_with_cryosnap_before_codecs(tmp_path, run, 2)
    assert proc.returncode != 0
    assert "format_version 8 is not supported by this cryosnap" in proc.stderr


def test_compaction_copies_remnants_out_of_coded_files(tmp_path: Path) -> None:
    """keep= copies a small live remnant of an old file forward (engine/write/_compact.py):
    read through the codec, so the old coded file is retired, and every kept version
    restores."""
    run = tmp_path / "run"
    rng = np.random.default_rng(1).integers(0, 255, 5000, dtype=np.uint8)
    states: dict[int, dict[str, Any]] = {}
    with cryosnap.Checkpointer(run, keep=2, chunk_bytes=CHUNK, codec="zstd") as ckpt:
        for step in range(5):
            w = _floats(10 + step, 64 * 1024)  # every chunk changes, the RNG state does not
            states[step] = {"w": w, "m": w * 0.5, "rng": rng, "it": step}
            ckpt.save(step, states[step]).result()
            files = {*_coded_files(run, step)}
            if step == 0:
                (first,) = files
        assert ckpt.steps() == [3, 4]
        for step in (3, 4):
            assert_same(states[step], ckpt.restore(step))
    assert not (run / first).exists()  # its remnant (the RNG state) was copied forward
    record = engine.read_commit(LocalStore(run), 4)
    assert set(record.data_files) <= {*_coded_files(run, 3), *_coded_files(run, 4)}


# -- "auto" ----------------------------------------------------------------------------------


def _auto_run(path: str | Any, n: int = 256 * 1024) -> Any:
    state = {"w": _floats(3, n)}
    with cryosnap.Checkpointer(path, codec="auto", incremental=False) as ckpt:
        for step in (1, 2, 3):
            state["w"] = _floats(step, n)
            ckpt.save(step, state).result()
        codec = ckpt._levels.levels[-1].codec
        assert codec is not None
        return codec.snapshot()


FAST_LEVEL_FLOATS = 4 << 20


def test_auto_leaves_a_fast_level_plain() -> None:
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as d:
        # 16 MiB a version: a write of a few milliseconds, which a loaded machine's scheduling
        # cannot slow to below the codec's gain (a 1 MiB write once measured slower than it).
        rates = _auto_run(f"{d}/run", FAST_LEVEL_FLOATS)
        assert (rates.coded_files, rates.plain_files) == (0, 3)
        assert rates.codec_bytes_per_s is not None  # calibrated on the first file's writes
        assert not any(_coded_files(Path(d, "run"), s) for s in (1, 2, 3))


def test_auto_codes_for_a_slow_level(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    rates = _auto_run(ThrottledStore(LocalStore(tmp_path / "run"), 2e6))  # 2 MB/s
    # The first version is written plain while the level's rate is measured and the codec
    # calibrated on its bytes (on the writer's I/O thread); the next ones are coded.
    assert (rates.coded_files, rates.plain_files) == (2, 1)
    assert [bool(_coded_files(tmp_path / "run", s)) for s in (1, 2, 3)] == [False, True, True]
    assert rates.ratio is not None and rates.ratio > 1.05
    np.testing.assert_array_equal(cryosnap.load(tmp_path / "run")["w"], _floats(3, 256 * 1024))


# -- several ranks -----------------------------------------------------------------------------

_NODE = threading.local()


def _rank_state(rank: int, step: int) -> dict[str, Any]:
    model = _floats(7, 96 << 10)
    model[: 4096 * (step % 3)] += step  # the same sparse change on every rank
    return {"model": model, "own": _floats(100 + rank * 10 + step, 8192), "step": step}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in ("model", "own")) and a["step"] == b["step"]


def _ranks_save(run: Path, world: int, **options: Any) -> None:
    def body(c: Coordinator) -> None:
        _NODE.name = f"n{c.rank}"
        with cryosnap.Checkpointer(run, comm=c, chunk_bytes=CHUNK, **options) as ckpt:
            for step in (1, 2):
                ckpt.save(step, _rank_state(c.rank, step), replicated=["model"]).result()

    run_ranks(world, body)


def _check_ranks(run: Path, world: int) -> None:
    """Every rank's manifest names coded every data file it reads that is coded, the other
    ranks' shares of the replicated model included; every part loads."""
    store = LocalStore(run)
    for step in (1, 2):
        record = engine.read_commit(store, step)
        everything = set(record.data_files)
        assert everything and all(read_index(store, k) for k in everything)  # all coded
        for rank in range(world):
            doc = _manifest(run, step, rank)
            assert set(_coded_files(run, step, rank)) == set(doc["data_files"]), (step, rank)
            assert _same(cryosnap.load(run, step=step, rank=rank), _rank_state(rank, step))
    assert cryosnap.Run(run).verify().ok


def test_ranks_without_scratch_name_each_others_coded_shares(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _ranks_save(run, 2, codec="zstd")
    # The model is written once in all, half by each rank: each manifest names its own file
    # and the other's (that rank's share of the model), both coded.
    zero, one = set(_coded_files(run, 1, 0)), set(_coded_files(run, 1, 1))
    assert len(zero) == 2 and zero == one
    _check_ranks(run, 2)


def test_node_local_scratch_rewritten_coded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank's scratch (its node's) stays plain; the ranks write the persistent level
    again (writer.Rewriter), coded; a rank without its scratch reads it from there."""
    monkeypatch.setattr(_partner, "node_name", lambda: _NODE.name)
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    _ranks_save(run, 2, codec="zstd", scratch=scratch)
    for rank in (0, 1):
        own = scratch / f"rank-{rank:05d}"
        assert not _coded_files(own, 2) and _manifest(own, 2)["format_version"] < 8
    _check_ranks(run, 2)
    shutil.rmtree(scratch)

    def restore(c: Coordinator) -> Any:
        _NODE.name = f"n{c.rank}"
        with cryosnap.Checkpointer(run, scratch=scratch, comm=c, codec="zstd") as ckpt:
            return ckpt.restore(), ckpt.restored_from

    for rank, (got, where) in enumerate(run_ranks(2, restore)):
        assert _same(got, _rank_state(rank, 2)) and where == "persistent"


def test_memory_without_scratch_refuses_a_codec(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the memory level copies the first level"):
        cryosnap.Checkpointer(tmp_path / "a", codec="auto", memory="64MiB")
    assert not (tmp_path / "a").exists()
