"""Forks that share storage (docs/design/lineage.md, "Forks"): create a fork of one version,
and the holds that an ancestor's retention honours.

:func:`create_fork` writes, in this order, the fork's ``FORK.json``, a hold in each ancestor
whose files the version reads, then (once the version is seen still committed after the holds)
the version's manifests and commit record in the fork, each naming the ancestors' data files
instead of copying them. :func:`held_files` is what retention keeps for the forks of a run,
:func:`release_holds` what a fork gives back once none of its versions reads an ancestor.
Runs on the calling thread (``Run.fork``) or the run's writer (retention); no collectives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import xxhash

from cryosnap._format.commit import CommitRecord, ManifestRef
from cryosnap._format.document import now_unix
from cryosnap._format.forks import (
    FORK_KEY,
    HOLDS_PREFIX,
    ForkRecord,
    Hold,
    ancestor_key,
    hold_key,
    new_token,
    split_ancestor_key,
    token_of_hold_key,
)
from cryosnap._format.keys import commit_key
from cryosnap._format.manifest import FORK_FORMAT_VERSION, Manifest
from cryosnap.engine._records import list_records
from cryosnap.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
)
from cryosnap.storage import LinkedStore, Store, location_of

__all__ = [
    "ForkPlan",
    "create_fork",
    "fork_record",
    "held_files",
    "holds",
    "plan_fork",
    "release_holds",
]

log = logging.getLogger("cryosnap")


def fork_record(store: Store) -> ForkRecord | None:
    """The ``FORK.json`` of the run on ``store`` (None: no fork)."""
    if isinstance(store, LinkedStore):
        return store.fork_record()
    try:
        data = store.read(FORK_KEY)
    except CheckpointNotFoundError:
        return None
    return ForkRecord.from_json(data, f"{store.url}/{FORK_KEY}")


def holds(store: Store) -> list[Hold | CheckpointError]:
    """The holds of the forks of the run on ``store``; one that cannot be read is its error."""
    out: list[Hold | CheckpointError] = []
    for key in store.list(HOLDS_PREFIX):
        if token_of_hold_key(key) is None:
            continue
        try:
            out.append(Hold.from_json(store.read(key), f"{store.url}/{key}"))
        except CheckpointNotFoundError:
            continue  # released since the listing
        except CheckpointError as exc:
            out.append(exc)
    return out


def held_files(store: Store, *, release_stale: bool = False) -> set[str] | None:
    """The data files of ``store`` that forks of its run still read (None: a hold could not
    be read, so every file is kept this time). With ``release_stale``, a hold whose fork is
    provably gone (its directory's parent exists and it holds no ``FORK.json`` of that token)
    is deleted first: deleting a fork's directory releases what it held."""
    files: set[str] = set()
    for hold in holds(store):
        if isinstance(hold, CheckpointError):
            log.error("%s: keeping every data file this time: %s", store.url, hold)
            return None
        if release_stale and _fork_gone(hold):
            log.info("%s: released the hold of %s (the fork is gone)", store.url, hold.fork)
            store.delete(hold.key)
            continue
        files.update(hold.data_files)
    return files


def _fork_gone(hold: Hold) -> bool:
    """Whether the fork ``hold`` names is provably gone: only a local fork whose parent
    directory is there (a missing parent may be an unmounted file system: kept)."""
    path = hold.fork
    if not os.path.isabs(path) or not os.path.isdir(os.path.dirname(path)):
        return False
    try:
        with open(os.path.join(path, FORK_KEY), "rb") as f:
            record = ForkRecord.from_json(f.read(), f"{path}/{FORK_KEY}")
    except FileNotFoundError:
        return True
    except (OSError, CheckpointError):
        return False  # unreadable or damaged: not provably gone
    return record.token != hold.token


def release_holds(
    store: Store, needed: Collection[str], *, before_release: Callable[[list[str]], None]
) -> list[str]:
    """Empty the holds of the fork on ``store`` in each ancestor that none of ``needed`` (the
    data files its remaining versions read) names; returns the ancestors released.
    ``before_release`` is told the fork's keys of the files given back first."""
    if not isinstance(store, LinkedStore):
        return []  # a scratch level: never a fork
    record = store.fork_record()
    if record is None:
        return []
    used = {parsed[0] for k in needed if (parsed := split_ancestor_key(k)) is not None}
    released = []
    for index, url in enumerate(record.ancestors):
        if index in used:
            continue
        ancestor = store.opener(url)
        key = hold_key(record.token)
        if not ancestor.exists(key):
            continue
        try:
            hold = Hold.from_json(ancestor.read(key), f"{url}/{key}")
        except CheckpointNotFoundError:
            continue
        if not hold.data_files:
            continue  # released before
        before_release([ancestor_key(index, f) for f in hold.data_files])
        # Emptied, not deleted: an older manifest of a kept version's chain may still name
        # one of the files (no chunk of it read), and a reader sizes it; the hold still
        # answers for this fork, so the name is "no such file", not an edited reference.
        ancestor.write(key, dataclasses.replace(hold, data_files=()).to_json())
        released.append(url)
    return released


@dataclass(frozen=True, slots=True)
class ForkPlan:
    """What :func:`create_fork` writes: the fork record, the holds (ancestor index -> the
    files of that ancestor the version reads), and the version's documents (key -> bytes;
    the commit record last)."""

    record: ForkRecord
    holds: dict[int, list[str]]
    documents: list[tuple[str, bytes]]
    source_commit: str  # the xxh3-128 of the source's commit record, checked again


def plan_fork(source: Store, step: int, *, source_location: str, fork_location: str) -> ForkPlan:
    """Read version ``step`` of ``source`` and plan its fork at ``fork_location``: the same
    manifests, each data file named as an ancestor's (``ancestors/<i>/``). Writes nothing."""
    parent = fork_record(source)
    ancestors = (source_location, *(parent.ancestors if parent is not None else ()))
    if len(set(ancestors)) != len(ancestors) or fork_location in ancestors:
        raise CheckpointFormatError(
            f"{source.url}: its lineage names {fork_location} or one run twice", path=source.url
        )
    key = commit_key(step, _lineage_at(source, step))
    data = _read(source, key, step)
    record = CommitRecord.from_json(data, f"{source.url}: {key}")

    def rename(k: str) -> str:
        parsed = split_ancestor_key(k)
        return ancestor_key(0, k) if parsed is None else ancestor_key(parsed[0] + 1, parsed[1])

    try:
        documents, refs = _manifests(source, record, rename)
    except (IntegrityError, CheckpointNotFoundError):
        if not source.exists(key):  # retention retired it while its chain was read
            raise _retired(source, step) from None
        raise
    files = tuple(sorted(rename(f) for f in record.data_files))
    held: dict[int, list[str]] = {}
    for f in files:
        parsed = split_ancestor_key(f)
        assert parsed is not None
        held.setdefault(parsed[0], []).append(parsed[1])
    # An older manifest of a chain may name an ancestor none of whose files the version reads:
    # an empty hold there lets a reader size such a file as "no such file", not an edited
    # reference (as a released hold does).
    for _key, text in documents:
        for f in json.loads(text)["data_files"]:
            parsed = split_ancestor_key(f)
            if parsed is not None:
                held.setdefault(parsed[0], [])
    fork = CommitRecord(
        step=record.step,
        world_size=record.world_size,
        manifests=tuple(refs),
        data_files=files,
        logical_bytes=record.logical_bytes,
        written_bytes=0,
        leaves=record.leaves,
        chunk_bytes=record.chunk_bytes,
        root=record.root,
        created_unix=record.created_unix,
        incremental=record.incremental,
        chain=record.chain,
        metrics=record.metrics,
    )
    documents.append((fork.key, fork.to_json()))
    token = new_token()
    plan_record = ForkRecord(
        token, source_location, step, xxhash.xxh3_128_hexdigest(data), ancestors, now_unix()
    )
    return ForkPlan(plan_record, held, documents, plan_record.parent_commit)


def _lineage_at(store: Store, step: int) -> Any:
    at = [lin for s, lin in list_records(store) if s == step]
    if not at:
        raise CheckpointNotFoundError(
            f"step {step} not found in {store.url}", step=step, path=store.url
        )
    return max(at, key=lambda lin: 0 if lin is None else lin.generation)


def _read(store: Store, key: str, step: int) -> bytes:
    try:
        return store.read(key)
    except CheckpointNotFoundError:
        raise _retired(store, step) from None


def _retired(store: Store, step: int) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(
        f"step {step} not found in {store.url} (retired while it was forked?)",
        step=step,
        path=store.url,
    )


def _manifests(
    source: Store, record: CommitRecord, rename: Callable[[str], str]
) -> tuple[list[tuple[str, bytes]], list[ManifestRef]]:
    """Every manifest of every rank's chain, oldest first, its data files renamed and its
    base reference rehashed; and the commit record's references to the newest ones."""
    written: dict[str, tuple[str, int]] = {}  # source key -> (new hash, new size)
    documents: list[tuple[str, bytes]] = []
    refs = []
    for ref in record.manifests:
        chain = _chain(source, ref.key, ref.xxh3, record.step)
        for key, doc in chain:
            if key in written:
                continue
            doc["data_files"] = [rename(f) for f in doc["data_files"]]
            doc["format_version"] = max(int(doc["format_version"]), FORK_FORMAT_VERSION)
            if doc.get("base") is not None:
                doc["base"]["xxh3_128"] = written[doc["base"]["key"]][0]
            text = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
            Manifest.from_json(text, f"the fork's {key}")  # as a reader will see it
            written[key] = (xxhash.xxh3_128_hexdigest(text), len(text))
            documents.append((key, text))
        refs.append(ManifestRef(ref.rank, ref.key, *written[ref.key]))
    return documents, refs


def _chain(source: Store, key: str, xxh3: str, step: int) -> list[tuple[str, dict[str, Any]]]:
    """The manifests from ``key`` back to a full one, oldest first, each checked against the
    hash its referrer recorded (parsed with the format's checks first)."""
    out: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    while True:
        if key in seen or len(out) > 1 << 16:
            raise CheckpointFormatError(f"{source.url}: the chain of {key} loops", path=key)
        seen.add(key)
        try:
            data = source.read(key)
        except CheckpointNotFoundError:
            raise IntegrityError(
                f"step {step}, {source.url}: manifest {key} is missing", step=step, path=key
            ) from None
        if xxhash.xxh3_128_hexdigest(data) != xxh3:
            raise IntegrityError(
                f"step {step}, {source.url}: manifest {key} does not match its recorded hash",
                step=step,
                path=key,
            )
        manifest = Manifest.from_json(data, f"{source.url}: {key}")
        out.append((key, json.loads(data)))
        if manifest.base is None:
            return out[::-1]
        key, xxh3 = manifest.base.key, manifest.base.xxh3


def create_fork(source: Store, plan: ForkPlan, fork: Store) -> None:
    """Write ``plan``: ``FORK.json``, the holds, then (the source's commit record still the
    one planned, every data file still there) the manifests and the commit record. A failure
    before the commit record takes back what was written (the holds first); a crash leaves
    an unfinished fork that ``Run.fork`` makes again, or whose holds the ancestor releases
    once its directory is gone."""
    fork.write(FORK_KEY, plan.record.to_json())
    stores = _ancestor_stores(source, plan)
    written: list[Store] = []
    try:
        for index, files in plan.holds.items():
            hold = Hold(
                plan.record.token,
                location_of(fork),
                plan.record.parent,
                plan.record.step,
                tuple(files),
                plan.record.created_unix,
            )
            written.append(stores[index])
            stores[index].write(hold.key, hold.to_json())
        _check_still_there(source, plan, stores)
        for key, text in plan.documents:
            fork.write(key, text)
    except BaseException:
        for store in written:
            with contextlib.suppress(CheckpointError):
                store.delete(hold_key(plan.record.token))
        with contextlib.suppress(CheckpointError):
            fork.delete(FORK_KEY)
        raise


def _check_still_there(source: Store, plan: ForkPlan, stores: dict[int, Store]) -> None:
    """The holds are durable: a retention pass of an ancestor that deletes the version's
    commit record from now on lists them before it deletes a file. The version still
    committed now means no pass deleted any of its files before seeing the holds."""
    step = plan.record.step
    again = _read(source, commit_key(step, _lineage_at(source, step)), step)
    if xxhash.xxh3_128_hexdigest(again) != plan.source_commit:
        raise CheckpointNotFoundError(
            f"step {step} of {source.url} was saved again while it was forked", step=step
        )
    for index, files in plan.holds.items():
        for f in files:
            if not stores[index].exists(f):
                raise IntegrityError(
                    f"step {step}, {stores[index].url}: data file {f} is missing",
                    step=step,
                    path=f,
                )


def _ancestor_stores(source: Store, plan: ForkPlan) -> dict[int, Store]:
    """The ancestors the fork reads as stores: 0 is ``source`` itself, the others its own
    ancestors (each checked as a reader checks it)."""
    out: dict[int, Store] = {}
    for index in plan.holds:
        if index == 0:
            out[0] = source
            continue
        assert isinstance(source, LinkedStore), "a fork's source is opened as a LinkedStore"
        out[index] = source.ancestor(index - 1)[0]
    return out
