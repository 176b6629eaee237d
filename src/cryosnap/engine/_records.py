"""Commit records and manifests of one tier: list the committed steps, read a commit record,
read a manifest and check it against the hash its referrer recorded.

The bottom of the engine: every pipeline (resolve, write, read, retire) reads versions through
these functions, and this module imports none of them. Runs on whichever thread calls it (the
Checkpointer's background thread for writes and retention, the caller's for reads); no
collectives here.
"""

from __future__ import annotations

import xxhash

from ..errors import CheckpointFormatError, CheckpointNotFoundError, IntegrityError
from ..manifest import CommitRecord, Manifest, ManifestRef, commit_key, step_of_commit_key
from ..storage import Store

__all__ = ["list_steps", "read_commit", "read_manifest", "step_exists"]


def _no_fence() -> None:
    """The default ``fence`` of a commit or a retention pass: a writer that holds no lock."""
    return None


def list_steps(store: Store) -> list[int]:
    """Steps with a commit record on ``store``, ascending."""
    steps = (step_of_commit_key(k) for k in store.list("versions"))
    return sorted(s for s in steps if s is not None)


def step_exists(store: Store, step: int) -> bool:
    """Whether ``step`` is committed on ``store`` (its commit record exists)."""
    return store.exists(commit_key(step))


def read_commit(store: Store, step: int) -> CommitRecord:
    key = commit_key(step)
    try:
        data = store.read(key)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"step {step} not found in {store.url}") from None
    record = CommitRecord.from_json(data, f"{store.url}: {key}")
    if record.step != step:
        raise CheckpointFormatError(
            f"{store.url}: {key} is the commit record of step {record.step}"
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
        raise IntegrityError(f"step {step}, tier {store.url}: manifest {key} is missing") from None
    if (nbytes is not None and len(data) != nbytes) or xxhash.xxh3_128_hexdigest(data) != xxh3:
        raise IntegrityError(
            f"step {step}, tier {store.url}: manifest {key} does not match its recorded hash"
        )
    return Manifest.from_json(data, f"{store.url}: {key}")
