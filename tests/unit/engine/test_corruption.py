"""Damaged checkpoints: every flipped byte is caught and named; unsafe manifests are refused.

The run is reached through its Store (``open_store``), so the same tests damage a local
directory and an fsspec ``memory://`` run. Tests restore what they damage.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap._format.keys import commit_key, manifest_key
from cryosnap._format.manifest import Manifest
from cryosnap.storage import Store, open_store

from ..support import assert_same, commit_checksum, rewrite_version, snapshot

STEP = 7
OLD_STEP = 5


def make_state() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    w = torch.from_numpy(rng.standard_normal(3000).astype(np.float32))  # 12000 B: 3 chunks
    return {
        "weights": w,
        "embed": {"table": rng.standard_normal((50, 50))},  # 20000 B: 5 chunks
        "blob": rng.bytes(5000),  # 2 chunks
        "opt": [torch.arange(10), {3: torch.ones(2, 2, dtype=torch.bfloat16)}],
        "tied": {"a": w[100:2000], "b": w[1000:3000]},  # shares the weights' storage
        "small": np.arange(3, dtype=np.int16),
        "name": "run",
        "step": 7,
    }


def _blob_paths(node: Any, path: tuple[Any, ...], out: dict[int, str]) -> None:
    """Leaf path of each blob: the first leaf, in tree order, that references it."""
    t = node["t"]
    if t in ("dict", "odict"):
        for k, v in zip(node["k"], node["v"], strict=True):
            _blob_paths(v, (*path, k), out)
    elif t in ("list", "tuple"):
        for i, v in enumerate(node["v"]):
            _blob_paths(v, (*path, i), out)
    elif t == "stateful":
        _blob_paths(node["v"], path, out)
    elif "b" in node:
        out.setdefault(node["b"], "/".join(map(str, path)))


@dataclass
class Run:
    location: str
    store: Store
    data_key: str
    data: bytes
    owners: list[str]  # leaf path owning each byte of the data file
    chunk_starts: list[int]  # file offset of every chunk

    def read(self, key: str) -> bytes:
        return self.store.read(key)

    def write(self, key: str, data: bytes) -> None:
        root = self.store.capabilities.local_path
        if root is not None:
            # Damage in place, without the store's fsyncs: hundreds of cases stay fast.
            (root / key).write_bytes(data)
        else:
            self.store.write(key, data)


def _describe(location: str) -> Run:
    store = open_store(location)
    record = json.loads(store.read(commit_key(STEP)))
    body = store.read(manifest_key(STEP, 0))
    manifest = Manifest.from_json(body, "test")
    (data_key,) = manifest.data_files
    data = store.read(data_key)
    paths: dict[int, str] = {}
    _blob_paths(manifest.skeleton, (), paths)
    owners = [""] * len(data)
    starts = []
    for i, blob in enumerate(manifest.blobs):
        # Runs of chunks stored back to back in a data file ("extents" or stored "segments").
        runs = getattr(blob, "extents", None) or getattr(blob, "segments", ())
        for e in runs:
            assert e.file == 0 and e.nbytes > 0
            owners[e.offset : e.offset + e.nbytes] = [paths[i]] * e.nbytes
            starts.extend(range(e.offset, e.offset + e.nbytes, manifest.chunk_bytes))
    assert record["data_files"] == [data_key]
    # Every byte of the data file belongs to a leaf, but for the zeros that align a blob of a
    # page or more to 64 bytes (docs/FORMAT.md).
    free = [i for i, owner in enumerate(owners) if not owner]
    for i in free:
        assert data[i] == 0 and owners[-(-(i + 1) // 64) * 64] and i % 64 > 0, i
    return Run(location, store, data_key, data, owners, starts)


def _cleanup_memory(url: str) -> None:
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["local", "memory"])
def run(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Run]:
    location = str(tmp_path / "run") if request.param == "local" else f"memory://{uuid.uuid4()}"
    cryosnap.save(location, make_state(), step=STEP, chunk_bytes=4096)
    yield _describe(location)
    if request.param == "memory":
        _cleanup_memory(location)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One local run for the Hypothesis test (which restores every byte it flips)."""
    location = str(tmp_path_factory.mktemp("corrupt") / "run")
    cryosnap.save(location, make_state(), step=STEP, chunk_bytes=4096)
    return _describe(location)


def _assert_flip_caught(run: Run, pos: int, xor: int = 0xFF) -> None:
    """A flipped byte of a leaf is caught, naming the leaf; one of the alignment padding
    (no leaf's) changes nothing."""
    damaged = bytearray(run.data)
    damaged[pos] ^= xor
    run.write(run.data_key, bytes(damaged))
    if not run.owners[pos]:
        try:
            assert_same(make_state(), cryosnap.load(run.location, step=STEP))
        finally:
            run.write(run.data_key, run.data)
        return
    try:
        with pytest.raises(cryosnap.IntegrityError) as info:
            cryosnap.load(run.location, step=STEP)
    finally:
        run.write(run.data_key, run.data)
    msg = str(info.value)
    assert f"step {STEP}" in msg, msg
    # A pack of small tensors is named by its first tensor, and how many share it.
    assert re.search(
        rf"leaf {re.escape(run.owners[pos])}( \(packed with \d+ more tensors?\))?:", msg
    ), (
        pos,
        msg,
    )
    assert run.store.url in msg, msg


def test_layout_is_what_the_tests_assume(run: Run) -> None:
    owners = set(run.owners)
    assert {"weights", "embed/table", "blob", "opt/0", "small"} <= owners
    assert "tied/a" not in owners  # the tied views live in the weights' blob
    assert "opt/1/3" not in owners  # a small tensor, packed with opt/0
    assert len(run.chunk_starts) >= 12
    assert_same(make_state(), cryosnap.load(run.location))


def test_every_chunk_detects_a_flipped_byte(run: Run) -> None:
    ends = sorted({*run.chunk_starts, len(run.data)})
    positions = {0, len(run.data) - 1}
    for lo, hi in itertools.pairwise(ends):
        positions |= {lo, (lo + hi) // 2, hi - 1}
    for pos in sorted(positions):
        _assert_flip_caught(run, pos, xor=0x01 if pos % 2 else 0x80)
    assert_same(make_state(), cryosnap.load(run.location))  # everything was restored


@settings(max_examples=40)
@given(data=st.data())
def test_any_flipped_byte_is_caught(shared_run: Run, data: st.DataObject) -> None:
    pos = data.draw(st.integers(0, len(shared_run.data) - 1), label="pos")
    xor = data.draw(st.integers(1, 255), label="xor")
    _assert_flip_caught(shared_run, pos, xor)


def test_damage_leaves_into_untouched(run: Run) -> None:
    into = make_state()
    into["weights"] = torch.zeros(3000)
    into["embed"]["table"] = np.zeros((50, 50))
    into["tied"] = {"a": into["weights"][100:2000], "b": into["weights"][1000:3000]}
    before = snapshot(into)
    damaged = bytearray(run.data)
    damaged[-1] ^= 0xFF
    run.write(run.data_key, bytes(damaged))
    with pytest.raises(cryosnap.IntegrityError):
        cryosnap.load(run.location, step=STEP, into=into)
    assert snapshot(into) == before


@pytest.mark.parametrize("keep", [0, 1, 4096, 10000, -1])
def test_truncated_data_file(run: Run, keep: int) -> None:
    run.write(run.data_key, run.data[:keep])
    with pytest.raises(cryosnap.IntegrityError, match=rf"step {STEP}.*truncated"):
        cryosnap.load(run.location, step=STEP)


def test_truncated_data_file_names_the_leaf_that_is_cut(run: Run) -> None:
    run.write(run.data_key, run.data[:-1])
    with pytest.raises(cryosnap.IntegrityError) as info:
        cryosnap.load(run.location, step=STEP)
    assert f"leaf {run.owners[-1]} " in str(info.value)


def test_missing_data_file(run: Run) -> None:
    run.store.delete(run.data_key)
    with pytest.raises(cryosnap.IntegrityError, match=rf"step {STEP}.*missing"):
        cryosnap.load(run.location, step=STEP)


def test_any_flipped_manifest_byte_is_caught(run: Run) -> None:
    key = manifest_key(STEP, 0)
    body = run.read(key)
    for pos in range(0, len(body), 7):
        damaged = bytearray(body)
        damaged[pos] ^= 0x01 if pos % 2 else 0x20
        run.write(key, bytes(damaged))
        with pytest.raises(cryosnap.IntegrityError, match=rf"step {STEP}.*{key}"):
            cryosnap.load(run.location, step=STEP)
    run.write(key, body[:-1])
    with pytest.raises(cryosnap.IntegrityError, match=rf"step {STEP}"):
        cryosnap.load(run.location, step=STEP)


def _same_document(a: bytes, b: bytes) -> bool:
    """Whether two commit records parse to the same JSON document (the checksum covers that)."""
    try:
        return bool(json.loads(a) == json.loads(b))
    except ValueError:
        return False


def test_any_flipped_commit_byte_is_caught(run: Run) -> None:
    key = commit_key(STEP)
    body = run.read(key)
    for pos in range(len(body)):
        damaged = bytearray(body)
        damaged[pos] ^= 0x01 if pos % 3 else 0x80
        if _same_document(bytes(damaged), body):
            continue  # e.g. the 17th digit of a float that parses to the same double
        run.write(key, bytes(damaged))
        with pytest.raises(cryosnap.CheckpointFormatError, match=key):
            cryosnap.load(run.location, step=STEP)
    run.write(key, body[: len(body) // 2])
    with pytest.raises(cryosnap.CheckpointFormatError, match=key):
        cryosnap.load(run.location, step=STEP)


def test_missing_commit_record_hides_the_version(run: Run) -> None:
    run.store.delete(commit_key(STEP))
    with pytest.raises(cryosnap.CheckpointNotFoundError, match=f"step {STEP}"):
        cryosnap.load(run.location, step=STEP)
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        cryosnap.load(run.location)


def test_missing_manifest_is_damage(run: Run) -> None:
    cryosnap.save(run.location, {"old": 1}, step=OLD_STEP)
    run.store.delete(manifest_key(STEP, 0))
    with pytest.raises(cryosnap.IntegrityError, match=f"step {STEP}"):
        cryosnap.load(run.location, step=STEP)
    with pytest.warns(RuntimeWarning, match=f"step {STEP}"):
        assert cryosnap.load(run.location) == {"old": 1}


# ---------------------------------------------------------------------------------------------
# rewritten (not damaged) documents: hashes and checksum recomputed, so only validation can catch


def _rewrite(
    run: Run, *, manifest: dict[str, Any] | None = None, commit: dict[str, Any] | None = None
) -> None:
    """Replace fields of the manifest and/or commit record, keeping every hash consistent."""
    rewrite_version(
        run.read,
        run.write,
        STEP,
        manifest=lambda doc: doc.update(manifest or {}),
        commit=lambda doc: doc.update(commit or {}),
    )


def test_rewrite_helper_keeps_a_valid_run(run: Run) -> None:
    # Control for the tests below: a rewrite to another safe name loads fine, so in those
    # tests nothing but the path check can refuse the manifest.
    run.write("data/renamed.dat", run.data)
    _rewrite(run, manifest={"data_files": ["data/renamed.dat"]})
    assert_same(make_state(), cryosnap.load(run.location, step=STEP))
    _rewrite(run, commit={"data_files": ["data/renamed.dat"]})
    assert_same(make_state(), cryosnap.load(run.location, step=STEP))


def test_escaping_data_file_path_is_refused(tmp_path: Path) -> None:
    location = tmp_path / "deep" / "run"
    cryosnap.save(location, make_state(), step=STEP, chunk_bytes=4096)
    run = _describe(str(location))
    # Real copies of the data outside the run: without the path check, the load would succeed.
    shutil.copy(location / run.data_key, tmp_path / "outside.dat")
    for bad in ["data/../../outside.dat", str(tmp_path / "outside.dat"), "/etc/passwd"]:
        for where in ("manifest", "commit", "both"):
            _rewrite(run, manifest={"data_files": [run.data_key]}, commit={"data_files": []})
            files = {"data_files": [bad]}
            _rewrite(
                run,
                manifest=files if where in ("manifest", "both") else None,
                commit=files if where in ("commit", "both") else None,
            )
            with pytest.raises(cryosnap.CheckpointFormatError, match="data file"):
                cryosnap.load(location, step=STEP)


@pytest.mark.parametrize("bad", ["data/../x.dat", "data//x.dat", "data/./x.dat", "x.dat", 3])
def test_unsafe_data_file_names_are_refused(run: Run, bad: Any) -> None:
    _rewrite(run, manifest={"data_files": [bad]})
    with pytest.raises(cryosnap.CheckpointFormatError, match="data file"):
        cryosnap.load(run.location, step=STEP)


def test_unsafe_manifest_key_is_refused(run: Run) -> None:
    cdoc = json.loads(run.read(commit_key(STEP)))
    cdoc.pop("checksum")
    cdoc["manifests"][0]["key"] = "versions/../../../etc/passwd"
    cdoc["checksum"] = commit_checksum(cdoc)
    run.write(commit_key(STEP), json.dumps(cdoc).encode())
    with pytest.raises(cryosnap.CheckpointFormatError, match=r"unsafe.*etc/passwd"):
        cryosnap.load(run.location, step=STEP)


@pytest.mark.parametrize("doc", ["manifest", "commit"])
@pytest.mark.parametrize("version", [0, 9, "1", None, True])
def test_unknown_format_version(run: Run, doc: str, version: Any) -> None:
    # (A manifest may say 2 to 8: it holds packed tensors, files, columns, packed arrays,
    # statistics, an ancestor's data files or coded ones; a commit record 2: an ancestor's.)
    if doc == "commit" and version == 9:
        version = 3
    change = {"format_version": version}
    _rewrite(run, **{doc: change})
    with pytest.raises(cryosnap.CheckpointFormatError, match="format_version"):
        cryosnap.load(run.location, step=STEP)


def test_commit_record_of_another_step_is_refused(run: Run) -> None:
    cryosnap.save(run.location, {"old": 1}, step=OLD_STEP)
    run.write(commit_key(STEP), run.read(commit_key(OLD_STEP)))
    with pytest.raises(cryosnap.CheckpointFormatError, match=f"step {OLD_STEP}"):
        cryosnap.load(run.location, step=STEP)


# ---------------------------------------------------------------------------------------------
# versions: fallback past damage, missing runs and steps, no overwrite


def test_newest_damaged_falls_back_with_warning(run: Run) -> None:
    cryosnap.save(run.location, {"old": torch.ones(3)}, step=OLD_STEP)
    damaged = bytearray(run.data)
    damaged[len(damaged) // 2] ^= 0xFF
    run.write(run.data_key, bytes(damaged))
    with pytest.warns(RuntimeWarning, match=rf"damaged step {STEP}"):
        out = cryosnap.load(run.location)
    assert_same({"old": torch.ones(3)}, out)
    with pytest.raises(cryosnap.IntegrityError, match=f"step {STEP}"):
        cryosnap.load(run.location, step=STEP)
    assert_same({"old": torch.ones(3)}, cryosnap.load(run.location, step=OLD_STEP))


def test_every_version_damaged(run: Run) -> None:
    cryosnap.save(run.location, {"old": torch.ones(3)}, step=OLD_STEP)
    old = Manifest.from_json(run.read(manifest_key(OLD_STEP, 0)), "test").data_files[0]
    run.store.delete(old)
    run.store.delete(run.data_key)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(cryosnap.IntegrityError, match="every version"):
            cryosnap.load(run.location)
    steps = sorted(str(w.message) for w in caught if w.category is RuntimeWarning)
    assert len(steps) == 2
    assert f"step {OLD_STEP}" in steps[0] and f"step {STEP}" in steps[1]


def test_missing_run(tmp_path: Path) -> None:
    for location in [tmp_path / "nope", f"memory://{uuid.uuid4()}"]:
        with pytest.raises(cryosnap.CheckpointNotFoundError) as info:
            cryosnap.load(location)
        assert isinstance(info.value, FileNotFoundError)
        assert "no committed version" in str(info.value)
        with pytest.raises(FileNotFoundError):
            cryosnap.load(location, step=0)
    assert not (tmp_path / "nope").exists()  # reading never creates the run


def test_missing_step(run: Run) -> None:
    with pytest.raises(cryosnap.CheckpointNotFoundError, match=f"step {STEP + 1} not found"):
        cryosnap.load(run.location, step=STEP + 1)


def test_saving_an_existing_step_is_refused(run: Run) -> None:
    before = run.store.list()
    with pytest.raises(cryosnap.CheckpointExistsError, match=f"step {STEP}") as info:
        cryosnap.save(run.location, {"other": 1}, step=STEP)
    assert isinstance(info.value, FileExistsError)
    assert run.store.list() == before
    assert_same(make_state(), cryosnap.load(run.location, step=STEP))
