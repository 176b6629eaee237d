"""The health of versions and their marks: per-leaf statistics recorded at save time
(:func:`version_stats`), whether a version holds NaN or Inf (:func:`unhealthy`), the labels
users gave versions (:func:`write_mark`, :func:`version_marks`) and the versions a restore may
choose among (:class:`Choice`).

Reads commit records, manifests and mark records, never data; writes mark records only. The
caller's thread (a restore's choice runs on each participant, its answer agreed by the
restore: restore.py); no collectives here.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from cryosnap import engine
from cryosnap._format.document import now_unix
from cryosnap._format.keys import commit_key, version_prefix
from cryosnap._format.marks import UNHEALTHY, MarkRecord, check_label, mark_key, parse_mark_key
from cryosnap._format.stats import LeafStats
from cryosnap._validate import step as validate_step
from cryosnap.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    StatsNotRecordedError,
)
from cryosnap.storage import Store

__all__ = [
    "ANY_VERSION",
    "Choice",
    "make_choice",
    "unhealthy",
    "unhealthy_leaves",
    "version_marks",
    "version_stats",
    "write_mark",
]

log = logging.getLogger("cryosnap")


def version_stats(store: Store, step: int, rank: int = 0) -> dict[str, LeafStats]:
    """Per floating-point leaf path of rank ``rank``'s part of ``step``, its statistics; a
    version saved without them raises :class:`~cryosnap.errors.StatsNotRecordedError`."""
    record = engine.read_commit(store, step)
    manifest, _ref = engine.read_manifest(store, record, rank)
    if manifest.stats is None:
        raise StatsNotRecordedError(
            f"step {step} in {store.url} was saved without per-leaf statistics (manifest "
            f"format_version {manifest.format_version}: by a cryosnap before statistics, "
            "or with Checkpointer(stats=False))",
            step=step,
            path=store.url,
        )
    return dict(manifest.stats)


def unhealthy_leaves(store: Store, step: int) -> list[str]:
    """The leaves of ``step``, on any rank, whose recorded statistics count a NaN or an Inf
    (``rank r: path`` beyond rank 0); empty where none does or none were recorded."""
    record = engine.read_commit(store, step)
    out: list[str] = []
    for ref in sorted(record.manifests, key=lambda r: r.rank):
        manifest, _ref = engine.read_manifest(store, record, ref.rank)
        for path, stats in (manifest.stats or {}).items():
            if not stats.finite:
                out.append(path if ref.rank == 0 else f"rank {ref.rank}: {path}")
    return out


def unhealthy(store: Store, step: int) -> bool:
    """Whether ``step`` holds NaN or Inf in a floating-point leaf (as recorded at save)."""
    return bool(unhealthy_leaves(store, step))


# -- marks -------------------------------------------------------------------------------------


def _commit_digest(store: Store, step: int) -> str | None:
    """The xxh3-128 of the bytes of ``step``'s commit record on ``store`` (None: no version)."""
    versions = engine.list_versions(store)
    if step not in versions:
        return None
    try:
        return xxhash.xxh3_128_hexdigest(store.read(commit_key(step, versions[step])))
    except CheckpointNotFoundError:
        return None  # retired since the listing


def write_mark(
    stores: Sequence[Store], step: object, label: object, *, fence: Callable[[], None]
) -> list[str]:
    """Label version ``step`` ``label`` on each of ``stores`` holding it: one mark record,
    written atomically (as a commit record: a kill leaves it whole or absent) after the
    version's commit record, bound to it by its hash. The stores written; none holding the
    version raises :class:`~cryosnap.errors.CheckpointNotFoundError`. ``fence()`` runs first:
    a writer that lost the run's lock writes nothing. ``step`` and ``label`` are checked
    first (TypeError, ValueError naming them)."""
    step, label = validate_step(step), check_label(label)
    fence()
    written: list[str] = []
    for store in stores:
        digest = _commit_digest(store, step)
        if digest is None:
            continue
        store.write(mark_key(step, label), MarkRecord(step, label, digest, now_unix()).to_json())
        written.append(store.url)
    if not written:
        where = " + ".join(s.url for s in stores)
        raise CheckpointNotFoundError(
            f"step {step} not found in {where}: only a committed version can be marked",
            step=step,
            path=where,
        )
    return written


def _user_marks(store: Store, step: int) -> set[str]:
    """The labels of ``step`` on ``store`` whose records name its commit record (a record of
    a version since removed, or damaged, counts for nothing)."""
    keys = [k for k in store.list(version_prefix(step)) if parse_mark_key(k) is not None]
    if not keys:
        return set()
    digest = _commit_digest(store, step)
    out: set[str] = set()
    for key in keys:
        try:
            record = MarkRecord.from_json(store.read(key), f"{store.url}: {key}")
        except CheckpointError as exc:
            log.warning("ignoring mark record %s of %s: %s", key, store.url, exc)
            continue
        if record.step == step and record.commit_xxh3 == digest:
            out.add(record.label)
    return out


def version_marks(stores: Sequence[Store], step: int) -> set[str]:
    """The marks of ``step``: the labels on any of ``stores``, and "unhealthy" where its
    statistics (on the first store holding it) count a NaN or an Inf."""
    out: set[str] = set()
    for store in stores:
        out |= _user_marks(store, step)
    for store in stores:
        if engine.step_exists(store, step):
            if unhealthy(store, step):
                out.add(UNHEALTHY)
            break
    return out


def make_choice(step: int | None, healthy: object, mark: object) -> Choice:
    """``healthy=`` and ``mark=`` of a restore or load, checked on the caller's thread: with
    an explicit ``step`` neither may be given (a ValueError says so)."""
    if not isinstance(healthy, bool):
        raise TypeError(f"healthy must be True or False, got {healthy!r:.40}")
    if mark is not None:
        mark = mark if mark == UNHEALTHY else check_label(mark)
    if step is not None and (healthy or mark is not None):
        raise ValueError(
            f"step={step} conflicts with healthy={healthy!r}, mark={mark!r}: an explicit step "
            "is restored as it is; give step=None to choose the newest healthy or marked version"
        )
    assert mark is None or isinstance(mark, str)
    return Choice(healthy, mark)


# -- the versions a restore may choose among ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Choice:
    """What a restore without a step may choose: with ``healthy`` only versions not marked
    unhealthy, with ``mark`` only versions carrying it (both: both)."""

    healthy: bool = False
    mark: str | None = None

    @property
    def any(self) -> bool:
        """Whether this choice filters at all."""
        return self.healthy or self.mark is not None

    def allows(self, stores: Sequence[Store], step: int) -> bool:
        marks = version_marks(stores, step) if self.mark is not None else set()
        if self.mark is not None and self.mark not in marks:
            return False
        if self.healthy:
            try:
                return not any(
                    unhealthy(store, step) for store in stores if engine.step_exists(store, step)
                )
            except CheckpointError:
                return True  # damage: the restore meets it, says so, and falls back
        return True

    def filter(self, stores: Sequence[Store], steps: Sequence[int], where: str) -> list[int]:
        """Of ``steps`` (ascending), those allowed; one warning names the newer ones skipped."""
        if not self.any:
            return list(steps)
        allowed = [s for s in steps if self.allows(stores, s)]
        newest = allowed[-1] if allowed else -1
        skipped = [s for s in steps if s > newest and s not in allowed]
        if skipped:
            warnings.warn(
                f"cryosnap: restoring past step(s) {', '.join(map(str, reversed(skipped)))} of "
                f"{where}: {self._why()}",
                UserWarning,
                stacklevel=2,
            )
        return allowed

    def describe(self) -> str:
        """What an allowed version is, in words."""
        parts = []
        if self.healthy:
            parts.append("healthy (no NaN or Inf recorded at save)")
        if self.mark is not None:
            parts.append(f"marked {self.mark!r}")
        return " and ".join(parts)

    def _why(self) -> str:
        parts = []
        if self.healthy:
            parts.append("unhealthy (NaN or Inf recorded at save) with healthy=True")
        if self.mark is not None:
            parts.append(f"without the mark {self.mark!r}")
        return "; or ".join(parts)


# A restore's choice without healthy= or mark=: every version.
ANY_VERSION = Choice()
