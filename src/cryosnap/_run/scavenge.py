"""The flush of a run whose writer is gone (``cryosnap flush``, a job epilogue's scavenge).

Opens a run's scratch and persistent levels as its writer did, under their write locks, and
hands off the versions left on scratch exactly as a reopened run does (``resume_handoffs``):
no copy of the flush here. One process per rank of the original run; its collectives are the
hand-offs' and a few agreements on the main channel. Caller's thread.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

from cryosnap import engine
from cryosnap._run.chain import ChainIndex
from cryosnap._run.levels.levels import Levels
from cryosnap._run.open import newest_record, open_levels, open_stores, resume_handoffs
from cryosnap._run.options import RunOptions
from cryosnap._run.results import PendingSave
from cryosnap.dist import Coordinator, agree
from cryosnap.dist._agree import first_errors
from cryosnap.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
    SourceDamagedError,
    WorldSizeError,
)
from cryosnap.storage import LocalStore, Store
from cryosnap.storage.striped import StripedStore

__all__ = ["FlushFailure", "FlushReport", "FlushedVersion", "flush_run"]


@dataclass(frozen=True, slots=True)
class FlushedVersion:
    """One version made persistent: the bytes written to the persistent level (by every rank
    together) and the seconds its flush took (the slowest rank's)."""

    step: int
    nbytes: int
    seconds: float


@dataclass(frozen=True, slots=True)
class FlushFailure:
    """A version that could not be flushed, as ``rank`` saw it; ``error`` names the step, the
    level and, when the scratch copy is damaged (``damaged``), the leaf and that rank's part."""

    step: int
    rank: int
    error: str
    damaged: bool


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What :func:`cryosnap.flush` did. ``already``: versions on scratch that were persistent
    before; ``superseded``: versions on scratch a rewind saved over (never flushed);
    ``partial``: versions committed on some ranks' scratch only (no version of the run)."""

    path: str
    scratch: tuple[str, ...]
    flushed: tuple[FlushedVersion, ...]
    failed: tuple[FlushFailure, ...]
    already: tuple[int, ...]
    superseded: tuple[int, ...]
    partial: tuple[int, ...]
    rank: int
    world_size: int

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "scratch": list(self.scratch),
            "rank": self.rank,
            "world_size": self.world_size,
            "ok": self.ok,
            "flushed": [
                {"step": v.step, "bytes": v.nbytes, "seconds": v.seconds} for v in self.flushed
            ],
            "failed": [
                {"step": f.step, "rank": f.rank, "error": f.error, "damaged": f.damaged}
                for f in self.failed
            ],
            "already_persistent": list(self.already),
            "superseded": list(self.superseded),
            "partial": list(self.partial),
        }


def _no_wait() -> None:
    return None


def flush_run(options: RunOptions, coord: Coordinator) -> FlushReport:
    """Flush every version committed on ``options``' scratch and not yet on its persistent
    level, as the run's writer would have; every participant (one per rank of the run that
    wrote the scratch) calls it. Raises :class:`RunLockedError` while a writer holds the run."""
    options.check_world(coord.world_size)
    _check_scratch_parts(options, coord)
    persistent, scratch = open_stores(options, coord)
    assert scratch is not None  # the facade requires scratch
    _check_world_size(persistent, coord)
    options = _as_saved(options, scratch)
    chain = ChainIndex(
        incremental=options.incremental,
        full_every=options.full_every,
        chunk_bytes=options.chunk_bytes,
        rank=0,
    )
    here = engine.list_versions(scratch)
    with ExitStack() as undo:
        levels = open_levels(options, coord, persistent, scratch, chain, undo)
        resumed = resume_handoffs(options, coord, levels, undo, yield_to=_no_wait)
        levels.close_handoffs()  # the queued flushes end, retried as the writer's are
        flushed, failed = _outcomes(levels, resumed, scratch)
    flushed, failed = _gathered(coord, flushed, failed)
    done = {v.step for v in flushed} | {f.step for f in failed}
    both = engine.list_versions(scratch, persistent)
    on_persistent = engine.list_versions(persistent)
    superseded = sorted(s for s, lin in here.items() if both.get(s, -1) != lin)
    already = sorted(
        s for s in here if s not in done and s not in superseded and s in on_persistent
    )
    partial = sorted(set(here) - done - set(superseded) - set(already))
    return FlushReport(
        path=persistent.url,
        scratch=tuple(d.url for d in scratch.devices),
        flushed=tuple(flushed),
        failed=tuple(failed),
        already=tuple(already),
        superseded=tuple(superseded),
        partial=tuple(partial),
        rank=coord.rank,
        world_size=coord.world_size,
    )


def _check_scratch_parts(options: RunOptions, coord: Coordinator) -> None:
    """The persistent run and every rank's scratch part must exist (node-local scratch is
    ``<tier>/rank-<r>`` with several ranks); agreed, so that a rank without one fails every
    rank alike. Stores and URLs are not checked here: their listings say what they hold."""
    problem = ""
    path = _directory(options.path)
    if path is not None and not os.path.isdir(path):
        problem = f"no run at {path} (the persistent tier to flush to)"
    for tier in options.scratch_devices:
        root = _directory(tier.path)
        if problem or root is None:
            continue
        where = root if coord.world_size == 1 else os.path.join(root, f"rank-{coord.rank:05d}")
        parts = (
            sorted(n for n in os.listdir(root) if n.startswith("rank-"))
            if os.path.isdir(root)
            else []
        )
        if not os.path.isdir(where):
            problem = f"no scratch run at {where}"
            if coord.world_size > 1:
                problem = f"rank {coord.rank}: {problem} (this rank's part of the run's scratch)"
        elif coord.world_size == 1 and parts and not engine.list_steps(LocalStore(root)):
            problem = (
                f"{root} holds the scratch parts of a distributed run ({', '.join(parts)}): run "
                "`cryosnap flush` with the job's layout, one process per rank (mpiexec -n N or "
                "torchrun --nproc-per-node N)"
            )
    found = agree(coord, problem, first_errors)
    if found:
        raise CheckpointNotFoundError("; ".join(p for _r, p in found))


def _directory(location: object) -> str | None:
    """``location`` as a local directory path, or None (a Store or a URL)."""
    if isinstance(location, Store):
        return None
    path = os.fspath(location)  # type: ignore[call-overload]
    return None if "://" in path else path


def _check_world_size(persistent: Store, coord: Coordinator) -> None:
    """The persistent level's newest version says how many ranks wrote the run."""
    newest = newest_record(persistent)
    if newest is not None and newest.world_size != coord.world_size:
        raise WorldSizeError(
            f"{persistent.url}: step {newest.step} was saved by {newest.world_size} rank(s), "
            f"this flush runs on {coord.world_size}: run it with the job's layout, one process "
            "per rank of the run"
        )


def _as_saved(options: RunOptions, scratch: StripedStore) -> RunOptions:
    """The options of the writer that saved the scratch versions where a flush depends on
    them (the ranks write the persistent level again: docs/design/levels.md)."""
    newest = newest_record(scratch)
    if newest is None:
        return options
    return replace(options, chunk_bytes=newest.chunk_bytes, run_id=newest.run_id)


def _outcomes(
    levels: Levels, resumed: Sequence[PendingSave], scratch: Store
) -> tuple[list[FlushedVersion], list[FlushFailure]]:
    """This rank's outcome of each version handed off; the hand-offs are closed."""
    figures = {s: f for h in levels.handoffs for s, f in h.resumed.items()}
    flushed: list[FlushedVersion] = []
    failed: list[FlushFailure] = []
    rank = levels.coordinator.rank
    for pending in resumed:
        error = pending.undelivered_error()
        if error is None:
            f = figures[pending.step]
            flushed.append(FlushedVersion(pending.step, f.nbytes, f.seconds))
            continue
        damaged = isinstance(error, SourceDamagedError)
        message = _damage(scratch, pending.step) if damaged else None
        failed.append(FlushFailure(pending.step, rank, message or _one_line(error), damaged))
    return flushed, failed


def _damage(scratch: Store, step: int) -> str | None:
    """What is damaged in ``step``'s scratch copy, leaf by leaf (a full read and hash)."""
    try:
        record = engine.read_commit(scratch, step)
        for ref in record.manifests:
            engine.verify_part(scratch, step, rank=ref.rank)
    except (IntegrityError, CheckpointFormatError, CheckpointNotFoundError) as exc:
        return f"step {step} on scratch is damaged, not flushed: {_one_line(exc)}"
    return None


def _gathered(
    coord: Coordinator, flushed: list[FlushedVersion], failed: list[FlushFailure]
) -> tuple[list[FlushedVersion], list[FlushFailure]]:
    """Every rank's outcomes together: bytes summed, seconds the slowest rank's, one failure
    per version that failed on any rank (a version one rank could not flush is committed by
    none)."""
    if coord.world_size == 1:
        return flushed, failed
    mine = {
        "flushed": [[v.step, v.nbytes, v.seconds] for v in flushed],
        "failed": [[f.step, f.rank, f.error, f.damaged] for f in failed],
    }
    versions, failures = agree(coord, mine, _merged)
    return (
        [FlushedVersion(int(s), int(n), float(sec)) for s, n, sec in versions],
        [FlushFailure(int(s), int(r), str(e), bool(d)) for s, r, e, d in failures],
    )


def _merged(told: list[dict[str, Any]]) -> list[list[list[Any]]]:
    """The leader's merge of every rank's outcomes (:func:`_gathered`), as JSON."""
    # One failure per version: the cause (a rank's damaged scratch copy) before what the other
    # ranks saw of it (the version not committed).
    first: dict[int, FlushFailure] = {}
    for f in sorted(
        (FlushFailure(int(s), int(r), str(e), bool(d)) for t in told for s, r, e, d in t["failed"]),
        key=lambda f: (f.step, not f.damaged, f.rank),
    ):
        first.setdefault(f.step, f)
    failures = list(first.values())
    bad = set(first)
    totals: dict[int, tuple[int, float]] = {}
    for t in told:
        for s, n, sec in t["flushed"]:
            prev = totals.get(int(s), (0, 0.0))
            totals[int(s)] = (prev[0] + int(n), max(prev[1], float(sec)))
    versions = [[s, n, sec] for s, (n, sec) in sorted(totals.items()) if s not in bad]
    return [versions, [[f.step, f.rank, f.error, f.damaged] for f in failures]]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
