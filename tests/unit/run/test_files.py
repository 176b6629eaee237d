"""``cryosnap.File`` leaves through whole runs: one-shot and managed round trips (Hypothesis over
contents and sizes), incremental versions, eager and lazy capture, ``restore(into=)`` at other
paths, atomic failure (a corrupt chunk, a refused ``load_state_dict``), scratch and persistent
levels, and two ranks (threads) with their own files, a replicated one and partner copies.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cryosnap
import cryosnap._run.redundancy.partner as _partner
from cryosnap._format.keys import commit_key, manifest_key
from cryosnap._format.manifest import FILES_FORMAT_VERSION
from cryosnap.dist import Coordinator
from cryosnap.errors import (
    FileLeafError,
    IntegrityError,
    ReplicaDivergenceError,
    StateMismatchError,
)

from ..distributed.test_coordinator import run_ranks

CHUNK = 4096


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@settings(max_examples=25)
@given(
    contents=st.lists(
        st.one_of(
            st.binary(max_size=64),
            st.integers(0, 5 * CHUNK + 7).map(lambda n: np.random.default_rng(n).bytes(n)),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_round_trip_of_file_contents_and_sizes(contents: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        files = {
            f"v{i}": cryosnap.File(_write(root / f"v{i}.dat", c)) for i, c in enumerate(contents)
        }
        info = cryosnap.save(root / "run", {"files": files, "it": 1}, chunk_bytes=CHUNK)
        assert info.logical_bytes == sum(map(len, contents))
        loaded = cryosnap.load(root / "run")
        assert loaded["it"] == 1 and list(loaded["files"]) == list(files)
        for name, f in loaded["files"].items():
            assert isinstance(f, cryosnap.File)
            assert f.path == str(root / f"{name}.dat")
            assert f.read_bytes() == contents[int(name[1:])] and f.size == len(f.read_bytes())
        into = {"files": {k: cryosnap.File(root / f"{k}.restored") for k in files}, "it": 0}
        with cryosnap.Checkpointer(root / "run") as ckpt:
            ckpt.restore(into=into)
        for i, c in enumerate(contents):
            assert (root / f"v{i}.restored").read_bytes() == c


def test_manifest_of_files_says_format_version_3_others_stay(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    src = _write(tmp_path / "f", b"x" * 10)
    small = {"a": torch.arange(3), "b": torch.ones(2)}  # packed: files and packs say 3
    with cryosnap.Checkpointer(tmp_path / "run", stats=False) as ckpt:  # float stats say 6
        ckpt.save(1, {"f": cryosnap.File(src), "t": small}).result()
        ckpt.save(2, {"x": np.zeros(100_000)}).result()  # alone: stays 1
    versions = [
        json.loads((tmp_path / "run" / manifest_key(step, 0)).read_bytes())["format_version"]
        for step in (1, 2)
    ]
    assert versions == [FILES_FORMAT_VERSION, 1]
    loaded = cryosnap.load(tmp_path / "run", step=1)
    assert loaded["f"].read_bytes() == b"x" * 10 and torch.equal(loaded["t"]["a"], small["a"])


def test_an_unchanged_file_costs_nothing_a_100_byte_change_one_chunk(tmp_path: Path) -> None:
    data = bytearray(np.random.default_rng(1).bytes(10 * CHUNK))
    src = _write(tmp_path / "grid.h5", bytes(data))
    with cryosnap.Checkpointer(tmp_path / "run", chunk_bytes=CHUNK) as ckpt:
        first = ckpt.save(1, {"grid": cryosnap.File(src)}).result()
        same = ckpt.save(2, {"grid": cryosnap.File(src)}).result()
        data[5000:5100] = bytes(100)
        src.write_bytes(bytes(data))
        changed = ckpt.save(3, {"grid": cryosnap.File(src)}).result()
        restored = ckpt.restore(step=3)["grid"].read_bytes()
    assert first.written_bytes == 10 * CHUNK and first.new_chunks == 10
    assert same.written_bytes == 0 and same.new_chunks == 0
    assert changed.written_bytes == CHUNK and changed.new_chunks == 1
    assert restored == bytes(data)


def test_eager_save_has_read_the_file_when_it_returns(tmp_path: Path) -> None:
    src = _write(tmp_path / "f", b"a" * 3 * CHUNK)
    with cryosnap.Checkpointer(tmp_path / "run", chunk_bytes=CHUNK) as ckpt:
        pending = ckpt.save(1, {"f": cryosnap.File(src)})
        # Truncated and rewritten before the version is written: the save read it already.
        src.write_bytes(b"b")
        pending.result()
        assert ckpt.restore()["f"].read_bytes() == b"a" * 3 * CHUNK


def test_lazy_save_reads_the_file_in_the_background(tmp_path: Path) -> None:
    src = _write(tmp_path / "f", np.random.default_rng(2).bytes(6 * CHUNK))
    before = src.read_bytes()
    with cryosnap.Checkpointer(tmp_path / "run", chunk_bytes=CHUNK) as ckpt:
        pending = ckpt.save(1, {"f": cryosnap.File(src), "step": 1}, lazy=True)
        pending.wait_captured()
        src.write_bytes(b"next iteration")
        assert pending.result().logical_bytes == 6 * CHUNK
        assert ckpt.restore()["f"].read_bytes() == before


def test_a_file_larger_than_the_staging_budget_streams_through_it(tmp_path: Path) -> None:
    data = np.random.default_rng(6).bytes(12 * CHUNK + 5)
    src = _write(tmp_path / "big", data)
    with cryosnap.Checkpointer(
        tmp_path / "run", chunk_bytes=CHUNK, staging_bytes=8 * CHUNK
    ) as ckpt:
        for lazy in (False, True):
            pending = ckpt.save(int(lazy), {"f": cryosnap.File(src), "lazy": lazy}, lazy=lazy)
            assert pending.result().logical_bytes == len(data)
        assert ckpt.restore(step=1)["f"].read_bytes() == data


def test_restore_into_writes_at_into_paths_not_the_saved_ones(tmp_path: Path) -> None:
    src = _write(tmp_path / "out.nc", b"saved content")
    other = tmp_path / "node-2"
    other.mkdir()
    _write(other / "out.nc", b"stale")
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(1, {"f": cryosnap.File(src), "n": 1}).result()
        src.write_bytes(b"changed since")
        into = {"f": cryosnap.File(other / "out.nc"), "n": 0}
        restored = ckpt.restore(into=into)
    assert restored["f"] is into["f"] and restored["n"] == 1
    assert (other / "out.nc").read_bytes() == b"saved content"
    assert src.read_bytes() == b"changed since"  # the saved path is left alone
    assert _files_in(other) == ["out.nc"]  # no temporary file left


def _flip_one_byte_of_the_data(run: Path) -> None:
    (data_file,) = (run / "data").iterdir()
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) - 10] ^= 0xFF  # in the last leaf's chunks
    data_file.write_bytes(bytes(raw))


def test_a_corrupt_chunk_leaves_every_target_file_as_it_was(tmp_path: Path) -> None:
    sources = [
        _write(tmp_path / f"s{i}", np.random.default_rng(i).bytes(2 * CHUNK)) for i in range(3)
    ]
    cryosnap.save(tmp_path / "run", {f"f{i}": cryosnap.File(s) for i, s in enumerate(sources)})
    _flip_one_byte_of_the_data(tmp_path / "run")
    targets = tmp_path / "targets"
    targets.mkdir()
    _write(targets / "t0", b"keep 0")
    _write(targets / "t1", b"keep 1")  # t2 does not exist and must not appear
    into = {f"f{i}": cryosnap.File(targets / f"t{i}") for i in range(3)}
    with (
        cryosnap.Checkpointer(tmp_path / "run") as ckpt,
        pytest.raises(IntegrityError, match="f2"),
    ):
        ckpt.restore(step=0, into=into)
    assert _files_in(targets) == ["t0", "t1"]
    assert (targets / "t0").read_bytes() == b"keep 0" and (targets / "t1").read_bytes() == b"keep 1"


class _Refuses:
    """A stateful object whose load_state_dict refuses what was saved."""

    def state_dict(self) -> dict[str, int]:
        return {"a": 1}

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise ValueError("not today")


def test_a_refused_load_state_dict_leaves_the_target_files_as_they_were(tmp_path: Path) -> None:
    src = _write(tmp_path / "s", b"new")
    target = _write(tmp_path / "t", b"old")
    cryosnap.save(tmp_path / "run", {"f": cryosnap.File(src), "obj": _Refuses()})
    with pytest.raises(StateMismatchError, match="refused it: not today"):
        cryosnap.load(tmp_path / "run", into={"f": cryosnap.File(target), "obj": _Refuses()})
    assert target.read_bytes() == b"old" and _files_in(tmp_path) == ["run", "s", "t"]


def test_a_bad_file_fails_the_save_and_the_run_goes_on(tmp_path: Path) -> None:
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        with pytest.raises(FileLeafError, match=r"cannot checkpoint out/grid: .*no such file"):
            ckpt.save(1, {"out": {"grid": cryosnap.File(tmp_path / "missing.h5")}})
        with pytest.raises(FileLeafError, match="a directory"):
            ckpt.save(1, {"d": cryosnap.File(tmp_path)}, lazy=True)
        assert ckpt.steps() == []
        src = _write(tmp_path / "there", b"ok")
        ckpt.save(1, {"out": {"grid": cryosnap.File(src)}}).result()
        assert ckpt.steps() == [1]
    with pytest.raises(FileLeafError, match="no such file"):
        cryosnap.save(tmp_path / "one-shot", {"g": cryosnap.File(tmp_path / "missing.h5")})


def test_a_loaded_state_saves_again_and_costs_nothing(tmp_path: Path) -> None:
    src = _write(tmp_path / "f", np.random.default_rng(3).bytes(3 * CHUNK))
    with cryosnap.Checkpointer(tmp_path / "run", chunk_bytes=CHUNK) as ckpt:
        ckpt.save(1, {"f": cryosnap.File(src)}).result()
        src.unlink()
        again = ckpt.save(2, ckpt.restore()).result()
        assert again.written_bytes == 0
        assert ckpt.restore(step=2)["f"].path == str(src)


def test_files_reach_scratch_and_persistent_and_restore_from_either(tmp_path: Path) -> None:
    src = _write(tmp_path / "f", np.random.default_rng(4).bytes(2 * CHUNK + 1))
    run, scratch = tmp_path / "persistent", tmp_path / "scratch"
    with cryosnap.Checkpointer(run, scratch=scratch, chunk_bytes=CHUNK) as ckpt:
        assert ckpt.save(1, {"f": cryosnap.File(src)}).result().tiers == ("scratch", "persistent")
    for level in (scratch, run):
        assert cryosnap.Run(level).verify().ok
    assert cryosnap.load(run)["f"].read_bytes() == src.read_bytes()
    shutil.rmtree(scratch)  # the node's scratch is gone: the persistent level has it all
    with cryosnap.Checkpointer(run, scratch=scratch) as ckpt:
        ckpt.restore(into={"f": cryosnap.File(tmp_path / "back")})
    assert (tmp_path / "back").read_bytes() == src.read_bytes()


_NODE = threading.local()


def test_two_ranks_with_own_files_a_replicated_one_and_partner_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_partner, "node_name", lambda: _NODE.name)
    run = tmp_path / "run"
    mesh = np.random.default_rng(5).bytes(3 * CHUNK)
    # The replicated file: the same bytes, read by each rank from a path of its own.
    shared = [_write(tmp_path / f"mesh{r}.bin", mesh) for r in (0, 1)]
    own = [
        _write(tmp_path / f"rank{r}.h5", np.random.default_rng(10 + r).bytes(CHUNK + r))
        for r in (0, 1)
    ]

    def node(rank: int) -> Path:
        return tmp_path / f"node-{rank}"

    def state(rank: int) -> dict[str, Any]:
        return {"mesh": cryosnap.File(shared[rank]), "own": {"h5": cryosnap.File(own[rank])}}

    def save(c: Coordinator) -> None:
        _NODE.name = f"n{c.rank}"
        with cryosnap.Checkpointer(
            run, scratch=node(c.rank), comm=c, partner=True, chunk_bytes=CHUNK
        ) as ckpt:
            ckpt.save(1, state(c.rank), replicated=["mesh"]).result()

    run_ranks(2, save)
    # Node 0 loses its scratch and the persistent level the version's commit record (not
    # flushed yet, say): rank 0's part comes back from its partner's copy on node 1.
    shutil.rmtree(node(0))
    (run / commit_key(1)).unlink()

    def restore(c: Coordinator) -> None:
        _NODE.name = f"n{c.rank}"
        into = {
            "mesh": cryosnap.File(node(c.rank) / "mesh.bin"),
            "own": {"h5": cryosnap.File(node(c.rank) / "own.h5")},
        }
        with cryosnap.Checkpointer(run, scratch=node(c.rank), comm=c, partner=True) as ckpt:
            ckpt.restore(into=into)

    run_ranks(2, restore)
    for rank in (0, 1):
        assert (node(rank) / "mesh.bin").read_bytes() == mesh
        assert (node(rank) / "own.h5").read_bytes() == own[rank].read_bytes()


def test_export_writes_a_file_as_its_bytes(tmp_path: Path) -> None:
    from cryosnap.export import export

    src = _write(tmp_path / "f", b"\x00\x01binary")
    cryosnap.save(tmp_path / "run", {"f": cryosnap.File(src), "w": np.ones(2)})
    export(tmp_path / "run", tmp_path / "out.npz")
    with np.load(tmp_path / "out.npz") as npz:
        assert npz["f"].dtype == np.uint8 and npz["f"].tobytes() == b"\x00\x01binary"
    assert os.path.getsize(tmp_path / "out.npz") > 0


def test_a_replicated_file_that_differs_between_ranks_is_refused(tmp_path: Path) -> None:
    files = [_write(tmp_path / f"m{r}", bytes([r]) * CHUNK) for r in (0, 1)]

    def save(c: Coordinator) -> None:
        with cryosnap.Checkpointer(tmp_path / "run", comm=c, chunk_bytes=CHUNK) as ckpt:
            pending = ckpt.save(1, {"mesh": cryosnap.File(files[c.rank])}, replicated=True)
            with pytest.raises(ReplicaDivergenceError, match="mesh"):
                pending.result()
            assert ckpt.steps() == []

    run_ranks(2, save)


def test_inspect_diff_and_keys_see_a_file_leaf(tmp_path: Path) -> None:
    src = _write(tmp_path / "grid.h5", bytes(5 * CHUNK))
    run = tmp_path / "run"
    with cryosnap.Checkpointer(run, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(1, {"grid": cryosnap.File(src), "it": 1}).result()
        src.write_bytes(bytes(4 * CHUNK) + b"\x01" * CHUNK)
        ckpt.save(2, {"grid": cryosnap.File(src), "it": 2}).result()
    (leaf, _it) = cryosnap.Run(run).info(2).leaves
    assert (leaf.path, leaf.kind, leaf.shape, leaf.nbytes, leaf.chunks) == (
        "grid",
        "file",
        [5 * CHUNK],
        5 * CHUNK,
        5,
    )
    assert leaf.value == repr(str(src))
    (changed,) = [d for d in cryosnap.Run(run).diff(1, 2).leaves if d.path == "grid"]
    assert changed.changed_bytes == CHUNK
    only = cryosnap.load(run, keys=["grid"])
    assert list(only) == ["grid"] and only["grid"].read_bytes() == src.read_bytes()
