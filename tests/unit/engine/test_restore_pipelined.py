"""Restores to a device pipelined (engine/_read.py, _state/device.py's DeviceFeed): each blob's
torch leaves are copied to the device as soon as every chunk of the blob verified, while the
other blobs are still read. Run here on the CPU: ``_pipelined`` is made to answer True for it,
so ``map_location="cpu"`` takes the device path (fresh destinations, the feed's thread, the
copier's slabs). Over every read path (mapped files, reads into fresh leaves, windowed gathers
of a fragmented chain, cold files read with direct I/O): no blob is handed over before its
bytes are final, the restore is bitwise, and damage or a failed copy stops the feed."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import cryosnap
from cryosnap._state import DeviceFeed
from cryosnap._state import device as _device
from cryosnap.engine import _read
from cryosnap.engine.fetch import _gather
from cryosnap.storage import LocalStore
from cryosnap.testing import FaultyStore

from ..support import assert_same, evict

CHUNK = 64 << 10
MIB = 1 << 20


class _Recording(DeviceFeed):
    """A feed that keeps, for each group the reader says is ready, a copy of its sources'
    bytes at that moment (they must be final by then)."""

    made: ClassVar[list[_Recording]] = []

    def __init__(self, groups: Any, **kw: Any) -> None:
        self.groups = groups
        self.seen: dict[int, list[torch.Tensor]] = {}
        super().__init__(groups, **kw)
        _Recording.made.append(self)

    def ready(self, key: int) -> None:
        if key in self.groups and key not in self.seen:
            self.seen[key] = [src.clone() for src, _dst in self.groups[key]]
        super().ready(key)


def _feed_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cryosnap-device"]


@pytest.fixture
def feeds(monkeypatch: pytest.MonkeyPatch) -> list[_Recording]:
    monkeypatch.setattr(_read, "_pipelined", lambda device: True)
    monkeypatch.setattr(_read, "DeviceFeed", _Recording)
    _Recording.made = []
    return _Recording.made


def _state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    base = torch.from_numpy(rng.standard_normal(5000).astype(np.float32))
    return {
        "big": torch.from_numpy(rng.standard_normal(MIB + 3).astype(np.float32)),
        "half": torch.from_numpy(rng.standard_normal(300_000).astype(np.float32)).bfloat16(),
        "w": torch.nn.Parameter(torch.from_numpy(rng.standard_normal((64, 33)).astype(np.float32))),
        "small": [torch.full((7,), float(i)) for i in range(300)],  # packed
        "a": base[:4000],  # two views of one storage
        "b": base[1000:].view(40, 100)[:, ::3],
        "arr": rng.standard_normal(20_000),  # not a torch leaf: stays on the host
        "step": 3,
    }


def _check(saved: dict[str, Any], out: dict[str, Any], feeds: list[_Recording]) -> None:
    assert_same(saved, out)
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    assert type(out["w"]) is torch.nn.Parameter
    _handed_over_final(feeds)


def _handed_over_final(feeds: list[_Recording]) -> _Recording:
    """The one feed of the restore: every blob went while the reads went on, each with the
    bytes it ends with; its thread is gone."""
    (feed,) = feeds
    assert feed.late == 0
    assert set(feed.seen) == set(feed._jobs)
    for key, clones in feed.seen.items():
        for clone, (_src, dst) in zip(clones, feed.groups[key], strict=True):
            assert torch.equal(clone.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8))
    assert not _feed_threads()
    return feed


@pytest.mark.parametrize("store_kind", ["mapped", "read"])
def test_a_pipelined_restore_hands_over_each_blob_once_final(
    tmp_path: Path, feeds: list[_Recording], store_kind: str
) -> None:
    saved = _state()
    cryosnap.save(tmp_path, saved, step=1, chunk_bytes=CHUNK)
    # A wrapper that injects faults has no map_file: its chunks are read into fresh leaves.
    store = LocalStore(tmp_path) if store_kind == "mapped" else FaultyStore(LocalStore(tmp_path))
    out = cryosnap.load(store, step=1, map_location="cpu")
    _check(saved, out, feeds)
    # The leaves are the feed's destinations, not the host leaves it copied from.
    dsts = {dst.untyped_storage().data_ptr() for g in feeds[0].groups.values() for _s, dst in g}
    assert out["big"].untyped_storage().data_ptr() in dsts


@pytest.mark.parametrize("keys", [None, ["big", "small"]])
def test_a_checkpointer_restore_to_the_device_is_pipelined(
    tmp_path: Path, feeds: list[_Recording], keys: list[str] | None
) -> None:
    saved = _state(1)
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(4, saved).result()
        out = ckpt.restore(keys=keys, map_location="cpu")
    if keys is None:
        _check(saved, out, feeds)
        return
    # A selective restore copies only the leaves of its keys.
    assert_same({k: saved[k] for k in keys}, out)
    feed = _handed_over_final(feeds)
    moved = sum(s.numel() * s.element_size() for g in feed.groups.values() for s, _d in g)
    assert moved == (MIB + 3) * 4 + 300 * 7 * 4


@pytest.mark.parametrize("store_kind", ["mapped", "read"])
def test_a_fragmented_chain_hands_over_its_gathered_blob_once_final(
    tmp_path: Path, feeds: list[_Recording], monkeypatch: pytest.MonkeyPatch, store_kind: str
) -> None:
    gathers = []
    real = _gather.Gatherer.run

    def run(self: _gather.Gatherer, number: int, task: Any) -> None:
        gathers.append(task.blob)
        real(self, number, task)

    monkeypatch.setattr(_gather.Gatherer, "run", run)
    rng = np.random.default_rng(5)
    arr = torch.from_numpy(rng.standard_normal(1_000_003).astype(np.float32))
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=4096, full_every=16) as ckpt:
        for step in range(5):
            arr[torch.from_numpy(rng.choice(arr.numel(), 400, replace=False))] += 1
            ckpt.save(step, {"x": arr, "other": _state(step)["big"]}).result()
    store = LocalStore(tmp_path) if store_kind == "mapped" else FaultyStore(LocalStore(tmp_path))
    out = cryosnap.load(store, step=4, map_location="cpu")
    assert torch.equal(out["x"], arr)
    assert gathers  # the windowed gather path read some of it
    _handed_over_final(feeds)


def test_a_cold_restore_hands_over_each_blob_once_final(
    direct_dir: Path, feeds: list[_Recording]
) -> None:
    saved = _state(2)
    cryosnap.save(direct_dir, saved, step=1, chunk_bytes=CHUNK)
    evict(direct_dir)
    out = cryosnap.load(direct_dir, step=1, map_location="cpu")
    _check(saved, out, feeds)


@pytest.mark.parametrize("store_kind", ["mapped", "read"])
def test_damage_stops_the_feed_and_never_hands_over_the_damaged_blob(
    tmp_path: Path, feeds: list[_Recording], store_kind: str
) -> None:
    saved = _state(3)
    cryosnap.save(tmp_path, saved, step=1, chunk_bytes=CHUNK)
    data = max((tmp_path / "data").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    raw = bytearray(data.read_bytes())
    big = saved["big"].numpy().tobytes()
    at = raw.find(big[CHUNK * 3 : CHUNK * 3 + 64])
    assert at >= 0
    raw[at + 5] ^= 0xFF
    data.write_bytes(bytes(raw))
    store = LocalStore(tmp_path) if store_kind == "mapped" else FaultyStore(LocalStore(tmp_path))
    with pytest.raises(cryosnap.IntegrityError, match="leaf big: chunk 3"):
        cryosnap.load(store, step=1, map_location="cpu")
    (feed,) = feeds
    big_blobs = [
        k for k, pairs in feed.groups.items() if any(s.numel() == MIB + 3 for s, _d in pairs)
    ]
    assert big_blobs and not set(big_blobs) & set(feed.seen)
    assert not _feed_threads()


def test_a_failed_copy_fails_the_restore_and_stops_the_feed(
    tmp_path: Path, feeds: list[_Recording], monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _state(4)
    cryosnap.save(tmp_path, saved, step=1, chunk_bytes=CHUNK)
    calls = []
    real = _device._Copier.add

    def add(self: Any, job: Any) -> None:
        calls.append(job.nbytes)
        if len(calls) == 3:
            raise RuntimeError("CUDA error: out of memory (injected)")
        real(self, job)

    monkeypatch.setattr(_device._Copier, "add", add)
    with pytest.raises(RuntimeError, match="injected"):
        cryosnap.load(tmp_path, step=1, map_location="cpu")
    assert not _feed_threads()
    # The run is as it was: the next restore reads it.
    monkeypatch.setattr(_device._Copier, "add", real)
    assert_same(saved, cryosnap.load(tmp_path, step=1, map_location="cpu"))


def test_a_state_without_tensors_makes_no_feed_thread(
    tmp_path: Path, feeds: list[_Recording]
) -> None:
    cryosnap.save(tmp_path, {"arr": np.arange(10), "n": 1}, step=1)
    out = cryosnap.load(tmp_path, step=1, map_location="cpu")
    assert out["n"] == 1 and np.array_equal(out["arr"], np.arange(10))
    (feed,) = feeds
    assert not feed._jobs and feed.late == 0


@pytest.mark.parametrize("store_kind", ["mapped", "read"])
def test_a_state_dict_in_columns_is_moved_leaf_by_leaf(
    tmp_path: Path, feeds: list[_Recording], store_kind: str
) -> None:
    """The fresh leaves a dict node in columns allocates in bulk are handed to the feed leaf
    by leaf (each a copy of its own), Parameters staying Parameters."""
    g = torch.Generator().manual_seed(3)
    model: dict[str, Any] = {f"l{i}": torch.randn(i % 5 + 1, 3, generator=g) for i in range(40)}
    model["l0"] = torch.nn.Parameter(model["l0"])
    model["big"] = torch.randn(MIB // 2, generator=g)
    saved = {"model": model, "step": 2}
    cryosnap.save(tmp_path, saved, step=1, chunk_bytes=CHUNK)
    doc = json.loads((tmp_path / "versions" / f"{1:012d}" / "rank-00000.json").read_bytes())
    assert "cols" in doc["tree"]["v"][0]
    store = LocalStore(tmp_path) if store_kind == "mapped" else FaultyStore(LocalStore(tmp_path))
    out = cryosnap.load(store, step=1, map_location="cpu")
    assert_same(saved, out)
    feed = _handed_over_final(feeds)
    moved = {dst.untyped_storage().data_ptr() for grp in feed.groups.values() for _s, dst in grp}
    assert all(t.untyped_storage().data_ptr() in moved for t in out["model"].values())
