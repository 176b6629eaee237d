"""Commit records and manifests of one tier: list the committed steps, read a commit record,
read a manifest and check it against the hash its referrer recorded.

The bottom of the engine: every pipeline (resolve, write, read, retire) reads versions through
these functions, and this module imports none of them. Runs on whichever thread calls it (the
Checkpointer's background thread for writes and retention, the caller's for reads); no
collectives here.
"""

from __future__ import annotations

import xxhash

from cryosnap._format.commit import CommitRecord, ManifestRef
from cryosnap._format.keys import (
    Lineage,
    commit_key,
    parse_commit_key,
    version_prefix,
    visible_versions,
)
from cryosnap._format.manifest import Manifest
from cryosnap.errors import CheckpointFormatError, CheckpointNotFoundError, IntegrityError
from cryosnap.storage import Store

__all__ = [
    "list_records",
    "list_steps",
    "list_versions",
    "read_commit",
    "read_manifest",
    "step_exists",
    "versions_among",
]


def _no_fence() -> None:
    """The default ``fence`` of a commit or a retention pass: a writer that holds no lock."""
    return None


def list_records(store: Store, prefix: str = "versions") -> list[tuple[int, Lineage | None]]:
    """Every commit record on ``store`` (under ``prefix``), superseded ones included."""
    parsed = (parse_commit_key(k) for k in store.list(prefix))
    return [p for p in parsed if p is not None]


def list_versions(*stores: Store) -> dict[int, Lineage | None]:
    """The versions of ``stores`` (the levels of one run): step -> lineage of its commit
    record, ascending by step; superseded records (docs/FORMAT.md, "Superseding") are not
    versions, whichever of the stores holds the record that supersedes them."""
    return visible_versions([r for store in stores for r in list_records(store)])


def versions_among(store: Store, *others: Store) -> dict[int, Lineage | None]:
    """The versions on ``store`` that are versions of the run whose other levels are
    ``others``: a record there that a record on another level supersedes (a rewind saved
    there after this level was left behind) is none. ``store`` is listed once."""
    records = list_records(store)
    here = visible_versions(records)
    run = visible_versions([*records, *(r for other in others for r in list_records(other))])
    return {s: lin for s, lin in here.items() if s in run and run[s] == lin}


def list_steps(store: Store) -> list[int]:
    """Steps of the versions on ``store`` (committed and not superseded), ascending."""
    return list(list_versions(store))


def step_exists(store: Store, step: int) -> bool:
    """Whether ``step`` is a version on ``store`` (committed and not superseded)."""
    return step in list_versions(store)


class _Newest:
    """The default lineage of :func:`read_commit`: the newest committed at the step."""


NEWEST = _Newest()


def read_commit(
    store: Store, step: int, lineage: Lineage | _Newest | None = NEWEST
) -> CommitRecord:
    """The commit record of version ``step`` (``lineage``: of that lineage; by default the
    newest generation committed at that step, the only one that can be a version there)."""
    if isinstance(lineage, _Newest):
        at = [lin for s, lin in list_records(store, version_prefix(step)) if s == step]
        if not at:
            raise CheckpointNotFoundError(
                f"step {step} not found in {store.url}", step=step, path=store.url
            )
        lineage = max(at, key=lambda lin: 0 if lin is None else lin.generation)
    key = commit_key(step, lineage)
    try:
        data = store.read(key)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(
            f"step {step} not found in {store.url}", step=step, path=store.url
        ) from None
    record = CommitRecord.from_json(data, f"{store.url}: {key}")
    if record.step != step or record.lineage != lineage:
        raise CheckpointFormatError(
            f"{store.url}: {key} is the commit record of step {record.step}"
            + ("" if record.step != step else f" of lineage {record.lineage}")
        )
    return record


def read_manifest(store: Store, record: CommitRecord, rank: int) -> tuple[Manifest, ManifestRef]:
    refs = [m for m in record.manifests if m.rank == rank]
    if not refs:
        raise CheckpointNotFoundError(
            f"step {record.step} in {store.url} has no rank {rank} (world size {record.world_size})"
        )
    ref = refs[0]
    manifest = _load_manifest(store, ref.key, ref.xxh3, ref.nbytes, record.step)
    if manifest.step != record.step or manifest.rank != rank:
        raise CheckpointFormatError(
            f"{store.url}: {ref.key} describes step {manifest.step} rank {manifest.rank}"
        )
    return manifest, ref


def _load_manifest(store: Store, key: str, xxh3: str, nbytes: int | None, step: int) -> Manifest:
    try:
        data = store.read(key)
    except CheckpointNotFoundError:
        # The commit record (or a successor's base reference) names it: it is damage.
        raise IntegrityError(
            f"step {step}, tier {store.url}: manifest {key} is missing", step=step, path=key
        ) from None
    if (nbytes is not None and len(data) != nbytes) or xxhash.xxh3_128_hexdigest(data) != xxh3:
        raise IntegrityError(
            f"step {step}, tier {store.url}: manifest {key} does not match its recorded hash",
            step=step,
            path=key,
        )
    return Manifest.from_json(data, f"{store.url}: {key}")
