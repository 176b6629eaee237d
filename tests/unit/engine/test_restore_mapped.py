"""Restores from mapped data files (engine/fetch's Mapped, LocalStore.map_file): fresh
leaves are views of the page cache's pages, hashed where they lie; into= is filled from the
mapping. What a user sees must not change: values, writability, dtypes, shared storages, errors
naming the leaf; plus what the mapping adds: a file deleted or replaced after it was mapped
changes nothing, and writes to a leaf never reach the file."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import cryosnap
from cryosnap import engine
from cryosnap._format.keys import manifest_key
from cryosnap._format.manifest import Manifest
from cryosnap.engine import _read
from cryosnap.engine.fetch import _execute, _plan
from cryosnap.errors import CheckpointFormatError
from cryosnap.storage import LocalStore, TimeoutStore, _local, open_store
from cryosnap.testing import FaultyStore

from ..support import snapshot

STEP = 3
CHUNK = 64 << 10


@pytest.fixture(autouse=True)
def _warm() -> Iterator[None]:
    """Every data file here counts as warm, whatever the page cache holds: the mapped path
    (cold files are read with direct I/O, tests/unit/engine/test_restore_cold.py)."""
    with engine.read_limits(cold_share=0.0):
        yield


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 32, generator=g)
    return {
        "flag": torch.tensor([True, False, True]),  # 3 bytes: what follows is misaligned
        "big": torch.randn(300_000, generator=g),
        "half": torch.randn(1001, generator=g).to(torch.bfloat16),
        "cplx": torch.randn(77, dtype=torch.complex128, generator=g),
        "fortran": np.asfortranarray(np.arange(60, dtype=np.float64).reshape(6, 10)),
        "tied": [w, w[3:]],
        "blob": b"\x00\x01" * 999,
        "scalar": torch.tensor(2.5),
        "n": 11,
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, list):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _data_file(root: Path) -> Path:
    (path,) = (root / "data").iterdir()
    return path


def _placed(root: Path) -> tuple[list[str], list[bool], list[memoryview]]:
    """Each blob's leaf path, whether it was placed, and its memory, for a restore of STEP."""
    store = open_store(root)
    limits = engine.ReadLimits.current()  # this module's: every file warm
    part, restorer, _fetched = _read._read_verified(
        store, STEP, rank=0, allow_pickle=False, limits=limits
    )
    return [b.path for b in part.blobs], restorer.placed, list(restorer._dest)


def test_fresh_leaves_are_views_of_the_mapped_file_and_round_trip(tmp_path: Path) -> None:
    state = _state()
    cryosnap.save(tmp_path, state, step=STEP, chunk_bytes=CHUNK)
    out = cryosnap.load(tmp_path)
    assert all(_equal(state[k], out[k]) for k in state)
    assert (
        out["tied"][0].untyped_storage().data_ptr() == out["tied"][1].untyped_storage().data_ptr()
    )
    assert out["fortran"].flags.f_contiguous and out["fortran"].flags.writeable
    paths, placed, dest = _placed(tmp_path)
    assert placed[paths.index("big")]
    assert not placed[paths.index("blob")]  # bytes leaves are copied out
    item = {"big": 4, "half": 2, "cplx": 16, "fortran": 8, "tied": 16}
    for path, was, view in zip(paths, placed, dest, strict=True):
        if was:
            address = np.frombuffer(view, np.uint8).ctypes.data
            assert address % item.get(path, 1) == 0, path


def test_misaligned_blobs_are_allocated_not_placed(tmp_path: Path) -> None:
    # 9 bytes, then 800 (too small to be aligned by the writer): misaligned for float64. (In
    # Fortran order: small arrays in C order would share a pack, aligned.)
    state = {
        "a": np.asfortranarray(np.ones((3, 3), dtype=bool)),
        "b": np.asfortranarray(np.arange(100, dtype=np.float64).reshape(10, 10)),
    }
    cryosnap.save(tmp_path, state, step=STEP, chunk_bytes=CHUNK)
    manifest = Manifest.from_json(LocalStore(tmp_path).read(manifest_key(STEP, 0)), "test")
    paths, placed, _dest = _placed(tmp_path)
    assert int(manifest.blobs[paths.index("b")].table[0][2]) % 8
    assert placed[paths.index("a")] and not placed[paths.index("b")]
    out = cryosnap.load(tmp_path)
    assert np.array_equal(out["b"], state["b"]) and np.array_equal(out["a"], state["a"])


def test_the_writer_aligns_blobs_of_a_page_or_more(tmp_path: Path) -> None:
    """Blobs of 4 KiB or more start at a multiple of 64 bytes in their data file; the zero
    bytes before them are not counted as written."""
    sizes = [3, 5000, 7, 4096, 100, 70_000, 1]
    state = {f"t{i}": bytes([i]) * n for i, n in enumerate(sizes)}  # bytes: never packed
    info = cryosnap.save(tmp_path, state, step=STEP, chunk_bytes=CHUNK)
    assert info.written_bytes == sum(sizes)
    manifest = Manifest.from_json(LocalStore(tmp_path).read(manifest_key(STEP, 0)), "test")
    paths = _placed(tmp_path)[0]
    ends = []
    for i, n in enumerate(sizes):
        rows = manifest.blobs[paths.index(f"t{i}")].table
        offset = int(rows[0][2])
        assert n < 4096 or offset % 64 == 0, (n, offset)
        ends.append(int(rows[-1][2]) + int(rows[-1][3]))
    assert _data_file(tmp_path).stat().st_size == max(ends) > sum(sizes)
    out = cryosnap.load(tmp_path)
    assert out == state


def test_writes_to_restored_leaves_never_reach_the_file(tmp_path: Path) -> None:
    state = _state()
    cryosnap.save(tmp_path, state, step=STEP, chunk_bytes=CHUNK)
    before = _data_file(tmp_path).read_bytes()
    out = cryosnap.load(tmp_path)
    out["big"].add_(1.0)
    out["fortran"][:] = -1
    assert _data_file(tmp_path).read_bytes() == before
    again = cryosnap.load(tmp_path)
    assert torch.equal(again["big"], state["big"])
    assert np.array_equal(again["fortran"], state["fortran"])
    assert torch.equal(out["big"], state["big"] + 1.0)


def test_restored_leaves_outlive_their_run(tmp_path: Path) -> None:
    state = _state()
    run = tmp_path / "run"
    cryosnap.save(run, state, step=STEP, chunk_bytes=CHUNK)
    out = cryosnap.load(run)
    shutil.rmtree(run)
    assert all(_equal(state[k], out[k]) for k in state)


def test_damage_in_a_placed_leaf_is_named(tmp_path: Path) -> None:
    state = _state()
    cryosnap.save(tmp_path, state, step=STEP, chunk_bytes=CHUNK)
    manifest = Manifest.from_json(LocalStore(tmp_path).read(manifest_key(STEP, 0)), "test")
    paths, placed, _dest = _placed(tmp_path)
    blob = paths.index("big")
    assert placed[blob]
    offset = int(manifest.blobs[blob].table[0][2])
    path = _data_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[offset + 5 * CHUNK + 17] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(cryosnap.IntegrityError, match="leaf big: chunk 5 "):
        cryosnap.load(tmp_path, step=STEP)


def test_into_survives_a_file_replaced_between_the_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mapping holds the file that verified: replacing (or deleting) it before the second
    pass changes nothing, where a second read would have failed."""
    big = torch.randn(400_000)
    cryosnap.save(tmp_path, {"big": big}, step=STEP, chunk_bytes=CHUNK)
    path = _data_file(tmp_path)
    second = _execute.PartReader.second_pass

    def replace_then_fill(self: Any) -> None:
        damaged = bytearray(path.read_bytes())
        damaged[len(damaged) // 2] ^= 0xFF
        spare = path.with_name("spare")
        spare.write_bytes(bytes(damaged))
        os.replace(spare, path)
        second(self)

    monkeypatch.setattr(_execute.PartReader, "second_pass", replace_then_fill)
    into = {"big": torch.zeros(400_000)}
    cryosnap.load(tmp_path, step=STEP, into=into)
    assert torch.equal(into["big"], big)


def test_bytes_overwritten_in_place_between_the_passes_never_reach_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = torch.randn(400_000)
    cryosnap.save(tmp_path, {"big": big}, step=STEP, chunk_bytes=CHUNK)
    path = _data_file(tmp_path)
    second = _execute.PartReader.second_pass

    start = path.stat().st_size - big.nbytes  # the blob's offset (direct I/O may pad before it)
    assert start >= 0

    def overwrite_then_fill(self: Any) -> None:
        with open(path, "r+b") as f:  # in place: the mapped pages change too
            f.seek(start + CHUNK * 2 + 3)
            byte = f.read(1)
            f.seek(start + CHUNK * 2 + 3)
            f.write(bytes([byte[0] ^ 0xFF]))
        second(self)

    monkeypatch.setattr(_execute.PartReader, "second_pass", overwrite_then_fill)
    into = {"big": torch.zeros(400_000)}
    with pytest.raises(cryosnap.IntegrityError, match="leaf big: chunk 2 "):
        cryosnap.load(tmp_path, step=STEP, into=into)
    got = into["big"].view(torch.uint8)
    want = big.view(torch.uint8)
    written = got != 0
    assert torch.equal(got[written], want[written])
    assert not got[2 * CHUNK : 3 * CHUNK].any()  # the overwritten chunk was never copied


def test_into_from_the_mapping_leaves_into_untouched_on_damage(tmp_path: Path) -> None:
    big = torch.randn(400_000)
    cryosnap.save(tmp_path, {"big": big}, step=STEP, chunk_bytes=CHUNK)
    path = _data_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x10
    path.write_bytes(bytes(data))
    into = {"big": torch.zeros(400_000)}
    before = snapshot(into)
    with pytest.raises(cryosnap.IntegrityError, match="leaf big"):
        cryosnap.load(tmp_path, step=STEP, into=into)
    assert snapshot(into) == before


def test_which_stores_map(tmp_path: Path) -> None:
    cryosnap.save(tmp_path, {"w": torch.arange(10.0)}, step=STEP)
    key = f"data/{_data_file(tmp_path).name}"
    local = LocalStore(tmp_path)
    mapped = local.map_file(key)
    assert mapped is not None and len(mapped) == _data_file(tmp_path).stat().st_size
    timed = open_store(tmp_path)
    assert isinstance(timed, TimeoutStore) and timed.map_file(key) is not None
    # A store that injects faults reads: its faults must reach the reader.
    assert not hasattr(FaultyStore(local), "map_file")


def test_empty_files_and_network_file_systems_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cryosnap.save(tmp_path, {"w": torch.arange(1000.0)}, step=STEP)
    data = _data_file(tmp_path)
    key = f"data/{data.name}"
    (tmp_path / "data" / "000000000009-r00000-empty.dat").write_bytes(b"")
    local = LocalStore(tmp_path)
    assert local.map_file("data/000000000009-r00000-empty.dat") is None
    dev = data.stat().st_dev
    monkeypatch.setitem(_local._fs_types, dev, "nfs4")
    assert local.map_file(key) is None
    assert torch.equal(cryosnap.load(tmp_path)["w"], torch.arange(1000.0))


def test_the_file_system_of_this_run_is_told(tmp_path: Path) -> None:
    """/proc/self/mountinfo names the file system of tmp_path's device (Linux)."""
    if not Path("/proc/self/mountinfo").exists():
        pytest.skip("no /proc/self/mountinfo")
    dev = tmp_path.stat().st_dev
    _local._fs_types.pop(dev, None)
    _local._mappable_device(dev)
    assert _local._fs_types[dev]  # some file system was found for it


def test_a_symlinked_data_file_is_refused_not_mapped(tmp_path: Path) -> None:
    cryosnap.save(tmp_path / "run", {"w": torch.arange(1000.0)}, step=STEP)
    path = _data_file(tmp_path / "run")
    outside = tmp_path / "outside.dat"
    shutil.move(path, outside)
    path.symlink_to(outside)
    with pytest.raises(CheckpointFormatError, match="not a regular file"):
        LocalStore(tmp_path / "run").map_file(f"data/{path.name}")
    with pytest.raises(cryosnap.CheckpointError):
        cryosnap.load(tmp_path / "run", step=STEP)


def test_leaves_of_content_stored_once_get_memory_of_their_own(tmp_path: Path) -> None:
    """Equal leaves are stored once; built over the same mapped bytes, a write to one would
    change the other (Adam's step counters: every parameter's is the same number)."""
    block = torch.arange(5000.0)
    state = {"a": block.clone(), "b": block.clone(), "steps": [torch.tensor(3.0) for _ in range(4)]}
    cryosnap.save(tmp_path, state, step=STEP, chunk_bytes=CHUNK)
    out = cryosnap.load(tmp_path)
    out["a"].add_(1.0)
    for t in out["steps"]:
        t.add_(1.0)
    assert torch.equal(out["b"], block) and torch.equal(out["a"], block + 1.0)
    assert [float(t) for t in out["steps"]] == [4.0] * 4


def test_adam_resumes_exactly_from_a_mapped_restore(tmp_path: Path) -> None:
    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()

    model, opt = make()
    for _ in range(3):
        step(model, opt)
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, {"model": model, "optim": opt}).result()
    model2, opt2 = make()
    with cryosnap.Checkpointer(tmp_path) as ckpt:
        ckpt.restore(into={"model": model2, "optim": opt2})
    for _ in range(3):
        step(model, opt)
        step(model2, opt2)
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_overlapping_ranges_are_found() -> None:
    files = np.array([0, 0, 0, 1, 1, 0, 2, 2])
    lo = np.array([0, 100, 150, 0, 100, 400, 0, 0])
    nbytes = np.array([100, 100, 10, 100, 100, 10, 50, 50])
    # [0,100) and [100,200) touch without overlapping; [150,160) lies inside [100,200);
    # file 1's ranges are apart; file 2's two ranges are the same bytes.
    got = _plan.overlapping(files, lo, nbytes)
    assert got.tolist() == [False, True, True, False, False, False, True, True]


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


def test_into_keeps_only_the_pieces_in_flight_mapped(tmp_path: Path) -> None:
    """The mapped pages of into='s leaves are unmapped once hashed and copied: the restore's
    peak resident memory stays far below the state's size (it was the whole state)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pytest.skip("cannot reset the peak resident memory here")
    state = {f"w{i}": torch.randn(4 << 20) for i in range(8)}  # 128 MiB
    cryosnap.save(tmp_path, state, step=STEP)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    cryosnap.load(tmp_path, step=STEP, into=into)  # warm: the page cache holds the file
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss("VmRSS")
    cryosnap.load(tmp_path, step=STEP, into=into)
    assert _rss("VmHWM") - before < (48 << 20)
    assert all(torch.equal(into[k], state[k]) for k in state)


def test_mapped_leaves_hold_no_file_descriptors(tmp_path: Path) -> None:
    """A restore may map thousands of data files, and its leaves may live as long as the
    program: the mappings must not keep a descriptor each (ulimit -n)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("no /proc/self/fd")
    with cryosnap.Checkpointer(tmp_path, full_every=50) as ckpt:
        for step in range(20):  # an incremental chain over 20 data files
            ckpt.save(step, {"w": torch.full((5000,), float(step)), "k": torch.arange(3000.0)})
        ckpt.wait()
    before = len(os.listdir("/proc/self/fd"))
    outs = [cryosnap.load(tmp_path) for _ in range(3)]
    assert len(os.listdir("/proc/self/fd")) == before
    assert all(float(o["w"][0]) == 19.0 and torch.equal(o["k"], torch.arange(3000.0)) for o in outs)
    with open("/proc/self/maps") as f:
        assert any(str(tmp_path) in line for line in f)  # the leaves are mapped
    del outs
    with open("/proc/self/maps") as f:
        assert not any(str(tmp_path) in line for line in f)  # and unmapped with them
