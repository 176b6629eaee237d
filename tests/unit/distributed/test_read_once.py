"""Read-once replicated restore (_run/read_once.py): each replicated chunk read by one rank.

Real Checkpointers on a SimulatedWorld, each rank's view of the shared run counted: at the
world size that saved, the job reads the replicated model about once (each rank its share),
every rank restores it whole and verified; ``CRYOSNAP_RESTORE_READ_ONCE=0`` reads it on every
rank; a damaged replicated chunk is still found, on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap._run.read_once import SharedReads
from cryosnap.bench._scale import CountingStore
from cryosnap.errors import IntegrityError
from cryosnap.storage import LocalStore
from cryosnap.testing import SimulatedRank, SimulatedWorld

RANKS = 4
CHUNK = 4096
MODEL = np.arange(16 * CHUNK // 4, dtype=np.float32)  # 64 KiB: 16 chunks, 4 per rank


def _save_and_restore(tmp_path: Path) -> tuple[list[Any], list[int]]:
    root = LocalStore(tmp_path / "run")
    stores = [CountingStore(root) for _ in range(RANKS)]
    world = SimulatedWorld(RANKS, timeout=60)

    def save(c: SimulatedRank) -> None:
        with cryosnap.Checkpointer(stores[c.rank], comm=c, chunk_bytes=CHUNK) as ckpt:
            ckpt.save(1, {"model": MODEL, "own": np.full(8, c.rank)}, replicated=["model"])

    world.run(save)
    for store in stores:
        store.read_bytes = 0

    def restore(c: SimulatedRank) -> Any:
        with cryosnap.Checkpointer(stores[c.rank], comm=c, chunk_bytes=CHUNK) as ckpt:
            return ckpt.restore()

    restored = world.run(restore)
    return restored, [s.read_bytes for s in stores]


@pytest.mark.timeout(120)
def test_the_job_reads_the_replicated_state_once(tmp_path: Path) -> None:
    restored, read = _save_and_restore(tmp_path)
    for rank, state in enumerate(restored):
        np.testing.assert_array_equal(state["model"], MODEL)
        np.testing.assert_array_equal(state["own"], np.full(8, rank))
    # Each rank reads its quarter of the model plus its metadata and own part (< 1 quarter).
    assert all(n < MODEL.nbytes // RANKS * 2 for n in read), read
    assert sum(read) < 2 * MODEL.nbytes


@pytest.mark.timeout(120)
def test_opting_out_reads_the_replicated_state_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CRYOSNAP_RESTORE_READ_ONCE", "0")
    restored, read = _save_and_restore(tmp_path)
    assert all(np.array_equal(s["model"], MODEL) for s in restored)
    assert all(n > MODEL.nbytes for n in read), read


@pytest.mark.timeout(120)
def test_a_damaged_replicated_chunk_is_found_on_every_rank(tmp_path: Path) -> None:
    root = LocalStore(tmp_path / "run")
    world = SimulatedWorld(RANKS, timeout=60)

    def save(c: SimulatedRank) -> None:
        with cryosnap.Checkpointer(root, comm=c, chunk_bytes=CHUNK) as ckpt:
            ckpt.save(1, {"model": MODEL, "own": np.full(8, c.rank)}, replicated=["model"])

    world.run(save)
    # Damage rank 2's data file: its share of the model, which rank 2 alone reads now.
    [victim] = [p for p in (tmp_path / "run" / "data").iterdir() if "-r00002-" in p.name]
    body = bytearray(victim.read_bytes())
    body[10] ^= 0xFF
    victim.write_bytes(bytes(body))

    def restore(c: SimulatedRank) -> str:
        with cryosnap.Checkpointer(root, comm=c, chunk_bytes=CHUNK) as ckpt:
            try:
                ckpt.restore()
            except IntegrityError as exc:
                return str(exc)
        return "restored"

    told = SimulatedWorld(RANKS, timeout=60).run(restore)
    assert all("damaged" in t for t in told), told


def test_shared_reads_serve_what_they_hold_and_read_the_gaps(tmp_path: Path) -> None:
    inner = LocalStore(tmp_path)
    inner.write("data/f.dat", bytes(range(100)))
    held = SharedReads(inner)
    # Rank 3 sent bytes 10..20 and 30..40, altered so that they show where they came from.
    head = b'[["data/f.dat",10,10],["data/f.dat",30,10]]\n'
    held.take(head + b"A" * 10 + b"B" * 10, 3)
    out = bytearray(40)
    held.read_into("data/f.dat", 5, [memoryview(out)[:20], memoryview(out)[20:]])
    assert bytes(out) == bytes(range(5, 10)) + b"A" * 10 + bytes(range(20, 30)) + b"B" * 10 + bytes(
        range(40, 45)
    )
    assert held.capabilities.local_path is None and held.held_bytes == 20
    held.take(head + b"short", 4)  # a truncated share is ignored
    assert held.held_bytes == 20
