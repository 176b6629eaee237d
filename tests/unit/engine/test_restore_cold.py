"""Restores from cold data files (engine/fetch/_cold.py): files out of the page cache (made so
by fsync + POSIX_FADV_DONTNEED, checked with mincore) are read with O_DIRECT, large fresh
leaves into page-aligned memory of their own; into='s leaves through the mapping (the file
mapped after all) or, staged, into staging memory copied in once every chunk verified; the
bytes are those of the mapped path, damage fails the restore with into= untouched, and a device
that refuses direct reads midway loses nothing."""

from __future__ import annotations

import contextlib
import errno
import uuid
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap import _native, engine
from cryosnap._format.keys import manifest_key
from cryosnap._format.manifest import Manifest
from cryosnap._format.skeleton import blob_paths
from cryosnap.engine.fetch import _cold, _execute
from cryosnap.storage import LocalStore, _direct, open_store
from cryosnap.testing import FaultySyscalls

from ..support import cached_pages_of, evict, snapshot

CHUNK = 64 << 10
STEP = 5
MIB = 1 << 20


def _state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "w": torch.from_numpy(rng.standard_normal(3 * MIB // 4 + 3).astype(np.float32)),
        "arr": rng.standard_normal(300_001),  # 2.3 MiB of float64
        "small": torch.arange(1000, dtype=torch.int16),
        "half": torch.from_numpy(rng.standard_normal(2 * MIB).astype(np.float32)).bfloat16(),
        "step": 3,
    }


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, np.ndarray):
            out[k] = np.zeros_like(v)
        else:
            out[k] = v
    return out


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return snapshot(a) == snapshot(b) and {k for k in a} == {k for k in b}


def _data_files(root: Path) -> list[Path]:
    return sorted((root / "data").rglob("*.dat")) or sorted(
        p for p in (root / "data").rglob("*") if p.is_file()
    )


def _evict(root: Path) -> None:
    """fsync and drop every file of the run from the page cache; skips where the kernel keeps
    them (mincore says)."""
    evict(root)
    share = _cached_share(root)
    if share is None:
        pytest.skip("mincore is not available here")
    if share > 0.1:
        pytest.skip(f"this file system keeps {share:.0%} of the data files' pages cached")


def _cached_share(root: Path) -> float | None:
    counts = cached_pages_of(_data_files(root))
    return None if counts is None else counts[0] / max(counts[1], 1)


def _saved(root: Path, state: dict[str, Any] | None = None) -> dict[str, Any]:
    state = _state() if state is None else state
    cryosnap.save(root, state, step=STEP, chunk_bytes=CHUNK)
    _evict(root)
    return state


def _direct_bytes(syscalls: FaultySyscalls) -> int:
    return sum(n for n, direct in syscalls.reads if direct)


def _nbytes(state: dict[str, Any]) -> int:
    return sum(v.nbytes for v in state.values() if isinstance(v, np.ndarray)) + sum(
        v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)
    )


def _bounced(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the bytes each copy out of the direct reader's bounce buffer moves."""
    copies: list[int] = []
    real = _direct._copy

    def copy(dest: memoryview, source: memoryview) -> None:
        copies.append(dest.nbytes)
        real(dest, source)

    monkeypatch.setattr(_direct, "_copy", copy)
    return copies


@pytest.mark.parametrize("writer", ["save", "checkpointer"])
def test_a_cold_fresh_restore_reads_with_direct_io_into_fresh_memory(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    state = _state()
    if writer == "save":  # data files laid out by the caller's tensors' addresses
        cryosnap.save(direct_dir, state, step=STEP, chunk_bytes=CHUNK)
    else:  # by the staging slabs'
        with cryosnap.Checkpointer(direct_dir, chunk_bytes=CHUNK) as ckpt:
            ckpt.save(STEP, state).result()
    _evict(direct_dir)
    syscalls = FaultySyscalls()
    store = LocalStore(direct_dir, syscalls=syscalls)
    copied = _bounced(monkeypatch)
    loaded = cryosnap.load(store, step=STEP)
    assert _equal(loaded, state)
    assert _direct_bytes(syscalls) >= 0.9 * _nbytes(state)
    # The large leaves got memory of their own placed as their bytes lie in the file's pages,
    # and the reads landed there: little went through the bounce buffer.
    assert sum(copied) <= 0.1 * _nbytes(state)
    _path, offset, _n = _segment(direct_dir, "w")
    assert (_native.address_of(loaded["w"].numpy()) - offset) % 4096 == 0
    loaded["w"] += 1  # their own memory: the file is untouched
    assert _equal(cryosnap.load(store, step=STEP), state)
    assert (_cached_share(direct_dir) or 0.0) <= 0.1  # the reads left the page cache cold


def test_a_warm_restore_keeps_the_mapped_path(direct_dir: Path) -> None:
    state = _saved(direct_dir)
    for path in _data_files(direct_dir):
        path.read_bytes()  # into the page cache
    syscalls = FaultySyscalls()
    loaded = cryosnap.load(LocalStore(direct_dir, syscalls=syscalls), step=STEP)
    assert _equal(loaded, state)
    assert not syscalls.reads


def _staged(*, room: bool = True) -> AbstractContextManager[engine.ReadLimits]:
    """The restores in the block stage into='s leaves in cold files (read once with direct
    I/O), not mapped; without ``room`` there is no memory to stage in: read twice, from the
    disk."""
    if room:
        return engine.read_limits(map_cold_into=False)
    return engine.read_limits(map_cold_into=False, staging_share=0.0)


def _restored_into_in_place(direct_dir: Path, state: dict[str, Any]) -> FaultySyscalls:
    """Restore ``state``'s version into zeroed leaves, check that it is ``state`` and that
    every array leaf was filled in place; the syscalls the restore made."""
    syscalls = FaultySyscalls()
    into = _zeros(state)
    kept = {k: v for k, v in into.items() if not isinstance(v, int)}
    out = cryosnap.load(LocalStore(direct_dir, syscalls=syscalls), step=STEP, into=into)
    assert _equal(out, state)
    assert all(out[k] is v for k, v in kept.items())  # filled in place
    return syscalls


def test_a_cold_restore_into_fills_in_place_through_the_mapping(direct_dir: Path) -> None:
    """into='s own leaves (those of at least 256 KiB) are verified and copied from the
    mapped file: no direct read of their bytes, none staged."""
    state = _saved(direct_dir)
    syscalls = _restored_into_in_place(direct_dir, state)
    assert _direct_bytes(syscalls) <= 0.1 * _nbytes(state)  # "small" only: the rest mapped


def test_a_staged_cold_restore_into_fills_in_place(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _saved(direct_dir)
    copied = _bounced(monkeypatch)
    with _staged():
        syscalls = _restored_into_in_place(direct_dir, state)
    assert _direct_bytes(syscalls) >= 4 * MIB  # read once, from the disk
    assert sum(copied) <= 0.1 * _nbytes(state)  # into staging memory placed alike


def test_cold_files_that_cannot_be_mapped_stage_into(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the store maps no file (``map_file`` says None) into='s leaves in cold files are
    staged: read once with direct I/O, copied in once every chunk verified."""
    state = _saved(direct_dir)
    monkeypatch.setattr(LocalStore, "map_file", lambda self, key: None)
    syscalls = _restored_into_in_place(direct_dir, state)
    assert _direct_bytes(syscalls) >= 4 * MIB


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(
        st.sampled_from([0, 1, 777, 4096, 65_536 + 8, MIB, MIB + 4, 3 * MIB - 12]),
        min_size=1,
        max_size=5,
    ),
    chunk=st.sampled_from([4096, 64 << 10, MIB]),
    into=st.booleans(),
    staged=st.booleans(),
    data=st.data(),
)
def test_the_direct_path_and_the_mapped_path_give_the_same_bytes(
    direct_dir: Path, sizes: list[int], chunk: int, into: bool, staged: bool, data: st.DataObject
) -> None:
    rng = np.random.default_rng(len(sizes) * 31 + chunk)
    state: dict[str, Any] = {}
    for i, n in enumerate(sizes):
        raw = rng.integers(0, 256, n, np.uint8)
        state[f"t{i}"] = torch.from_numpy(raw) if data.draw(st.booleans()) else raw.copy()
    root = direct_dir / uuid.uuid4().hex
    cryosnap.save(root, state, step=STEP, chunk_bytes=chunk)
    _evict(root)
    syscalls = FaultySyscalls()
    store = LocalStore(root, syscalls=syscalls)
    with engine.read_limits(map_cold_into=not staged):
        cold = cryosnap.load(store, step=STEP, into=_zeros(state) if into else None)
    reads = len(syscalls.reads)
    with engine.read_limits(cold_share=0.0):  # every file counts as warm: mapped
        mapped = cryosnap.load(store, step=STEP, into=_zeros(state) if into else None)
    assert len(syscalls.reads) == reads
    assert snapshot(cold) == snapshot(mapped) == snapshot(state)


def _segment(root: Path, leaf: str) -> tuple[Path, int, int]:
    store = open_store(root)
    manifest = Manifest.from_json(store.read(manifest_key(STEP, 0)), "test")
    blob = blob_paths(manifest.skeleton, len(manifest.blobs)).index(leaf)
    (row,) = manifest.blobs[blob].table
    return root / manifest.data_files[int(row[1])], int(row[2]), int(row[3])


def _flip(path: Path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("path", ["mapped", "staged", "twice"])
def test_damage_fails_a_cold_restore_and_leaves_into_untouched(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    limits = _staged() if path != "mapped" else contextlib.nullcontext()
    if path == "twice":  # no memory to stage in: into='s leaves are read twice, as before
        monkeypatch.setattr(_cold, "available_memory_bytes", lambda: 0)
    state = _state()
    cryosnap.save(direct_dir, state, step=STEP, chunk_bytes=CHUNK)
    data, offset, nbytes = _segment(direct_dir, "arr")
    _flip(data, offset + nbytes // 2)
    _evict(direct_dir)
    into = _zeros(state)
    into["w"].fill_(7.0)
    before = snapshot(into)
    chunk = nbytes // 2 // CHUNK
    with limits:
        with pytest.raises(cryosnap.IntegrityError, match=f"leaf arr: chunk {chunk} "):
            cryosnap.load(direct_dir, step=STEP, into=into)
        assert snapshot(into) == before
        with pytest.raises(cryosnap.IntegrityError, match="leaf arr"):
            cryosnap.load(direct_dir, step=STEP)


def test_without_staging_memory_into_is_still_filled(direct_dir: Path) -> None:
    state = _saved(direct_dir)
    into = _zeros(state)
    with _staged(room=False):
        assert _equal(cryosnap.load(direct_dir, step=STEP, into=into), state)


def test_a_short_read_at_the_end_names_the_leaf_and_leaves_into_untouched(
    direct_dir: Path,
) -> None:
    """The device returns nothing for a read (the file ends there, as a truncated file does
    after the size checks): the corruption error naming step, level and leaf (into='s
    leaves staged: read with direct I/O as fresh leaves are)."""
    state = _saved(direct_dir)

    def eof(nbytes: int, direct: bool) -> int | None:
        return 0 if nbytes > MIB else None

    into = _zeros(state)
    before = snapshot(into)
    store = LocalStore(direct_dir, syscalls=FaultySyscalls(read_fault=eof))
    with (
        _staged(),
        pytest.raises(
            cryosnap.IntegrityError,
            match=rf"step {STEP}, tier .*: data file .* is truncated; leaf \w+ cannot be read",
        ),
    ):
        cryosnap.load(store, step=STEP, into=into)
    assert snapshot(into) == before


def test_a_device_refusing_direct_reads_midway_loses_nothing(direct_dir: Path) -> None:
    state = _saved(direct_dir)
    seen: list[bool] = []

    def refuse(nbytes: int, direct: bool) -> int | None:
        seen.append(direct)
        if direct and len(seen) > 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return None

    syscalls = FaultySyscalls(read_fault=refuse)
    store = LocalStore(direct_dir, syscalls=syscalls)
    assert _equal(cryosnap.load(store, step=STEP), state)
    assert any(d for _n, d in syscalls.reads) and not store._direct_reads
    _evict(direct_dir)
    into = _zeros(state)
    assert _equal(cryosnap.load(store, step=STEP, into=into), state)  # buffered from now on


def test_an_incremental_chain_over_warm_and_cold_files(direct_dir: Path) -> None:
    state = _state()
    with cryosnap.Checkpointer(direct_dir, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(1, state).result()
        state["arr"][:1000] += 1.0
        state["w"][-5:] = 2.0
        ckpt.save(2, state).result()
    files = _data_files(direct_dir)
    assert len(files) == 2
    _evict(direct_dir)
    files[-1].read_bytes()  # the newer file warm, the base's cold
    syscalls = FaultySyscalls()
    store = LocalStore(direct_dir, syscalls=syscalls)
    assert _equal(cryosnap.load(store, step=2), state)
    assert _direct_bytes(syscalls) > 0
    _evict(direct_dir)
    into = _zeros(state)
    assert _equal(cryosnap.load(store, step=2, into=into), state)


def test_selected_keys_of_a_cold_version(direct_dir: Path) -> None:
    state = _saved(direct_dir)
    got = cryosnap.load(direct_dir, step=STEP, keys=["arr", "step"])
    assert set(got) == {"arr", "step"}
    assert np.array_equal(got["arr"], state["arr"])
    assert cryosnap.Run(direct_dir).verify(STEP).ok


def test_a_level_without_direct_reads_keeps_the_mapped_path(direct_dir: Path) -> None:
    """direct_io=False: the cold files are read as warm ones (mapped), not buffered by the
    direct reader (slower than the mapping)."""
    state = _saved(direct_dir)
    syscalls = FaultySyscalls()
    store = LocalStore(direct_dir, direct_io=False, syscalls=syscalls)
    assert store.cached_share(_data_files(direct_dir)[0].relative_to(direct_dir).as_posix()) is None
    assert _equal(cryosnap.load(store, step=STEP), state)
    assert not syscalls.reads


@pytest.mark.parametrize("path", ["mapped", "twice"])
def test_into_catches_a_cold_file_changed_between_the_passes(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Mapped, or past the staging budget (both passes read from the disk): the second pass
    verifies again, so bytes changed meanwhile never reach into= and the restore fails."""
    limits = _staged(room=False) if path == "twice" else contextlib.nullcontext()
    state = _saved(direct_dir)
    data, offset, nbytes = _segment(direct_dir, "arr")
    second = _execute.PartReader.second_pass

    def damage_then_fill(self: Any) -> None:
        _flip(data, offset + nbytes // 2)
        _evict(direct_dir)
        second(self)

    monkeypatch.setattr(_execute.PartReader, "second_pass", damage_then_fill)
    into = _zeros(state)
    chunk = nbytes // 2 // CHUNK
    with limits, pytest.raises(cryosnap.IntegrityError, match=f"leaf arr: chunk {chunk} "):
        cryosnap.load(direct_dir, step=STEP, into=into)
    got = into["arr"].view(np.uint8)
    want = state["arr"].view(np.uint8)
    written = got != 0
    assert np.array_equal(got[written], want[written])
    assert not got[chunk * CHUNK : (chunk + 1) * CHUNK].any()
