"""The user-facing entry points: ``save`` / ``load`` and the :class:`SaveInfo` they report.

``save`` flattens the state on the caller's thread and writes it synchronously: durable on
return. ``load`` reads the newest (or the given) committed version, verifying every chunk.
Arguments are validated eagerly here, with messages that name the argument and what is allowed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from . import engine
from .chunks import validate_chunk_bytes
from .manifest import MAX_STEP
from .storage import Store, open_store
from .tree import flatten

__all__ = ["SaveInfo", "load", "save"]

PathLike = str | os.PathLike[str] | Store


@dataclass(frozen=True, slots=True)
class SaveInfo:
    """What one version cost this process (this rank).

    ``written_bytes`` counts the data this rank wrote to its first tier; ``stall_seconds`` is how
    long the caller was blocked; ``seconds`` runs until the version was durable; ``tiers`` names
    the tiers the version reached.
    """

    step: int
    logical_bytes: int
    written_bytes: int
    chunks: int
    new_chunks: int
    stall_seconds: float
    seconds: float
    incremental: bool
    tiers: tuple[str, ...]


def validate_step(step: object, name: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"{name} must be an int, got {type(step).__name__}")
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"{name}={step} is out of range: allowed are 0 to {MAX_STEP}")
    return step


def save(
    path: PathLike,
    state: Any,
    *,
    step: int = 0,
    chunk_bytes: int = 1 << 20,
    allow_pickle: bool = False,
) -> SaveInfo:
    """Save ``state`` as version ``step`` of the run at ``path``; durable when it returns.

    ``path`` is a directory or an fsspec URL. A step that already exists is an error
    (:class:`~cryosnap.CheckpointExistsError`): versions are never overwritten in place.
    """
    t0 = time.perf_counter()
    validate_step(step)
    validate_chunk_bytes(chunk_bytes)
    store = open_store(path)
    flat = flatten(state, allow_pickle=allow_pickle)
    views = [b.host_view() for b in flat.blobs]
    part = engine.write_part(store, step, flat, views, chunk_bytes=chunk_bytes)
    engine.commit_version(store, step, [part], chunk_bytes=chunk_bytes)
    seconds = time.perf_counter() - t0
    return SaveInfo(
        step=step,
        logical_bytes=part.logical_bytes,
        written_bytes=part.written_bytes,
        chunks=part.chunks,
        new_chunks=part.new_chunks,
        stall_seconds=seconds,
        seconds=seconds,
        incremental=False,
        tiers=("persistent",),
    )


def load(
    path: PathLike,
    *,
    step: int | None = None,
    into: Any = None,
    rank: int | None = None,
    allow_pickle: bool = False,
) -> Any:
    """Load version ``step`` (default: the newest that verifies) of the run at ``path``.

    Without ``into`` the saved tree comes back (torch tensors on the CPU, numpy arrays, stateful
    objects as their state dicts). With ``into`` tensors and arrays are filled in place and
    ``load_state_dict`` is called; a mismatch or damaged data raises before anything changes.
    ``rank`` reads another rank's part of a distributed version.
    """
    if step is not None:
        validate_step(step)
    part = 0 if rank is None else validate_step(rank, "rank")
    store = open_store(path)

    def attempt(s: int) -> Any:
        return engine.read_part(store, s, rank=part, into=into, allow_pickle=allow_pickle)

    if step is not None:
        return attempt(step)
    return engine.newest_restorable(store, attempt, engine.list_steps(store))
