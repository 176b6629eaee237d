"""``Run.fork``: a new run whose first version is a version of another, sharing its data files
where both runs lie on one local file system, and what ``cryosnap log``/``ls`` say of a run's
lineage (its ancestors, and the forks that hold its files).

Runs on the caller's thread; takes the fork's write lock while it is created (a writer of the
source run goes on meanwhile: docs/design/lineage.md, "Forks", has the protocol). No
collectives.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from cryosnap import engine
from cryosnap._format.document import now_unix
from cryosnap._format.forks import FORK_KEY, ForkRecord, new_token
from cryosnap._format.keys import parse_commit_key
from cryosnap._run.lock import LOCK_KEY, acquire_run_lock
from cryosnap.engine import copy_version, create_fork, fork_record, holds, plan_fork
from cryosnap.errors import CheckpointExistsError, CheckpointNotFoundError
from cryosnap.storage import LinkedStore, Store, location_of, open_run_store

__all__ = ["RunLineage", "fork_run", "lineage_of"]


def fork_run(
    source: Store, step: int, dest: str | os.PathLike[str] | Store, options: dict[str, Any]
) -> tuple[Store, bool]:
    """Make the run at ``dest`` a fork of version ``step`` of ``source``; returns its store and
    whether it shares the source's data files (False: the chunks it needs were copied, once)."""
    if not engine.step_exists(source, step):
        raise CheckpointNotFoundError(
            f"step {step} not found in {source.url}", step=step, path=source.url
        )
    store = open_run_store(dest, **options)
    _check_empty(store)
    shared = _same_file_system(source, store)
    lock = acquire_run_lock(store)
    try:
        _check_empty(store)  # again under the lock: another fork() may have won
        if shared:
            plan = plan_fork(
                source,
                step,
                source_location=location_of(source),
                fork_location=location_of(store),
            )
            create_fork(source, plan, store)
        else:
            _copy(source, step, store, lock.check)
    finally:
        lock.release()
        if isinstance(store, LinkedStore):
            store.forget_fork_record()
    return store, shared


def _copy(source: Store, step: int, store: Store, fence: Callable[[], None]) -> None:
    """The fork as a copy of the chunks the version reads; its ``FORK.json`` (written first)
    names the source and no ancestor: it reads nothing of it."""
    token = new_token()
    commit = engine.read_commit(source, step).to_json()
    record = ForkRecord(
        token, location_of(source), step, xxhash.xxh3_128_hexdigest(commit), (), now_unix()
    )
    fence()
    store.write(FORK_KEY, record.to_json())
    copy_version(source, step, store, token=token[:8], fence=fence)


def _check_empty(store: Store) -> None:
    """Refuse a ``dest`` that holds anything but an unfinished fork (``FORK.json`` and
    manifests without a commit record: a fork() that was killed, done again)."""
    keys = store.list("")
    unfinished = not any(parse_commit_key(k) is not None for k in keys)
    left = [
        k
        for k in keys
        if k not in (FORK_KEY, LOCK_KEY)
        and not (unfinished and k.startswith(("versions/", "data/")))
    ]
    if left:
        raise CheckpointExistsError(
            f"cannot fork into {store.url}: it is not empty (it holds {left[0]}"
            + (f" and {len(left) - 1} more" if len(left) > 1 else "")
            + "); give a new or empty directory",
            path=store.url,
        )


def _same_file_system(source: Store, dest: Store) -> bool:
    """Whether a fork at ``dest`` can name ``source``'s files: both local directories on one
    file system (a hard link could, too; a name does not cross file systems' lifetimes)."""
    a, b = source.capabilities.local_path, dest.capabilities.local_path
    if a is None or b is None:
        return False
    try:
        return os.stat(a).st_dev == os.stat(_existing(str(b))).st_dev
    except OSError:
        return False


def _existing(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


@dataclass(frozen=True, slots=True)
class RunLineage:
    """Where a run comes from and what was forked from it: ``parent`` and ``step`` (None: no
    fork), ``ancestors`` (the parent first), and ``forks``: ``(fork location, step)`` of every
    fork holding files of this run, directly or through forks in between."""

    parent: str | None
    step: int | None
    ancestors: tuple[str, ...]
    forks: tuple[tuple[str, str, int], ...]  # (fork, forked from, step)


def lineage_of(store: Store) -> RunLineage:
    """The lineage of the run on ``store``, from its ``FORK.json`` and holds (no data read;
    an unreadable hold is left out)."""
    record = fork_record(store)
    forks = tuple(
        sorted((h.fork, h.parent, h.step) for h in holds(store) if not isinstance(h, Exception))
    )
    if record is None:
        return RunLineage(None, None, (), forks)
    return RunLineage(record.parent, record.step, record.ancestors, forks)
