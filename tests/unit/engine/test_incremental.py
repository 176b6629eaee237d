"""Incremental versions: only new content is written, chains restore exactly, gc is safe."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap import engine
from cryosnap._format.chunks import hash_chunks
from cryosnap.storage import LocalStore

CHUNK = 4096


def _chunk_digests(state: dict[str, np.ndarray]) -> list[bytes]:
    out = []
    for arr in state.values():
        raw = hash_chunks(memoryview(arr.reshape(-1).view(np.uint8)), CHUNK)
        out.extend(raw[i : i + 16] for i in range(0, len(raw), 16))
    return out


updates = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 49_999),
        st.integers(1, 3000),
        st.floats(-5, 5, allow_nan=False, width=32),
    ),
    max_size=6,
)


@settings(max_examples=25)
@given(st.integers(0, 2**32 - 1), st.lists(updates, min_size=1, max_size=7))
def test_written_chunks_are_exactly_the_new_content(seed: int, steps: list) -> None:
    rng = np.random.default_rng(seed)
    state = {
        "a": rng.standard_normal(50_000).astype(np.float32),
        "b": np.zeros(50_000, np.float32),  # many identical chunks: stored once
        "c": rng.integers(0, 3, 50_000).astype(np.float32),
    }
    snaps = []
    with tempfile.TemporaryDirectory() as d:
        seen: set[bytes] = set()
        with cryosnap.Checkpointer(d, chunk_bytes=CHUNK, full_every=100) as ckpt:
            for step, changes in enumerate([[], *steps]):
                for name, start, length, value in changes:
                    state[name][start : start + length] = value
                digests = _chunk_digests(state)
                new = set(digests) - seen
                info = ckpt.save(step, state).result()
                assert info.new_chunks == len(new)
                sizes = {}
                for arr in state.values():
                    raw = memoryview(arr.reshape(-1).view(np.uint8))
                    for lo in range(0, raw.nbytes, CHUNK):
                        sizes[hash_chunks(raw[lo : lo + CHUNK], CHUNK)] = len(raw[lo : lo + CHUNK])
                assert info.written_bytes == sum(sizes[h] for h in new)
                assert info.incremental == (step > 0)
                seen |= new
                snaps.append({k: v.copy() for k, v in state.items()})
        for step, snap in enumerate(snaps):
            out = cryosnap.load(d, step=step)
            for k, v in snap.items():
                np.testing.assert_array_equal(out[k], v)


@settings(max_examples=20)
@given(st.integers(0, 2**32 - 1), st.integers(2, 12), st.integers(1, 5), st.data())
def test_gc_of_any_subset_keeps_the_rest_restorable(
    seed: int, nversions: int, full_every: int, data: st.DataObject
) -> None:
    rng = np.random.default_rng(seed)
    arr = rng.standard_normal(40_000).astype(np.float32)
    snaps = {}
    with tempfile.TemporaryDirectory() as d:
        with cryosnap.Checkpointer(d, chunk_bytes=CHUNK, full_every=full_every) as ckpt:
            for step in range(nversions):
                idx = rng.integers(0, arr.size, 50)
                arr[idx] += 1
                ckpt.save(step, {"x": arr, "step": step}).result()
                snaps[step] = arr.copy()
        drop = data.draw(st.sets(st.sampled_from(sorted(snaps))))
        store = LocalStore(d)
        assert engine.retire(store, drop=sorted(drop)) == sorted(drop)
        assert engine.list_steps(store) == sorted(set(snaps) - drop)
        for step in sorted(set(snaps) - drop):
            out = cryosnap.load(d, step=step)
            np.testing.assert_array_equal(out["x"], snaps[step])
            engine.verify_part(store, step)
        # Nothing unreferenced remains.
        referenced = {
            f for s in engine.list_steps(store) for f in engine.read_commit(store, s).data_files
        }
        assert set(store.list("data")) == referenced


def test_chain_is_bounded_by_full_every(tmp_path: Path) -> None:
    arr = np.arange(100_000, dtype=np.float64)
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, full_every=3) as ckpt:
        kinds = []
        for step in range(8):
            arr[step * 10] = -1
            kinds.append(ckpt.save(step, {"x": arr}).result().incremental)
    assert kinds == [False, True, True, False, True, True, False, True]
    store = LocalStore(tmp_path)
    assert engine.read_commit(store, 5).chain == (3, 4, 5)


def test_incremental_false_writes_every_version_in_full(tmp_path: Path) -> None:
    arr = np.ones(10_000)
    with cryosnap.Checkpointer(tmp_path, incremental=False, chunk_bytes=CHUNK) as ckpt:
        infos = [ckpt.save(s, {"x": arr}).result() for s in range(3)]
    assert [i.incremental for i in infos] == [False] * 3
    # Identical chunks inside one version are still stored once.
    assert all(i.written_bytes == CHUNK + arr.nbytes % CHUNK for i in infos)


def test_compact_metadata_grows_with_changes_not_state(tmp_path: Path) -> None:
    table = np.random.default_rng(0).standard_normal((16_384, 64)).astype(np.float32)  # 4 MiB
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(0, {"emb": table}).result()
        table[100:104] += 1  # one region
        info = ckpt.save(1, {"emb": table}).result()
    manifest = (tmp_path / "versions" / f"{1:012d}" / "rank-00000.json").read_bytes()
    doc = json.loads(manifest)
    (blob,) = doc["blobs"]
    assert len(blob[2]) == 3  # inherited run, the changed chunk, inherited run
    assert info.new_chunks == 1
    full = (tmp_path / "versions" / f"{0:012d}" / "rank-00000.json").stat().st_size
    assert len(manifest) < full / 20


def test_resume_continues_the_chain(tmp_path: Path) -> None:
    arr = np.arange(50_000, dtype=np.float32)
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(0, {"x": arr}).result()
    arr[7] = -7
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        info = ckpt.save(1, {"x": arr}).result()
    assert info.incremental and info.new_chunks == 1
    np.testing.assert_array_equal(cryosnap.load(tmp_path)["x"], arr)


def test_keep_reclaims_space(tmp_path: Path) -> None:
    arr = np.zeros(200_000, np.float32)
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, keep=2, full_every=2) as ckpt:
        for step in range(6):
            arr[:] = step  # everything changes
            ckpt.save(step, {"x": arr}).result()
        assert ckpt.steps() == [4, 5]
    store = LocalStore(tmp_path)
    assert len(store.list("data")) == 2
    assert {k.split("/")[1] for k in store.list("versions")} == {f"{4:012d}", f"{5:012d}"}


def test_damaged_base_manifest_is_detected(tmp_path: Path) -> None:
    arr = np.arange(30_000, dtype=np.float32)
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(0, {"x": arr}).result()
        arr[0] = 5
        ckpt.save(1, {"x": arr}).result()
    path = tmp_path / "versions" / f"{0:012d}" / "rank-00000.json"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(cryosnap.IntegrityError, match="step 1"):
        cryosnap.load(tmp_path, step=1)


def test_fragmented_chain_restores_exactly_and_detects_damage(tmp_path: Path) -> None:
    # Scattered single-value changes over a chain: the last version's chunks lie in more runs
    # than the piece-by-piece reader handles (the windowed gather path), and the blob's size is
    # not a multiple of the chunk size (its short last chunk takes the other path).
    rng = np.random.default_rng(5)
    arr = rng.standard_normal(1_000_003).astype(np.float32)
    snaps = {}
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, full_every=16) as ckpt:
        for step in range(5):
            arr[rng.choice(arr.size, 400, replace=False)] += 1
            arr[-1] += 1
            ckpt.save(step, {"x": arr}).result()
            snaps[step] = arr.copy()
    store = LocalStore(tmp_path)
    part = engine.resolve_version(store, 4)
    blob = part.blobs[0]
    runs = 1 + int(np.count_nonzero(np.diff(blob.offsets) != CHUNK))
    assert runs > engine.ReadLimits().fragmented_runs
    for step, snap in snaps.items():
        np.testing.assert_array_equal(cryosnap.load(tmp_path, step=step)["x"], snap)
    # Damage in a chunk the last version still takes from the base's data file is found
    # through the chain.
    base_key = engine.read_commit(store, 0).data_files[0]
    live = np.flatnonzero(blob.files == part.files.index(base_key))
    assert len(live)
    base_file = tmp_path / base_key
    raw = bytearray(base_file.read_bytes())
    raw[int(blob.offsets[live[len(live) // 2]]) + 7] ^= 0xFF
    base_file.write_bytes(bytes(raw))
    with pytest.raises(cryosnap.IntegrityError, match="leaf x"):
        cryosnap.load(tmp_path, step=4)


def _resolve_by_segments(store: LocalStore, step: int) -> list[list[tuple[str, int, bytes]]]:
    """The oracle: each version's chunks, segment by segment in plain Python, up the chain."""
    from cryosnap._format.blobs import Inherited

    record = engine.read_commit(store, step)
    manifests = {}
    for s in record.chain:
        manifests[s] = engine.read_manifest(store, engine.read_commit(store, s), 0)[0]
    resolved: list[list[tuple[str, int, bytes]]] = []
    for s in record.chain:
        m = manifests[s]
        cb = m.chunk_bytes
        blobs = []
        for entry in m.blobs:
            chunks: list[tuple[str, int, bytes]] = []
            for seg in entry.segments:
                if isinstance(seg, Inherited):
                    chunks.extend(resolved[seg.blob][seg.first : seg.first + seg.count])
                else:
                    for k in range(len(seg.hashes) // 16):
                        chunks.append(
                            (
                                m.data_files[seg.file],
                                seg.offset + k * cb,
                                seg.hashes[k * 16 : (k + 1) * 16],
                            )
                        )
            blobs.append(chunks)
        resolved = blobs
    return resolved


def test_chain_resolution_matches_a_segment_by_segment_oracle(tmp_path: Path) -> None:
    # Several blobs (an empty one, a short last chunk, one that appears only later, repeated
    # content de-duplicated across versions) along a chain of scattered changes.
    rng = np.random.default_rng(11)
    state: dict[str, np.ndarray] = {
        "a": rng.standard_normal(70_001).astype(np.float32),
        "b": np.zeros(20_000, np.float32),
        "empty": np.zeros(0, np.float32),
        "c": rng.integers(0, 4, 9_000).astype(np.int8),
    }
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK, full_every=16) as ckpt:
        for step in range(6):
            if step:
                state["a"][rng.choice(70_001, 60, replace=False)] += 1
                state["b"][rng.integers(0, 20_000) :][:3000] = step % 2  # back to old content
                state["c"][-5:] += 1
            if step == 3:
                state["d"] = state["a"][:5000].copy()  # content stored before
            ckpt.save(step, state).result()
    store = LocalStore(tmp_path)
    for step in range(6):
        part = engine.resolve_version(store, step)
        oracle = _resolve_by_segments(store, step)
        assert part.chain == engine.read_commit(store, step).chain
        assert len(part.blobs) == len(oracle)
        for blob, want in zip(part.blobs, oracle, strict=True):
            got = [
                (part.files[f], o, h.tobytes())
                for f, o, h in zip(
                    blob.files.tolist(), blob.offsets.tolist(), blob.hashes, strict=True
                )
            ]
            assert got == want


def test_inheriting_chunks_the_base_lacks_is_a_format_error(tmp_path: Path) -> None:
    arr = np.arange(30_000, dtype=np.float32)
    with cryosnap.Checkpointer(tmp_path, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(0, {"x": arr}).result()
        arr[0] = 5
        ckpt.save(1, {"x": arr}).result()
    store = LocalStore(tmp_path)
    base = engine.resolve_version(store, 0)
    manifest, ref = engine.read_manifest(store, engine.read_commit(store, 1), 0)
    entry = manifest.blobs[0]
    table = entry.table.copy()
    inherited = np.flatnonzero(table[:, 0] == 1)
    for column, value, match in ((2, 10**6, "blob 0 inherits"), (1, 3, "blob 0 inherits")):
        bad = table.copy()
        bad[inherited[-1], column] = value
        broken = dataclasses.replace(manifest, blobs=(dataclasses.replace(entry, table=bad),))
        with pytest.raises(cryosnap.CheckpointFormatError, match=match):
            engine._resolve_one(broken, ref.key, ref.xxh3, base, "here")
    with pytest.raises(cryosnap.CheckpointFormatError, match="base of step 1"):
        engine._resolve_one(manifest, ref.key, ref.xxh3, None, "here")


def test_prefault_zeroes_only_while_the_block_runs() -> None:
    big = np.full(3 << 20, 7, np.uint8)
    small = np.full(100, 7, np.uint8)
    with engine._prefaulted([memoryview(big), memoryview(small)]):
        pass
    # Stopped at any point: whatever it wrote is zeros, the small view is left alone.
    assert set(np.unique(big).tolist()) <= {0, 7}
    assert (small == 7).all()
    with engine._prefaulted([]):
        pass
