"""The restore's fast paths: chunks hashed with the GIL released (the same digests as
``hash_chunks``; its fallback and the page advice in test_native.py), the bounced pieces of
``into=``'s leaves read in one buffer per run; every chunk still verified on each of them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import cryosnap
import cryosnap._format.chunks as chunks
from cryosnap import engine
from cryosnap._format.keys import manifest_key
from cryosnap._format.manifest import Manifest
from cryosnap._format.skeleton import blob_paths
from cryosnap.engine import _claims
from cryosnap.engine.fetch import _plan
from cryosnap.errors import IntegrityError
from cryosnap.storage import LocalStore, open_store

from ..support import snapshot

BIG_CHUNK = 256 << 10  # hashed by the native call


@pytest.mark.parametrize("chunk_bytes", [4096, 128 << 10, BIG_CHUNK, (1 << 20) + 3])
@pytest.mark.parametrize("nbytes", [0, 1, 4095, 128 << 10, (128 << 10) + 1, (3 << 20) + 17])
def test_released_hashing_gives_the_digests_of_hash_chunks(chunk_bytes: int, nbytes: int) -> None:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    want = chunks.hash_chunks(data.data, chunk_bytes)
    assert chunks.hash_chunks_released(data.data, chunk_bytes) == want
    data.flags.writeable = False
    assert chunks.hash_chunks_released(data.data, chunk_bytes) == want
    assert chunks.hash_chunks_released(memoryview(bytes(data)), chunk_bytes) == want


def _big_state() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "w": torch.from_numpy(rng.standard_normal(700_000).astype(np.float32)),  # 11 chunks
        "b": torch.from_numpy(rng.standard_normal((300, 1000))).bfloat16(),
        "a": rng.standard_normal((512, 300)),
        "small": [torch.arange(10), np.arange(7, dtype=np.int8)],
        "empty": torch.empty(0),
        "scalar": torch.tensor(3.5),
        "s": "text",
    }


def _zeros(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v)
        elif isinstance(v, np.ndarray):
            out[k] = np.zeros_like(v)
        elif isinstance(v, list):
            out[k] = [torch.zeros_like(v[0]), np.zeros_like(v[1])]
        else:
            out[k] = v
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, list):
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.parametrize("min_bytes", [0, 256 << 10])
def test_large_chunks_restore_bit_exact(tmp_path: Path, min_bytes: int) -> None:
    state = _big_state()
    cryosnap.save(tmp_path, state, chunk_bytes=BIG_CHUNK)
    into = _zeros(state)
    with engine.read_limits(direct_min_bytes=min_bytes, populate_min_bytes=4096):
        out = cryosnap.load(tmp_path)
        cryosnap.load(tmp_path, into=into)
    assert all(_same(state[k], out[k]) for k in state)
    assert all(_same(state[k], into[k]) for k in state)


@pytest.mark.parametrize("into_given", [False, True])
def test_damage_in_a_large_chunk_is_named_and_leaves_into_untouched(
    tmp_path: Path, into_given: bool
) -> None:
    state = _big_state()
    cryosnap.save(tmp_path, state, step=5, chunk_bytes=BIG_CHUNK)
    store = open_store(tmp_path)
    manifest = Manifest.from_json(store.read(manifest_key(5, 0)), "test")
    (key,) = manifest.data_files
    paths = blob_paths(manifest.skeleton, len(manifest.blobs))
    row = manifest.blobs[paths.index("w")].table[0]
    path = tmp_path / key
    raw = bytearray(path.read_bytes())
    raw[int(row[2]) + 7 * BIG_CHUNK + 5] ^= 0x10  # chunk 7 of leaf w
    path.write_bytes(bytes(raw))
    into = _zeros(state) if into_given else None
    before = snapshot(into) if into is not None else None
    with (
        engine.read_limits(direct_min_bytes=0),
        pytest.raises(cryosnap.IntegrityError, match=r"step 5.*leaf w: chunk 7 "),
    ):
        cryosnap.load(tmp_path, step=5, into=into)
    if into is not None:
        assert snapshot(into) == before


def test_bounced_pieces_around_gaps_and_copied_leaves(tmp_path: Path) -> None:
    """Leaves read into directly (bounced, one buffer per stretch of a run) beside leaves that
    are copied (non-contiguous into=), in tasks of a few pieces each."""
    rng = np.random.default_rng(9)
    sizes = rng.integers(1, 6000, 80).tolist()
    state = {
        f"t{i}": torch.from_numpy(rng.standard_normal(n).astype("f4")) for i, n in enumerate(sizes)
    }
    cryosnap.save(tmp_path, state, chunk_bytes=4096)
    into = {}
    for i, (k, v) in enumerate(state.items()):
        # Every third not contiguous: copied after the read, the others read into directly.
        into[k] = torch.zeros(v.numel() * 2)[::2] if i % 3 == 0 else torch.zeros_like(v)
    with engine.read_limits(direct_min_bytes=0, bounce_bytes=16 << 10, io_batch_bytes=48 << 10):
        cryosnap.load(tmp_path, into=into)
    assert all(torch.equal(state[k], into[k]) for k in state)


def test_plain_keys_and_values_take_the_fast_paths_as_before(tmp_path: Path) -> None:
    """dict keys decoded without a call each when all are str/int (a huge int key still
    decodes); tensors told from stateful objects without attribute lookups, modules still
    filled through load_state_dict."""
    huge = 1 << 80
    module = torch.nn.Linear(3, 2)
    state = {"w": torch.arange(6.0), 7: np.ones(3), huge: "big", "m": module}
    cryosnap.save(tmp_path, state)
    out = cryosnap.load(tmp_path)
    assert out[huge] == "big" and torch.equal(out["w"], state["w"]) and 7 in out
    target = torch.nn.Linear(3, 2)
    into = {"w": torch.zeros(6), 7: np.zeros(3), huge: "", "m": target}
    cryosnap.load(tmp_path, into=into)
    assert torch.equal(into["w"], state["w"]) and (into[7] == 1).all() and into[huge] == "big"
    assert into["m"] is target and torch.equal(target.weight, module.weight)


@pytest.mark.parametrize("seed", range(20))
def test_tasks_cover_every_piece_once_in_order(seed: int) -> None:
    """The vectorized task plan: every piece once, in file and offset order; a run's gaps
    put each piece at its offset, none wider than the gap limit; one file per task."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    files = np.sort(rng.integers(0, 3, n))
    sizes = rng.integers(1, 3 << 20, n)
    offsets = np.zeros(n, np.int64)
    for f in range(3):
        mine = files == f
        gaps = rng.choice([0, 0, 0, 100, 70 << 10, -5], int(mine.sum()))
        offsets[mine] = np.maximum(0, np.sort(np.cumsum(sizes[mine] + gaps) - sizes[mine] - gaps))

    direct = rng.random(n) < 0.3 if seed % 2 else None
    pieces = SimpleNamespace(file=files, offset=offsets, nbytes=sizes)
    limits = engine.ReadLimits()
    reads = _plan._reads(pieces, np.arange(n), direct, limits)  # type: ignore[arg-type]
    tasks = reads.tasks(offsets)
    assert [p for _f, runs in tasks for _o, pids, _g in runs for p in pids] == list(range(n))
    for f, runs in tasks:
        for offset, pids, gaps in runs:
            assert gaps[0] == 0 and offset == offsets[pids[0]]
            at = offset
            for p, gap in zip(pids, gaps, strict=True):
                assert files[p] == f and 0 <= gap <= limits.gap_bytes
                at += gap
                assert at == offsets[p]
                at += sizes[p]


@pytest.mark.parametrize("cut", [1, 4096, 5000])
def test_used_files_check_names_the_leaf_a_truncated_file_cuts(tmp_path: Path, cut: int) -> None:
    """The check of the files resolution reads that the chain check did not size (all chunks
    at once) names the first leaf whose bytes lie past the file's end."""
    state = {f"t{i}": torch.full((i * 300 + 1,), float(i)) for i in range(12)}
    cryosnap.save(tmp_path, state, step=1, chunk_bytes=4096)
    store = LocalStore(tmp_path)
    part = engine.resolve_version(store, 1)
    _claims.check_used_files(store, part, set())  # whole: nothing to say
    (key,) = part.files
    path = tmp_path / key
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - cut])
    ends = [
        (int(b.offsets[-1]) + (b.nbytes - 1) % 4096 + 1, b.path) for b in part.blobs if b.nbytes
    ]
    victim = min((p for end, p in ends if end > len(data) - cut), key=part.blob_index)
    with pytest.raises(IntegrityError, match=f"{key} is truncated; leaf {victim} cannot"):
        _claims.check_used_files(store, part, set())
