"""Change detection on the device (fingerprint.py, _devdiff.py), run here on CPU tensors: the
same torch operations the GPU runs. It must make exactly the decisions xxh3 hashing makes, and
a version it writes must be the version the host path writes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import cryosnap  # noqa: E402
from cryosnap import engine  # noqa: E402
from cryosnap._format.keys import data_key  # noqa: E402
from cryosnap._run.capture.fingerprint import COLLISION_BOUND_LOG2, Fingerprinter  # noqa: E402
from cryosnap.errors import CheckpointError, StorageError  # noqa: E402
from cryosnap.storage import LocalStore  # noqa: E402
from cryosnap.testing import FaultyStore  # noqa: E402

CHUNK = 4096
MIB = 1 << 20


def host_changed(a: bytes, b: bytes, chunk: int) -> list[bool]:
    """Which chunks differ, by xxh3-128 as the writer hashes them."""
    return [
        xxhash.xxh3_128_digest(a[i : i + chunk]) != xxhash.xxh3_128_digest(b[i : i + chunk])
        for i in range(0, len(a), chunk)
    ]


def device_changed(f: Fingerprinter, a: Any, b: Any) -> list[bool]:
    return [bool(x) for x in (f.chunks(a) != f.chunks(b)).any(1)]


# -- fingerprints --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nbytes=st.integers(1, 9 * CHUNK + 7),
    offset=st.integers(0, 3),
    edits=st.lists(
        st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7), st.booleans()),
        max_size=6,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_fingerprints_find_exactly_the_chunks_xxh3_finds(
    nbytes: int, offset: int, edits: list[tuple[float, int, bool]], seed: int
) -> None:
    # Sparse edits of single bits (the sign bit of a float is bit 7 of its last byte) or
    # whole bytes, anywhere, in blobs of any length and alignment.
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, nbytes + offset, dtype=np.uint8)
    new = raw.copy()
    for where, bit, whole in edits:
        i = offset + int(where * nbytes)
        new[i] = (
            (int(new[i]) + 1 + int(rng.integers(0, 255))) % 256 if whole else new[i] ^ (1 << bit)
        )
    a = torch.from_numpy(raw)[offset:]
    b = torch.from_numpy(new)[offset:]
    f = Fingerprinter(CHUNK, seed=seed)
    assert device_changed(f, a, b) == host_changed(
        raw[offset:].tobytes(), new[offset:].tobytes(), CHUNK
    )


def test_fingerprints_are_keyed_and_128_bits() -> None:
    data = torch.arange(4 * CHUNK, dtype=torch.uint8)
    one, two = Fingerprinter(CHUNK), Fingerprinter(CHUNK)
    fa, fb = one.chunks(data), two.chunks(data)
    assert fa.shape == (4, 2) and fa.dtype == torch.int64
    assert not torch.equal(fa, fb)  # a key of its own per instance (os.urandom)
    assert torch.equal(one.chunks(data.clone()), fa)  # same content, same fingerprint
    assert COLLISION_BOUND_LOG2 == -82
    assert one.chunks(torch.empty(0, dtype=torch.uint8)).shape == (0, 2)


def test_every_single_bit_flip_of_a_chunk_is_seen() -> None:
    f = Fingerprinter(CHUNK, seed=7)
    base = torch.from_numpy(np.random.default_rng(1).integers(0, 256, CHUNK, dtype=np.uint8))
    ref = f.chunks(base)
    flipped = base.repeat(64).view(64, CHUNK).clone()
    for k in range(64):  # every bit position of a 64-bit word, at several places
        flipped[k, (k * 61) % (CHUNK - 8) + k // 8] ^= 1 << (k % 8)
    prints = f.chunks(flipped.view(-1))
    assert bool((prints != ref).any(1).all())


def test_chunk_sizes_that_are_not_whole_words_are_refused() -> None:
    with pytest.raises(ValueError, match="32-bit words"):
        Fingerprinter(4097)


# -- versions ------------------------------------------------------------------------------------


def states(steps: int, seed: int = 0) -> list[dict[str, Any]]:
    """A sequence of states with sparse changes: big tensors (device-diffed), a small one and
    an array (copied whole), a tensor that changes size, one that appears late."""
    rng = np.random.default_rng(seed)
    big = torch.from_numpy(rng.standard_normal(5 * MIB // 4).astype(np.float32))
    other = torch.from_numpy(rng.integers(0, 1 << 30, 4 * MIB // 8, dtype=np.int64))
    out = []
    for step in range(steps):
        big, other = big.clone(), other.clone()
        for _ in range(3):
            big[int(rng.integers(0, big.numel()))] += 1.0
        if step % 2:
            other[int(rng.integers(0, other.numel()))] ^= 1 << 62
        state: dict[str, Any] = {
            "big": big,
            "other": other,
            "small": torch.full((10,), float(step)),
            "arr": np.arange(100) + step,
            "resized": torch.zeros(MIB + 4096 * (step // 3), dtype=torch.uint8),
            "step": step,
        }
        if step >= 2:
            state["late"] = torch.ones(MIB, dtype=torch.int32) * (step // 4)
        out.append(state)
    return out


def save_all(
    path: Path, seq: list[dict[str, Any]], *, device_diff: bool, **kw: Any
) -> list[cryosnap.SaveInfo]:
    with cryosnap.Checkpointer(path, chunk_bytes=CHUNK * 16, device_diff=device_diff, **kw) as ckpt:
        return [ckpt.save(i, s).result() for i, s in enumerate(seq)]


def assert_same_state(got: Any, want: Any) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        elif isinstance(v, np.ndarray):
            np.testing.assert_array_equal(got[k], v)
        else:
            assert got[k] == v


def test_versions_are_the_ones_the_host_path_writes(tmp_path: Path) -> None:
    seq = states(9)
    host = save_all(tmp_path / "host", seq, device_diff=False, full_every=4)
    dev = save_all(tmp_path / "dev", seq, device_diff=True, full_every=4)
    for i, (h, d) in enumerate(zip(host, dev, strict=True)):
        if i == 0:
            # The first version a session fingerprints is full (and so is the host's first).
            assert not d.incremental and not h.incremental
        assert (d.incremental, d.chunks, d.new_chunks) == (h.incremental, h.chunks, h.new_chunks)
        assert d.written_bytes == h.written_bytes
    # Same content, same Merkle roots: the device path inherits exactly what the host path does.
    hs, ds = LocalStore(tmp_path / "host"), LocalStore(tmp_path / "dev")
    for i, state in enumerate(seq):
        assert engine.read_commit(ds, i).root == engine.read_commit(hs, i).root
        assert_same_state(cryosnap.load(tmp_path / "dev", step=i), state)
    # Only changed chunks were copied out of the tensors once a version had a base (step 2
    # adds a leaf: copied whole).
    for d in (dev[1], dev[3]):
        assert d.captured_bytes < d.logical_bytes // 3
    assert dev[4].captured_bytes == dev[4].logical_bytes  # full_every: a full version again


def test_lazy_capture_with_an_optimizer_step_after_it(tmp_path: Path) -> None:
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weight: fingerprinted
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with cryosnap.Checkpointer(tmp_path / "run", chunk_bytes=CHUNK * 16, device_diff=True) as ck:
        for step in range(3):
            before = model.weight.detach().clone()
            pending = ck.save(step, {"model": model, "opt": opt}, lazy=True)
            model(torch.randn(2, 1024)).sum().backward()
            opt.step()  # waits for the leaves it mutates
            opt.zero_grad()
            info = pending.result()
            got = cryosnap.load(tmp_path / "run", step=step)
            assert torch.equal(got["model"]["weight"], before)
        assert info.incremental


def test_a_version_captured_against_a_failed_one_fails_and_the_next_is_full(
    tmp_path: Path,
) -> None:
    seq = states(5, seed=3)
    fail_step = [1]
    gate = threading.Event()

    def fault(op: str, key: str) -> None:
        if op == "writer.commit" and key.startswith(data_key(fail_step[0], 0, "")[:-4]):
            gate.wait(60)  # until step 2 is captured against step 1
            raise StorageError(f"{key}: no space left on device (injected)")

    store = FaultyStore(LocalStore(tmp_path / "run"), fault=fault)
    ckpt = cryosnap.Checkpointer(store, chunk_bytes=CHUNK * 16, device_diff=True, max_inflight=2)
    try:
        ckpt.save(0, seq[0]).result()
        # Step 1's write fails; step 2 is captured against step 1's fingerprints before that.
        p1 = ckpt.save(1, seq[1])
        p2 = ckpt.save(2, seq[2])
        gate.set()
        with pytest.raises(CheckpointError):
            p1.result()
        with pytest.raises(
            CheckpointError, match="step 2: the chunks found unchanged on the device since step 1"
        ):
            p2.result()
        fail_step[0] = -1
        # Step 3 sees that its reference failed: captured in full, written full, correct.
        info = ckpt.save(3, seq[3]).result()
        assert not info.incremental and info.captured_bytes == info.logical_bytes
        assert ckpt.save(4, seq[4]).result().incremental
    finally:
        ckpt.close()  # both failures were received: nothing left to raise
    assert engine.list_steps(LocalStore(tmp_path / "run")) == [0, 3, 4]
    for i in (0, 3, 4):
        assert_same_state(cryosnap.load(tmp_path / "run", step=i), seq[i])


def test_saves_in_flight_take_their_turn_in_order(tmp_path: Path) -> None:
    seq = states(6, seed=5)
    with cryosnap.Checkpointer(
        tmp_path / "run", chunk_bytes=CHUNK * 16, device_diff=True, max_inflight=3
    ) as ck:
        pendings = [ck.save(i, s, lazy=bool(i % 2)) for i, s in enumerate(seq)]
        infos = [p.result() for p in pendings]
    assert [i.incremental for i in infos] == [False, True, True, True, True, True]
    for i, s in enumerate(seq):
        assert_same_state(cryosnap.load(tmp_path / "run", step=i), s)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"device_diff": "yes"}, TypeError, "device_diff must be None, True or False"),
        ({"device_diff": True, "incremental": False}, ValueError, "needs incremental=True"),
        ({"device_diff": True, "chunk_bytes": 4097}, ValueError, "whole 32-bit words"),
    ],
)
def test_device_diff_arguments(
    tmp_path: Path, kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        cryosnap.Checkpointer(tmp_path / "run", **kwargs)


def test_off_by_default_without_cuda(tmp_path: Path) -> None:
    seq = states(2)
    with cryosnap.Checkpointer(tmp_path / "run", chunk_bytes=CHUNK * 16) as ck:
        infos = [ck.save(i, s).result() for i, s in enumerate(seq)]
    if not torch.cuda.is_available():
        assert all(i.captured_bytes == i.logical_bytes for i in infos)
