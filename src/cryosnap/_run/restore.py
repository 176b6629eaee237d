"""Restore: a version read back from the fastest level holding a complete copy of it.

Without a step, the newest version that verifies (with several participants: the newest every
one can read, agreed on the ``"restore"`` channel); a damaged copy falls back to the next level,
a version saved by another number of ranks is a WorldSizeError on every participant alike.
Also the lineage new versions are committed in after a restore rewound the run.
Runs on the caller's thread; its collectives use the channel it is given.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cryosnap import engine
from cryosnap._format.commit import CommitRecord
from cryosnap._format.keys import Lineage, max_generation, version_prefix, visible_versions
from cryosnap._run import ddp
from cryosnap._run.health import ANY_VERSION, Choice
from cryosnap._run.levels.levels import Levels
from cryosnap._run.read_once import read_once_enabled, shared_reads
from cryosnap._state.device import target_device
from cryosnap.dist import LEADER, Coordinator, agree
from cryosnap.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
    WorldSizeError,
)
from cryosnap.progress import Progress
from cryosnap.storage import Store

__all__ = [
    "Ask",
    "current_lineage",
    "device_for",
    "restore_agreed",
    "restore_levels",
    "restore_one",
    "restore_run",
    "rewound_lineage",
]

log = logging.getLogger("cryosnap")


def restore_run(
    levels: Levels,
    channel: Coordinator,
    step: int | None,
    *,
    into: Any,
    allow_pickle: bool,
    only: bool,
    keys: tuple[str | int, ...] | None,
    device: Any,
    choice: Choice = ANY_VERSION,
    memory: Store | None = None,
) -> tuple[Any, int, Store]:
    """A managed run's restore (``Checkpointer.restore``): the state, the step restored and
    the store this participant's part was read from. Per level, this participant reads its
    rank's part on a shared level, part 0 of its own run on a private one (a distributed run's
    node-local scratch, its ``memory`` level: read first); without a step and with several
    participants, the step is agreed on ``channel`` and the leader hands each participant
    its entry of the commit record (:func:`handed_records`: O(1) metadata per rank)."""
    me = channel.rank
    private = [False] if memory is not None else []
    ask = Ask(
        ranks=tuple(me if shared else 0 for shared in [*private, *levels.shared()]),
        shared=(*private, *levels.shared()),
        participants=channel.world_size,
        allow_pickle=allow_pickle,
        only=only,
        keys=keys,
        device=device,
        choice=choice,
    )
    stores = [*([memory] if memory is not None else []), *levels.stores()]
    restored: list[int] = []
    served: list[Store] = []
    if step is not None or channel.world_size == 1:
        # No collective: with an explicit step each participant reads on its own (a survivor
        # of a dead peer can still restore), the whole commit record included.
        state = restore_levels(stores, step, into=into, ask=ask, restored=restored, served=served)
    else:
        state = restore_agreed(
            channel, stores, into=into, ask=ask, restored=restored, served=served
        )
    return state, restored[-1], served[-1]


def rewound_lineage(
    levels: Levels, channel: Coordinator, step: int, current: Lineage | None
) -> tuple[Lineage | None, bool]:
    """The lineage after restoring ``step``, and whether the chain restarts from ``step``.
    When the run holds later versions, the next version starts a new generation forked at
    ``step``, whose first commit supersedes them (docs/FORMAT.md, "Superseding"); otherwise
    saves go on in the run's lineage. Every participant restored the same step, and decides
    the same."""
    records = levels.records()
    later = any(s > step for s in visible_versions(records))
    newest = max_generation(records)
    private = not all(level.shared for level in levels.levels)
    if private and channel.world_size > 1:
        # Each rank's scratch is its own: they may see different versions, and each
        # commits its own scratch record in the lineage, so they agree on it. (On shared
        # levels only, every rank lists the same records: no collective, and a survivor
        # of a dead peer can still restore.)
        later, newest = agree(channel, [later, newest], _newest_lineage)
    lineage = Lineage(newest + 1, step) if later else current_lineage(records)
    return lineage, later or lineage != current


def _newest_lineage(told: list[list[Any]]) -> list[Any]:
    """The leader's verdict on the ranks' ``[later, newest]``: any later, the highest."""
    return [any(t[0] for t in told), max(t[1] for t in told)]


def handed_records(
    channel: Coordinator, stores: Sequence[Store], shared: Sequence[bool], step: int
) -> dict[tuple[int, int], CommitRecord]:
    """Collective (with several participants): the leader reads ``step``'s commit record on
    each shared tier once and hands every rank only its own entry
    (:meth:`CommitRecord.for_rank`, over :meth:`Coordinator.exchange`), so a rank reads O(1)
    metadata however many ranks saved; by ``(tier index, step)``. A record the leader cannot
    read is handed to nobody: each rank reads it itself and meets the same error, as a rank
    of a world of one does."""
    if channel.world_size == 1:
        return {}
    me = channel.rank
    out: dict[tuple[int, int], CommitRecord] = {}
    sends: dict[int, bytes] = {}
    if me == LEADER:
        entries: dict[int, dict[str, Any]] = {}
        for i, (store, is_shared) in enumerate(zip(stores, shared, strict=True)):
            if not is_shared:
                continue
            try:
                record = engine.read_commit(store, step)
            except CheckpointError:
                continue
            out[(i, step)] = record
            for r in range(1, channel.world_size):
                entries.setdefault(r, {})[str(i)] = record.for_rank(r).header_json()
        sends = {r: json.dumps(doc, separators=(",", ":")).encode() for r, doc in entries.items()}
    for body in channel.exchange(sends).values():
        for i, doc in json.loads(body).items():
            out[(int(i), step)] = CommitRecord.from_header_json(doc)
    return out


def current_lineage(records: Sequence[tuple[int, Lineage | None]]) -> Lineage | None:
    """The lineage of the run's newest generation (None: the run never rewound)."""
    newest = max_generation(records)
    forks = [lin.fork for _s, lin in records if lin is not None and lin.generation == newest]
    return Lineage(newest, min(forks)) if forks else None


@dataclass(frozen=True, slots=True)
class Ask:
    """What a restore reads: per tier, the part (``ranks``) and whether every participant
    shares the tier (``shared``: its commit records say how many ranks saved a version);
    ``participants``: how many restore together (None: no world-size check, ``load``);
    ``only``, ``keys``, ``device``: engine.read_part's ``replicated_only``, ``keys``,
    ``device``; ``choice``: the versions a restore without a step may take (health.py)."""

    ranks: tuple[int, ...]
    shared: tuple[bool, ...]
    participants: int | None
    allow_pickle: bool
    only: bool = False
    keys: tuple[str | int, ...] | None = None
    device: Any = None
    choice: Choice = ANY_VERSION


def restore_levels(
    tiers: Sequence[Store],
    step: int | None,
    *,
    into: Any,
    ask: Ask,
    restored: list[int] | None = None,
    served: list[Store] | None = None,
    records: Mapping[tuple[int, int], CommitRecord] | None = None,
) -> Any:
    """Restore from the fastest tier holding a complete copy of the version (of the newest
    one that verifies, without ``step``); a damaged copy falls back to the next tier. A
    version saved by another number of ranks than ``ask.participants`` is a
    :class:`WorldSizeError` before any tier is read (:func:`_check_world`). The versions are
    those of every tier's records together (a rewind on one supersedes on all); the step
    restored is appended to ``restored``, the tier it was read from to ``served``.
    ``records``: commit records by (tier index, step) as :func:`handed_records` gave them
    (read from the tier where absent)."""
    where = " + ".join(t.url for t in tiers)
    handed = records or {}
    readers = [
        _reader(rank=r, into=into, ask=ask, records=handed, tier=i) for i, r in enumerate(ask.ranks)
    ]
    # The versions the choice allows, decided once (its warning said which it skips).
    allowed = _allowed(tiers, ask, where) if step is None and ask.choice.any else None

    def listed() -> list[int]:
        steps = sorted(engine.list_versions(*tiers))
        return steps if allowed is None else [s for s in steps if s in allowed]

    def attempt(s: int) -> Any:
        _check_world(tiers, ask, s, where, handed)
        # Only the tiers holding the version itself: another may hold a record it superseded.
        versions = engine.list_versions(*tiers)
        held = [set(engine.list_records(t, version_prefix(s))) for t in tiers]
        stores = [
            (t, read)
            for t, read, have in zip(tiers, readers, held, strict=True)
            if s in versions and (s, versions[s]) in have
        ]
        if not stores:  # never committed, superseded, or retired since the listing
            raise CheckpointNotFoundError(
                f"step {s} not found on any tier ({where})", step=s, path=where
            )
        first: CheckpointError | None = None
        for store, read in stores:
            try:
                state = read(store, s)
                if restored is not None:
                    restored.append(s)
                if served is not None:
                    served.append(store)
                return state
            except CheckpointError as exc:
                if store is not stores[-1][0]:
                    log.warning("step %d on %s: %s; reading the next tier", s, store.url, exc)
                first = first or exc
        assert first is not None
        raise first

    if step is not None:
        return _explicit(where, attempt, listed, step)
    return newest_restorable(where, attempt, listed)


def _allowed(tiers: Sequence[Store], ask: Ask, where: str) -> set[int]:
    """The versions of ``tiers`` that ``ask.choice`` allows; none is a
    CheckpointNotFoundError naming why."""
    steps = sorted(engine.list_versions(*tiers))
    allowed = set(ask.choice.filter(tiers, steps, where))
    if steps and not allowed:
        raise CheckpointNotFoundError(
            f"no version of {where} is {ask.choice.describe()} (of {len(steps)} version(s))",
            path=where,
        )
    return allowed


def _check_world(
    tiers: Sequence[Store],
    ask: Ask,
    step: int,
    where: str,
    handed: Mapping[tuple[int, int], CommitRecord],
) -> None:
    """Refuse a version saved by another number of ranks than restore it (unless only its
    replicated keys are asked for). The saved number is a shared tier's commit record's: a
    private tier (a distributed run's scratch) holds each rank's part as a run of one."""
    if ask.participants is None or ask.only:
        return
    for i, (tier, shared) in enumerate(zip(tiers, ask.shared, strict=True)):
        known = handed.get((i, step))
        if known is not None:
            saved = known.world_size
        elif shared and engine.step_exists(tier, step):
            saved = engine.read_commit(tier, step).world_size
        else:
            continue
        if saved != ask.participants:
            raise _world_size_error(where, step, saved, ask.participants)
        return
    return


def _world_size_error(where: str, step: int, saved: int, participants: int) -> WorldSizeError:
    if participants < saved:
        what = f"the part(s) of saved {_ranks(participants, saved)} would be left unread"
    else:
        what = f"{_ranks(saved, participants)} would have no part of it"
    return WorldSizeError(
        f"step {step} of {where} was saved by {saved} rank(s) and {participants} "
        f"participant(s) restore it: {what}. Ways on: restore(replicated_only=True) (the keys "
        f"saved as replicated, at any world size); cryosnap.load(path, step={step}, rank=k) "
        f"reads saved rank k's part (0..{saved - 1}) to reshard it yourself; or restart at "
        f"{saved} ranks"
    )


def _ranks(lo: int, hi: int) -> str:
    """Ranks ``lo..hi-1`` for a message."""
    return f"rank {lo}" if hi == lo + 1 else f"ranks {lo}..{hi - 1}"


def restore_one(store: Store, step: int | None, *, into: Any, ask: Ask) -> Any:
    return restore_levels([store], step, into=into, ask=ask)


def _reader(
    *,
    rank: int,
    into: Any,
    ask: Ask,
    records: Mapping[tuple[int, int], CommitRecord] | None = None,
    tier: int = 0,
) -> Callable[[Store, int], Any]:
    """``read(store, step)``: one rank's part of a version from one store (tier ``tier``), as
    asked; with the commit record ``records`` holds for it, if any."""

    def read(store: Store, step: int) -> Any:
        state = engine.read_part(
            store,
            step,
            record=(records or {}).get((tier, step)),
            rank=rank,
            into=into,
            allow_pickle=ask.allow_pickle,
            replicated_only=ask.only,
            device=ask.device,
            keys=ask.keys,
            progress=Progress,
        )
        if into is not None:
            ddp.arm(into)  # exact DDP resume without prepare_ddp_resume (_run/ddp.py)
        return state

    return read


def _explicit(
    where: str, attempt: Callable[[int], Any], listed: Callable[[], list[int]], step: int
) -> Any:
    """``attempt(step)``; a version the writer retired while it was read is reported as such.
    A step that is no version (never committed, or superseded) is not found."""
    if step not in listed():
        raise CheckpointNotFoundError(f"step {step} not found in {where}", step=step, path=where)
    try:
        return attempt(step)
    except CheckpointError as exc:
        if isinstance(exc, CheckpointNotFoundError) or step in listed():
            raise
        raise CheckpointNotFoundError(
            f"step {step} of {where} was deleted by the run's retention while it was read"
        ) from exc


def device_for(map_location: object, into: Any) -> Any:
    """The ``torch.device`` restored tensors go to (None: the CPU); refused with ``into``."""
    device = target_device(map_location, "map_location")
    if device is not None and into is not None:
        raise ValueError(
            f"map_location={map_location!r} cannot be combined with into=: the tensors of "
            "into= are filled where they are, on their own devices"
        )
    return device


def restore_agreed(
    coord: Coordinator,
    stores: Sequence[Store],
    *,
    into: Any,
    ask: Ask,
    restored: list[int] | None = None,
    served: list[Store] | None = None,
) -> Any:
    """The newest version every participant can restore: the steps complete for all of them,
    tried newest first until every participant read its part (damage on any one falls back
    for all, so they resume from the same step). A version saved by another number of ranks
    is a :class:`WorldSizeError` on every participant alike (none resumes alone); every
    version damaged an :class:`IntegrityError`, none at all a CheckpointNotFoundError."""
    where = " + ".join(st.url for st in stores)
    mine: list[int] | None = None  # every tier shared: the leader's listing is everyone's
    if coord.rank == LEADER or not all(ask.shared):
        # A listing names every rank's manifest of every version: O(N) names, listed once.
        mine = sorted(engine.list_versions(*stores))
        if ask.choice.any:  # each participant's own view; the intersection is the agreement
            mine = ask.choice.filter(stores, mine, where)
    common: list[int] = agree(coord, mine, _common_steps)
    damaged: dict[int, str] = {}
    for step in reversed(common):
        probe: list[Store] = []
        records = handed_records(coord, stores, ask.shared, step)
        reading = _read_once(coord, stores, records, ask, step)
        try:
            state = restore_levels(reading, step, into=None, ask=ask, served=probe, records=records)
            error, kind = "", ""
        except WorldSizeError as exc:
            state, error, kind = None, str(exc), "world"
        except (IntegrityError, CheckpointFormatError) as exc:
            state, error, kind = None, str(exc), "damage"
        except CheckpointNotFoundError as exc:
            state, error, kind = None, str(exc), "missing"
        errors: list[list[str]] = agree(coord, [error, kind], _failures)
        world = [e for e, k in errors if k == "world"]
        if world:
            raise WorldSizeError(world[0])
        if not errors:
            if restored is not None:
                restored.append(step)
            # The stores the caller knows, not the read-once wrappers over them.
            back = dict(zip(map(id, reading), stores, strict=True))
            if into is None:
                if served is not None:
                    served.extend(back.get(id(st), st) for st in probe)
                return state
            read_from: list[Store] = []
            state = restore_levels(
                reading, step, into=into, ask=ask, served=read_from, records=records
            )
            if served is not None:
                served.extend(back.get(id(st), st) for st in read_from)
            return state
        if any(k == "damage" for _e, k in errors):
            damaged[step] = next(e for e, k in errors if k == "damage")
        log.warning("step %d of %s cannot be restored by every rank: %s", step, where, errors[0][0])
    if not common:
        raise CheckpointNotFoundError(
            f"no version of {where} is committed for all {coord.world_size} participants"
        )
    if len(damaged) == len(common):
        raise every_version_damaged(where, damaged)
    raise CheckpointNotFoundError(
        f"no version of {where} can be restored by all {coord.world_size} participants"
    )


def _read_once(
    coord: Coordinator,
    stores: Sequence[Store],
    records: Mapping[tuple[int, int], CommitRecord],
    ask: Ask,
    step: int,
) -> list[Store]:
    """``stores``, each shared one whose version was saved at this world size wrapped so that
    its replicated chunks are read once in the job (:mod:`read_once`: collective, one
    exchange per such store, the same on every rank: the records handed out are the same
    everywhere, and so are ``ask`` and the environment). Not for ``replicated_only`` or
    ``keys`` restores, nor with ``CRYOSNAP_RESTORE_READ_ONCE=0``."""
    out = list(stores)
    if ask.only or ask.keys is not None or not read_once_enabled():
        return out
    for (i, s), record in sorted(records.items(), key=lambda item: item[0]):
        if s == step and record.world_size == coord.world_size:
            out[i] = shared_reads(coord, stores[i], record)
    return out


def _common_steps(listed: list[list[int] | None]) -> list[int]:
    """The leader's verdict: the steps every participant listed (None: one that lists no
    tier of its own, whose levels are all shared)."""
    return sorted(set.intersection(*(set(steps) for steps in listed if steps is not None)))


def _failures(told: list[list[str]]) -> list[list[str]]:
    """The leader's verdict on one step: ``[error, kind]`` of each participant that could not
    read its part (a world-size error first: it ends the restore on every participant).
    Bounded: the first of each kind, so the decision does not grow with the ranks."""
    first: dict[str, list[str]] = {}
    for error, kind in told:
        if error and kind not in first:
            first[kind] = [error, kind]
    return sorted(first.values(), key=lambda ek: ek[1] != "world")


# -- the fallback of a restore without a step (its only caller is above) -----------------------


def _listings(list_steps: Callable[[], Sequence[int]], n: int) -> Iterator[list[int]]:
    for _ in range(n):
        yield list(list_steps())


# How often a reader starts over when the writer's retention removed versions under it.
_RELIST_LIMIT = 16


def newest_restorable(
    where: str, attempt: Callable[[int], Any], list_steps: Callable[[], Sequence[int]]
) -> Any:
    """Run ``attempt(step)`` from the newest step down; warn and fall back past damage.

    ``list_steps()`` gives the committed steps; a version that fails because the run's writer
    retired it meanwhile (its step is no longer listed) is not damage: the reader lists again
    and starts over from the newest, so a reader asking for the newest version never fails
    because an older one was deleted under it. ``where`` names the run in messages.
    """
    damaged: dict[int, str] = {}
    for _ in range(_RELIST_LIMIT):
        steps = [s for s in list_steps() if s not in damaged]
        if not steps and not damaged:
            # A listing is not atomic: it can miss the version the writer just committed and
            # the one it retired meanwhile. A run that has versions shows them on a new look.
            steps = next((found for found in _listings(list_steps, 3) if found), [])
        if not steps and not damaged:
            raise CheckpointNotFoundError(f"no committed version in {where}")
        retired = False
        for step in reversed(steps):
            try:
                return attempt(step)
            except CheckpointError as exc:
                if step not in list_steps():
                    retired = True  # deleted by the writer while we read it: list again
                    break
                if not isinstance(exc, (IntegrityError, CheckpointFormatError)):
                    raise
                damaged[step] = str(exc)
                warnings.warn(
                    f"cryosnap: skipping damaged step {step} in {where}: {exc}",
                    RuntimeWarning,
                    stacklevel=engine.caller_stacklevel(),
                )
        if not retired:
            break
    if not damaged:
        raise CheckpointNotFoundError(
            f"no version of {where} could be read: the writer kept retiring them while reading"
        )
    raise every_version_damaged(where, damaged)


def every_version_damaged(where: str, damaged: dict[int, str]) -> IntegrityError:
    """What a restore without a step raises when each version it tried (``damaged``: step ->
    what was wrong) is damaged: the steps, newest first, and the damage of the newest."""
    tried = sorted(damaged, reverse=True)
    return IntegrityError(
        f"every version in {where} is damaged (steps tried: {', '.join(map(str, tried))}); "
        f"step {tried[0]}: {damaged[tried[0]]}"
    )
