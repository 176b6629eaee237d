"""Retire: reference-counted retention of one tier. A pass (:func:`retire`) first plans
(:func:`plan_retire`: the versions to drop, then every manifest and data file that no kept
version needs), then deletes commit records first, then the files, then the leftovers of writes
that never committed; it is safe to fail at any delete and to run again.

Runs on the run's writer only (the Checkpointer's background thread, or ``cryosnap gc`` under
the run's lock), while none of its own writes on the store is in progress; no collectives here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from cryosnap._format.commit import CommitRecord
from cryosnap._format.keys import (
    Lineage,
    commit_key,
    parse_manifest_key,
    step_of_commit_key,
    step_of_data_key,
    visible_versions,
)
from cryosnap._format.marks import parse_mark_key
from cryosnap.engine._fork import held_files, release_holds
from cryosnap.engine._records import _no_fence, list_records, read_commit
from cryosnap.engine._resolved import chain_keys
from cryosnap.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
)
from cryosnap.policy import KeepLast, RetentionPolicy, VersionInfo, as_retention
from cryosnap.storage import LocalStore, Store

__all__ = [
    "RetirePlan",
    "VersionSpace",
    "apply_retire",
    "ignore_files",
    "incomplete_files",
    "plan_retire",
    "retire",
    "version_space",
]

log = logging.getLogger("cryosnap")

# Where writes that never committed leave files (Store.remove_incomplete's prefixes).
_PREFIXES = ("data", "versions")


def ignore_files(files: Collection[str]) -> None:
    """The default ``before_delete`` of :func:`retire`: a store no writer indexes."""
    return None


@dataclass(frozen=True, slots=True)
class RetirePlan:
    """What a retention pass deletes: the commit records of superseded versions, then those of
    ``dropped`` steps, then the manifests and data files no remaining version needs."""

    dropped: list[int]
    manifests: list[str]
    data_files: list[str]
    # Keys of the commit records that are no version (superseded): deleted before any other,
    # so a pass that stops midway never lets one of them become a version again.
    superseded: list[str] = field(default_factory=list)
    # The commit records of ``dropped``, in the same order.
    records: list[str] = field(default_factory=list)
    # Every data file the remaining versions read (a fork's ancestors' included): a fork
    # releases its hold on an ancestor none of them names.
    needed: frozenset[str] = frozenset()
    # The data files no remaining version reads that a fork's hold kept when planned: they go
    # with the others if the hold is gone (released, or its fork deleted) when they are.
    held: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class VersionSpace:
    """The data files one version keeps alive, from its commit record and their sizes:
    ``owned_bytes`` of the files it wrote, ``referenced_bytes`` of earlier versions' files it
    reads, ``pinned_bytes`` the part of those whose version is gone (kept for this one)."""

    step: int
    owned_bytes: int
    referenced_bytes: int
    pinned_bytes: int


def version_space(store: Store) -> list[VersionSpace]:
    """Per version of ``store``, oldest first, the bytes of data files it keeps alive (one
    size per file; reads commit records only). A file that is gone counts 0; a version whose
    commit record is damaged or gone (retired since the listing) has no entry, so that one
    damaged record hides no other version's figures."""
    versions = visible_versions(list_records(store))
    sizes: dict[str, int] = {}
    out: list[VersionSpace] = []
    for step, lineage in versions.items():
        try:
            record = read_commit(store, step, lineage)
        except (CheckpointNotFoundError, CheckpointFormatError, IntegrityError):
            continue  # its readers say what is wrong with it (ls: a DAMAGED row)
        owned = referenced = pinned = 0
        for key in record.data_files:
            if key not in sizes:
                sizes[key] = _size(store, key)
            written_by = step_of_data_key(key)
            if written_by == step:
                owned += sizes[key]
                continue
            referenced += sizes[key]
            if written_by not in versions:
                pinned += sizes[key]
        out.append(VersionSpace(step, owned, referenced, pinned))
    return out


def _size(store: Store, key: str) -> int:
    try:
        return store.size(key)
    except CheckpointNotFoundError:
        return 0


def incomplete_files(store: Store) -> dict[str, int]:
    """The leftovers of writes that never committed that a retention pass removes
    (``Store.remove_incomplete`` of ``data`` and ``versions``: a killed save's ``.partial``
    file) and their sizes, for its reports; deletes nothing. Known where the store is a local
    directory (``capabilities.local_path``); elsewhere none is listed (an object store's
    upload leaves none)."""
    root = store.capabilities.local_path
    if root is None:
        return {}
    local = LocalStore(root)  # the same directory: walked as the store itself walks it
    return {k: n for prefix in _PREFIXES for k, n in local.incomplete(prefix).items()}


def plan_retire(
    store: Store,
    *,
    keep: int | RetentionPolicy | None = None,
    drop: Sequence[int] = (),
    protect: Collection[int] = (),
    reserved: Collection[str] = (),
) -> RetirePlan:
    """The versions ``drop`` and those the retention policy ``keep`` does not select (an int:
    the newest ``keep``; None: no limit), except the newest version and those in ``protect``,
    and every manifest and data file that no remaining version needs, except the keys in
    ``reserved`` (files of a version whose commit record may still appear). Deletes nothing."""
    listed = list_records(store)
    versions = visible_versions(listed)
    steps = list(versions)
    doomed = set(drop) & set(steps)
    policy = as_retention(keep)
    records: dict[int, CommitRecord] = {}
    if isinstance(policy, KeepLast):
        if len(steps) > policy.n:
            doomed.update(steps[: -policy.n])
    elif policy is not None and steps:
        records = {s: read_commit(store, s, versions[s]) for s in steps}
        infos = [VersionInfo(s, records[s].metrics or {}) for s in steps]
        chosen = policy.select(infos) | {steps[-1]}
        doomed.update(s for s in steps if s not in chosen)
    dropped = sorted(doomed - set(protect))
    kept = [records.get(s) or read_commit(store, s, versions[s]) for s in steps if s not in dropped]
    manifests = _unneeded_manifests(store, kept, reserved)
    needed_files = {f for r in kept for f in r.data_files}
    unneeded = [k for k in store.list("data") if k not in needed_files and k not in reserved]
    held = held_files(store)  # the forks' (listed again when the files go)
    data_files = [] if held is None else [k for k in unneeded if k not in held]
    superseded = [
        commit_key(s, lin) for s, lin in sorted(listed, key=_order) if versions.get(s, 0) != lin
    ]
    return RetirePlan(
        dropped,
        manifests,
        data_files,
        superseded=superseded,
        records=[commit_key(s, versions[s]) for s in dropped],
        needed=frozenset(needed_files | set(reserved)),
        held=[k for k in unneeded if k not in data_files],
    )


def _order(record: tuple[int, Lineage | None]) -> tuple[int, int]:
    step, lineage = record
    return (step, 0 if lineage is None else lineage.generation)


def _unneeded_manifests(
    store: Store, kept: Sequence[CommitRecord], reserved: Collection[str]
) -> list[str]:
    """The manifests no kept version resolves through. Records name the steps of their chains
    only; where a step holds manifests of several generations (saved again after a rewind),
    the kept versions' chains are followed manifest by manifest to the exact keys (a version
    of a new lineage may build on one its lineage superseded: a flush that was behind)."""
    needed_steps = {s for r in kept for s in (r.chain or (r.step,))}
    keys = store.list("versions")
    # Mark records go with their version, even where its manifests stay for a later version's
    # chain (docs/design/lineage.md, "Marks"): after its commit record, as manifests do.
    kept_steps = {r.step for r in kept}
    marks = [k for k in keys if (m := parse_mark_key(k)) is not None and m[0] not in kept_steps]
    listed = [
        (key, step)
        for key in keys
        if (step := _step_of_version_key(key)) is not None
        and step_of_commit_key(key) is None
        and parse_mark_key(key) is None
        and key not in reserved
    ]
    mixed: set[int] = set()  # needed steps holding two manifests of one rank
    seen: set[tuple[int, int | None]] = set()
    for key, step in listed:
        parsed = parse_manifest_key(key)
        one = (step, None if parsed is None else parsed[0])
        if one in seen and step in needed_steps:
            mixed.add(step)
        seen.add(one)
    exact = _chain_keys(store, [r for r in kept if mixed & set(r.chain)]) if mixed else None
    return marks + [
        key
        for key, step in listed
        if step not in needed_steps or (step in mixed and exact is not None and key not in exact)
    ]


def _chain_keys(store: Store, records: Sequence[CommitRecord]) -> set[str] | None:
    """Every manifest key the chains of ``records`` pass through (None: one could not be read:
    keep everything)."""
    try:
        return {key for record in records for key in chain_keys(store, record)}
    except CheckpointError:
        return None


def retire(
    store: Store,
    *,
    keep: int | RetentionPolicy | None = None,
    drop: Sequence[int] = (),
    protect: Collection[int] = (),
    reserved: Collection[str] = (),
    fence: Callable[[], None] = _no_fence,
    before_delete: Callable[[Collection[str]], None] = ignore_files,
    later: list[Callable[[], None]] | None = None,
) -> list[int]:
    """Carry out :func:`plan_retire`, then remove the leftovers of writes that never committed
    (``Store.remove_incomplete``). Returns the steps deleted.

    With ``later``, only the commit records go now (what decides which versions are listed
    and restorable): the rest of the pass is appended to ``later`` as one callable, for the
    writer to run once it has reported the version it just committed (deleting a large data
    file costs the kernel time that the caller of ``result()`` need not wait for). The writer
    runs it before its next write, so the invariants below hold.

    Safe to fail at any delete and to be run again: commit records go first, so a failure
    midway leaves fewer versions, never a broken one; manifests and data files go only when no
    remaining version needs them, so the next pass finishes what this one started.
    ``before_delete(files)`` is told which data files are about to go before the first of them
    is deleted (the writer drops them from its content index, so no new version can reference
    a file that a failing pass half-deleted). ``fence()`` runs before anything is deleted: a
    writer that lost the run's lock deletes nothing. Only the run's writer calls this, while
    none of its own writes on ``store`` is in progress.
    """
    plan = plan_retire(store, keep=keep, drop=drop, protect=protect, reserved=reserved)
    if later is None:
        apply_retire(store, plan, fence=fence, before_delete=before_delete)
    else:
        _drop_records(store, plan, fence)
        later.append(lambda: _delete_files(store, plan, fence, before_delete))
    return plan.dropped


def apply_retire(
    store: Store,
    plan: RetirePlan,
    *,
    fence: Callable[[], None] = _no_fence,
    before_delete: Callable[[Collection[str]], None] = ignore_files,
) -> None:
    """Delete what ``plan`` names, commit records first, then remove the leftovers of writes
    that never committed (see :func:`retire`)."""
    _drop_records(store, plan, fence)
    _delete_files(store, plan, _no_fence, before_delete)


def _drop_records(store: Store, plan: RetirePlan, fence: Callable[[], None]) -> None:
    fence()
    for key in [*plan.superseded, *plan.records]:
        store.delete(key)


def _delete_files(
    store: Store,
    plan: RetirePlan,
    fence: Callable[[], None],
    before_delete: Callable[[Collection[str]], None],
) -> None:
    fence()  # deferred (retire's later): the lock may have gone meanwhile
    for key in plan.manifests:
        store.delete(key)
    # Listed again now that the dropped versions' commit records are gone: a fork created
    # since the plan wrote its hold before it saw its version still committed
    # (docs/design/lineage.md, "Forks").
    held = held_files(store, release_stale=True)  # also when nothing goes: a deleted fork
    candidates = [*plan.data_files, *plan.held]
    doomed = [] if held is None else [k for k in candidates if k not in held]
    if doomed:
        before_delete(doomed)
        for key in doomed:
            store.delete(key)
    release_holds(store, plan.needed, before_release=before_delete)
    for prefix in _PREFIXES:
        for name in store.remove_incomplete(prefix):
            log.info("removed %s from %s: left by a write that never committed", name, store.url)


def _step_of_version_key(key: str) -> int | None:
    parts = key.split("/")
    if len(parts) >= 3 and parts[0] == "versions" and parts[1].isdigit():
        return int(parts[1])
    return None
