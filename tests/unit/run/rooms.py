"""Builders for the room-level tests: a level, a job, a VersionWriter, without a Checkpointer."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np

from cryosnap import engine
from cryosnap._run.capture.staging import direct_batches
from cryosnap._run.chain import ChainIndex
from cryosnap._run.job import END, Job
from cryosnap._run.levels.levels import Level
from cryosnap._run.results import CaptureTracker, PendingSave
from cryosnap._run.writer import VersionWriter
from cryosnap._state import flatten
from cryosnap.dist import Coordinator, LocalCoordinator
from cryosnap.storage import Store

CHUNK = 4096


def state(step: int, n: int = 6 * CHUNK) -> dict[str, Any]:
    """Content that changes by step: a big array (some chunks new each step) and a counter."""
    big = np.arange(n, dtype=np.uint8)
    big[: CHUNK * (step % 3 + 1)] = step % 251
    return {"big": big, "step": np.full(4, step, np.int64)}


def level(
    store: Store, name: str = "persistent", *, shared: bool = True, keep: Any = None
) -> Level:
    return Level(name, store, keep, shared=shared)


def chain(*, full_every: int = 16, rank: int = 0, incremental: bool = True) -> ChainIndex:
    return ChainIndex(incremental=incremental, full_every=full_every, chunk_bytes=CHUNK, rank=rank)


def version_writer(
    lvl: Level,
    *,
    coordinator: Coordinator | None = None,
    chain_index: ChainIndex | None = None,
) -> VersionWriter:
    coord = coordinator if coordinator is not None else LocalCoordinator()
    return VersionWriter(
        level=lvl,
        chain=chain_index if chain_index is not None else chain(rank=coord.rank),
        coordinator=coord,
        chunk_bytes=CHUNK,
        fence=lambda: None,
    )


def job(step: int, tree: Any, *, levels: tuple[str, ...] = ("persistent",)) -> Job:
    """A captured job: the batches view ``tree``'s memory (as cryosnap.save's direct path)."""
    flat = flatten(tree, pack_bytes=CHUNK)
    tracker = CaptureTracker(0)
    tracker.finish()
    pending = PendingSave(step, tracker, time.perf_counter(), levels, levels)
    out = Job(step, flat, pending, queue.SimpleQueue())
    for batch in direct_batches(flat, batch_bytes=engine.IO_BATCH_BYTES, chunk_bytes=CHUNK):
        out.batches.put(batch)
    out.batches.put(END)
    return out


def on_ranks(world: int, fn: Any) -> list[Any]:
    """``fn(rank)`` on one thread per rank; the results, or the exception each raised."""
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out
