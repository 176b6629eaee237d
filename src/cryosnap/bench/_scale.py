"""The scale workload: real Checkpointer saves and a restore on a SimulatedWorld of N ranks.

Each rank saves a small replicated model plus its own shard into one run (a temporary folder);
the world counts what each rank sends and receives per save, a counting store wrapper what each
rank reads on restore. Runs on the caller's thread; the ranks are the world's threads.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cryosnap._format.commit import CommitRecord
from cryosnap._format.keys import commit_key, manifest_key
from cryosnap.checkpointer import Checkpointer
from cryosnap.engine import read_commit
from cryosnap.errors import BenchError
from cryosnap.storage import LocalStore
from cryosnap.storage._wrap import WrapperStore
from cryosnap.testing import SimulatedRank, SimulatedWorld

__all__ = ["SCALE_RANKS", "ScaleFigures", "measure_scale", "parse_ranks"]

SCALE_RANKS = (64, 512, 4096)

# Per rank state, tiny so that 4,096 Checkpointers fit one process: a replicated model of 16 KiB
# (each rank writes 1/N of it) and a 256-byte shard of its own.
_MODEL_FLOATS = 4096
_SHARD_INTS = 32
_CHUNK_BYTES = 4096
# Each rank's threads (the Checkpointer's and the store's) get small stacks: thousands of them.
_STACK_BYTES = 512 << 10
_TIMEOUT_SECONDS = 3600.0


@dataclass(frozen=True)
class ScaleFigures:
    """One world size's figures (the keys of ``cryosnap bench --workload scale --json``).

    Per save (the second one, which also retires the first: ``keep=1``, the steady state of a
    run under retention): the largest bytes any rank sent and received,
    the collectives each rank took part in, and the CPU seconds of the leader's (rank 0's)
    threads. ``restore_read_bytes_per_rank``: the most any rank but the leader read from the
    store to restore (the leader also reads the whole commit record, O(N):
    ``leader_restore_read_bytes``). ``metadata_bytes_per_rank``: the largest rank's manifest
    plus its entry of the commit record (what the leader hands it: the metadata a rank reads
    or receives to restore its part); ``commit_bytes``: the whole record on disk. The
    ``but_leader`` figures leave rank 0 out (it gathers: its receive is the largest).
    """

    ranks: int
    max_sent_bytes_per_rank: int
    max_received_bytes_per_rank: int
    rounds: int
    leader_seconds: float
    restore_read_bytes_per_rank: int
    metadata_bytes_per_rank: int
    max_sent_bytes_but_leader: int
    max_received_bytes_but_leader: int
    manifest_bytes_per_rank: int
    commit_bytes: int
    save_seconds: float
    leader_restore_read_bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_ranks(text: str) -> list[int]:
    """``"64,512,4096"`` as world sizes; a ``BenchError`` naming the bad part otherwise."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1 or int(part) > 99_999:
            raise BenchError(
                f"--ranks {text!r}: {part!r} is not a world size (allowed: integers 1 .. 99999, "
                "comma-separated)"
            )
        out.append(int(part))
    return out


class CountingStore(WrapperStore):
    """One rank's view of the shared run: the bytes it reads (restore's cost)."""

    def __init__(self, inner: LocalStore) -> None:
        super().__init__(inner)
        self.read_bytes = 0
        self._lock = threading.Lock()  # a rank's reads run on several threads

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.read_bytes += nbytes

    def read(self, key: str) -> bytes:
        data = self.inner.read(key)
        self._count(len(data))
        return data

    def read_into(self, key: str, offset: int, buffers: Sequence[memoryview]) -> None:
        self.inner.read_into(key, offset, buffers)
        self._count(sum(memoryview(b).nbytes for b in buffers))

    def read_ranges(self, key: str, ranges: Sequence[tuple[int, Sequence[memoryview]]]) -> None:
        self.inner.read_ranges(key, ranges)
        self._count(sum(memoryview(b).nbytes for _, bufs in ranges for b in bufs))


def _state(rank: int, step: int, model: np.ndarray) -> dict[str, Any]:
    return {"model": model, "shard": np.full(_SHARD_INTS, rank * 1000 + step, dtype=np.int64)}


def measure_scale(
    ranks: int,
    *,
    directory: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> ScaleFigures:
    """Open N Checkpointers on one run (``keep=1``), save twice (the second measured), restore.

    Every phase is one :meth:`SimulatedWorld.run`, so the counters are read between phases,
    with no collective open. The restore is checked: each rank gets its own shard back.
    """
    say = progress or (lambda _: None)
    world = SimulatedWorld(ranks, timeout=_TIMEOUT_SECONDS)
    model = np.arange(_MODEL_FLOATS, dtype=np.float32)
    with tempfile.TemporaryDirectory(prefix="cryosnap-scale-", dir=directory) as tmp:
        root = LocalStore(Path(tmp) / "run")
        stores = [CountingStore(root) for _ in range(ranks)]
        ckpts: list[Checkpointer | None] = [None] * ranks
        old_stack = threading.stack_size(_STACK_BYTES)
        try:

            def first(c: SimulatedRank) -> None:
                ckpt = ckpts[c.rank] = Checkpointer(
                    stores[c.rank], comm=c, chunk_bytes=_CHUNK_BYTES, keep=1
                )
                ckpt.save(1, _state(c.rank, 1, model), replicated=["model"]).result()

            say(f"{ranks} ranks: open and a first save")
            world.run(first)
            world.reset()
            say(f"{ranks} ranks: the measured save")
            t0 = time.perf_counter()
            world.run(
                lambda c: (
                    _ckpt(ckpts, c).save(2, _state(c.rank, 2, model), replicated=["model"]).result()
                )
            )
            save_seconds = time.perf_counter() - t0
            saved = world.all_counters()
            leader = world.leader_seconds
            for store in stores:
                store.read_bytes = 0
            say(f"{ranks} ranks: restore")
            # A resume: the newest version, agreed (restore(step) is collective-free, so
            # each rank reads the whole commit record itself).
            restored = world.run(lambda c: _ckpt(ckpts, c).restore())
            for rank, state in enumerate(restored):
                if int(state["shard"][0]) != rank * 1000 + 2 or not np.array_equal(
                    state["model"], model
                ):
                    raise BenchError(f"the scale workload restored rank {rank}'s state wrong")
            read = max((s.read_bytes for s in stores[1:]), default=stores[0].read_bytes)
            leader_read = stores[0].read_bytes
            world.run(lambda c: _ckpt(ckpts, c).close())
        finally:
            threading.stack_size(old_stack)
        manifest = max(root.size(manifest_key(2, r)) for r in range(ranks))
        commit = root.size(commit_key(2))
        record = read_commit(root, 2)
        entry = max(_entry_bytes(record, r) for r in range(ranks))
    return ScaleFigures(
        ranks=ranks,
        max_sent_bytes_per_rank=max(c.bytes_sent for c in saved),
        max_received_bytes_per_rank=max(c.bytes_received for c in saved),
        rounds=max(c.rounds for c in saved),
        leader_seconds=leader,
        restore_read_bytes_per_rank=read,
        metadata_bytes_per_rank=manifest + entry,
        max_sent_bytes_but_leader=max((c.bytes_sent for c in saved[1:]), default=0),
        max_received_bytes_but_leader=max((c.bytes_received for c in saved[1:]), default=0),
        manifest_bytes_per_rank=manifest,
        commit_bytes=commit,
        save_seconds=save_seconds,
        leader_restore_read_bytes=leader_read,
    )


def _entry_bytes(record: CommitRecord, rank: int) -> int:
    """The size of rank's entry of ``record`` as the leader hands it (_run/restore.py)."""
    doc = record.for_rank(rank).header_json()
    return len(json.dumps(doc, separators=(",", ":")).encode())


def _ckpt(ckpts: list[Checkpointer | None], c: SimulatedRank) -> Checkpointer:
    ckpt = ckpts[c.rank]
    assert ckpt is not None  # opened by the first phase, which every rank completed
    return ckpt
