"""``cryosnap.Run``: a handle on a run for reading it (list, describe, verify, diff, load; the
lineage's history of a leaf and changes between versions, in ``_lineage.py``) and for
removing versions, and ``cryosnap.flush``: the API the command line is built on.

Reading takes no lock and writes nothing; opening a Run only lists the run. Given the run's
scratch, ``verify`` checks every level: the persistent one and each rank's scratch part.
``remove`` and ``gc`` take the run's write lock, as a writer does, and delete with the
reference counting of retention (:mod:`cryosnap.engine`'s ``plan_retire``/``apply_retire``);
so does ``flush``, which finishes a dead writer's flushes (``_run/scavenge.py``). The
caller's thread; no collectives but ``flush``'s, one process per rank of the run.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from cryosnap import _forks, _lineage, engine
from cryosnap._forks import RunLineage
from cryosnap._format.keys import commit_key
from cryosnap._format.limits import MAX_STEP
from cryosnap._format.manifest import Replicated
from cryosnap._format.stats import LeafStats
from cryosnap._inspect import (
    LeafInfo,
    VersionDiff,
    describe_leaves,
    diff_versions,
    scratch_parts,
)
from cryosnap._located import located
from cryosnap._run import health
from cryosnap._run.lock import LOCK_KEY, acquire_run_lock
from cryosnap._run.memory import MemoryRun, memory_root, memory_runs, remove_orphans
from cryosnap._run.options import PathLike, RunOptions, ScratchLike
from cryosnap._run.scavenge import FlushedVersion, FlushFailure, FlushReport, flush_run
from cryosnap._validate import boolean, positive_int, seconds, wrong_type
from cryosnap._validate import step as validate_step
from cryosnap.checkpointer import load
from cryosnap.dist import Coordinator
from cryosnap.dist._environ import job_coordinator
from cryosnap.engine import VersionSpace
from cryosnap.errors import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    IntegrityError,
    RunLockedError,
)
from cryosnap.storage import Store, open_run_store, open_store

__all__ = [
    "Damage",
    "FlushFailure",
    "FlushReport",
    "FlushedVersion",
    "LevelCheck",
    "MAX_STEP",
    "MemoryRun",
    "Removal",
    "Run",
    "RunLineage",
    "VerifyReport",
    "VersionCheck",
    "VersionInfo",
    "VersionSpace",
    "VersionSummary",
    "committed_steps",
    "flush",
    "is_dcp_version",
    "memory_levels",
    "memory_root",
    "remove_orphaned_memory",
    "runs_inside",
]

_DCP_ROOT = "cryosnap.dcp"  # cryosnap.dcp._schema.ROOT (that package imports torch)


@dataclass(frozen=True, slots=True)
class VersionSummary:
    """One version as :meth:`Run.summary` describes it, from its commit record alone (no
    manifest read): the whole version's figures, ``data_files`` the number of its files."""

    step: int
    created_unix: float
    world_size: int
    leaves: int
    logical_bytes: int
    written_bytes: int
    data_files: int
    chunk_bytes: int


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """One version as :meth:`Run.info` describes it, from its commit record and one rank's
    manifest (no data read).

    ``leaves``, ``blobs`` and ``rank_bytes`` are rank ``rank``'s part; ``logical_bytes`` (the
    state's size) and ``written_bytes`` (the new data the version wrote) the whole version's.
    ``replicated``: the top-level keys saved as identical on every rank (True: the whole
    state; None: none). ``base_step``: the version an incremental version builds on.
    """

    step: int
    world_size: int
    ranks: tuple[int, ...]
    replicated: Replicated
    rank: int
    leaves: tuple[LeafInfo, ...]
    blobs: int
    rank_bytes: int
    logical_bytes: int
    written_bytes: int
    chunk_bytes: int
    base_step: int | None
    incremental: bool
    created_unix: float


@dataclass(frozen=True, slots=True)
class Damage:
    """What verification found wrong in one version: ``rank``'s part (None: the commit record
    itself); ``error`` names the step, tier, leaf and chunk or file."""

    rank: int | None
    error: str


@dataclass(frozen=True, slots=True)
class VersionCheck:
    """The outcome of verifying every rank of one version (the figures are None when its
    commit record cannot be read). ``level``: the level this copy of the version is on
    (``persistent``, ``scratch``, ``scratch rank-00001``), None when the Run was given no
    scratch (then the run is one store, whichever level it is); a scratch rank part holds
    that rank's part alone (``world_size`` 1), and its damage names that rank."""

    step: int
    damage: tuple[Damage, ...]
    world_size: int | None = None
    leaves: int | None = None
    logical_bytes: int | None = None
    level: str | None = None
    # The run's retention (or a gc) deleted the version while it was verified: no damage,
    # and nothing more to say about it (a live writer with a small ``keep``).
    retired: bool = False

    @property
    def ok(self) -> bool:
        return not self.damage

    @property
    def errors(self) -> tuple[str, ...]:
        """One line per damage, starting with the level when it is known."""
        prefix = "" if self.level is None else f"{self.level}: "
        return tuple(prefix + d.error for d in self.damage)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {} if self.level is None else {"level": self.level}
        doc |= {
            "step": self.step,
            "ok": self.ok,
            "world_size": self.world_size,
            "leaves": self.leaves,
            "logical_bytes": self.logical_bytes,
            "errors": list(self.errors),
        }
        return doc | {"retired": True} if self.retired else doc


@dataclass(frozen=True, slots=True)
class LevelCheck:
    """The versions of one level as :meth:`Run.verify` checked them (a Run given scratch):
    ``name`` as :attr:`VersionCheck.level` says it, ``url`` where the level (its first
    device) is, ``rank`` the rank whose scratch part it is (None: the whole level)."""

    name: str
    url: str
    versions: tuple[VersionCheck, ...]
    rank: int | None = None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.versions)

    @property
    def damaged(self) -> tuple[VersionCheck, ...]:
        return tuple(c for c in self.versions if not c.ok)

    def to_json(self) -> dict[str, Any]:
        return {
            "level": self.name,
            "url": self.url,
            "rank": self.rank,
            "ok": self.ok,
            "steps": [c.step for c in self.versions],
            "damaged": [c.step for c in self.damaged],
        }


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """The outcome of :meth:`Run.verify`: one check per version, ascending; given the run's
    scratch, per level (persistent first, then each scratch part by rank), ``levels`` the
    levels checked (those that hold no version included)."""

    versions: tuple[VersionCheck, ...]
    levels: tuple[LevelCheck, ...] = ()

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.versions)

    @property
    def damaged(self) -> tuple[VersionCheck, ...]:
        return tuple(c for c in self.versions if not c.ok)

    @property
    def damaged_levels(self) -> tuple[str, ...]:
        """The names of the levels that hold damage (empty without scratch: see ``ok``)."""
        return tuple(level.name for level in self.levels if not level.ok)


@dataclass(frozen=True, slots=True)
class Removal:
    """What :meth:`Run.remove` or :meth:`Run.gc` deleted (with ``dry_run``: would delete):
    the versions, then the manifests and data files no remaining version needs."""

    removed: tuple[int, ...]
    kept: tuple[int, ...]
    manifests: tuple[str, ...]
    data_files: tuple[str, ...]
    freed_bytes: int
    dry_run: bool
    # Bytes of the removed versions' data files that stay: kept versions still read them.
    still_read_bytes: int = 0
    # The leftovers of writes that never committed (a killed save's partial file), deleted
    # too; their bytes are in ``freed_bytes`` (the uncommitted files a write completed are
    # among ``manifests`` and ``data_files``).
    incomplete: tuple[str, ...] = ()


class Run:
    """A handle on the run at ``path`` (a directory, an fsspec URL or a Store).

    Reading takes no lock and creates nothing, so it works beside a running Checkpointer.
    ``storage_options`` go to fsspec. A path that holds no run raises
    :class:`~cryosnap.CheckpointNotFoundError` naming it.

    ``scratch``: the run's scratch level as the Checkpointer was given it (a directory, or
    its devices in order); :meth:`verify` then checks it too, every rank's part found on this
    node (``<scratch>/rank-<r>`` in a distributed run), and names the level of each damage.
    ``path`` is then the persistent level. The other methods read the persistent level only.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Store,
        *,
        storage_options: dict[str, Any] | None = None,
        scratch: ScratchLike = None,
    ) -> None:
        # Checked as the Checkpointer checks its scratch= (no I/O); found when verified.
        self._scratch = RunOptions(path=path, scratch=scratch).scratch_devices
        self._store = open_run_store(path, **(storage_options or {}))
        _check_is_run(self._store)

    def __repr__(self) -> str:
        return f"Run({self.url!r})"

    @property
    def url(self) -> str:
        """Where the run is: its directory or URL."""
        return self._store.url

    # -- versions ------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The committed versions, ascending."""
        return engine.list_steps(self._store)

    def latest_step(self) -> int | None:
        """The newest committed version, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def info(self, step: int | None = None, *, rank: int = 0) -> VersionInfo:
        """Version ``step`` (default: the newest), with the leaves of rank ``rank``'s part."""
        step = self._step_or_latest(step)
        rank = validate_step(rank, "rank")
        record = engine.read_commit(self._store, step)
        manifest, _ref = engine.read_manifest(self._store, record, rank)
        bases = [s for s in record.chain if s < step]
        return VersionInfo(
            step=step,
            world_size=record.world_size,
            ranks=tuple(sorted(ref.rank for ref in record.manifests)),
            replicated=manifest.replicated,
            rank=rank,
            leaves=tuple(describe_leaves(manifest)),
            blobs=len(manifest.blobs),
            rank_bytes=manifest.logical_bytes,
            logical_bytes=record.logical_bytes,
            written_bytes=record.written_bytes,
            chunk_bytes=record.chunk_bytes,
            base_step=max(bases) if bases else None,
            incremental=record.incremental,
            created_unix=record.created_unix,
        )

    def space(self) -> list[VersionSpace]:
        """Per version, oldest first, the bytes of data files it keeps alive: those it wrote,
        those of earlier versions it reads, and of these the ones whose version is gone (it
        pins them). From the commit records and one size per file; takes no lock. A version
        whose commit record is damaged has no entry (:meth:`summary` raises for it)."""
        return engine.version_space(self._store)

    def summary(self, step: int) -> VersionSummary:
        """Version ``step`` from its commit record only (what ``cryosnap ls`` lists): cheaper
        than :meth:`info`. A damaged record raises CheckpointFormatError or IntegrityError."""
        record = engine.read_commit(self._store, validate_step(step))
        return VersionSummary(
            step=step,
            created_unix=record.created_unix,
            world_size=record.world_size,
            leaves=record.leaves,
            logical_bytes=record.logical_bytes,
            written_bytes=record.written_bytes,
            data_files=len(record.data_files),
            chunk_bytes=record.chunk_bytes,
        )

    def verify(self, step: int | None = None) -> VerifyReport:
        """Read and hash every chunk of every rank of ``step`` (default: of every version);
        damage is reported, not raised. A missing ``step`` raises CheckpointNotFoundError.

        Given ``scratch``, every level is checked, each copy of a version on its own (a
        restore that reads scratch never reads the persistent copy): ``step`` is checked on
        the levels that hold it, and is missing only when none does.
        """
        step = None if step is None else validate_step(step)
        if not self._scratch:
            if step is not None:
                return VerifyReport((_verify_version(self._store, step),))
            return VerifyReport(_verify_steps(self._store, self.steps()))
        levels = [_verify_level("persistent", self._store, self.steps(), step)]
        for part in scratch_parts(self._scratch):
            steps = _scratch_steps(part.store, self._store)
            levels.append(_verify_level(part.level, part.store, steps, step, rank=part.rank))
        if len(levels) == 1:  # no part on this node: said, not damage (node-local scratch)
            levels.append(LevelCheck("scratch", open_store(self._scratch[0].path).url, ()))
        if step is not None and not any(level.versions for level in levels):
            raise CheckpointNotFoundError(
                f"step {step} not found in {self.url} nor on its scratch "
                f"({', '.join(level.url for level in levels[1:])})"
            )
        return VerifyReport(tuple(c for level in levels for c in level.versions), tuple(levels))

    def diff(self, a: int, b: int, *, rank: int = 0) -> VersionDiff:
        """Which leaves of rank ``rank``'s part changed from step ``a`` to step ``b``, and
        how many bytes, from the chunk hashes (see :func:`cryosnap._inspect.diff_versions`)."""
        a, b = validate_step(a, "a"), validate_step(b, "b")
        return diff_versions(self._store, a, b, rank=validate_step(rank, "rank"))

    def load(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        keys: Sequence[str | int] | None = None,
        rank: int | None = None,
        map_location: Any = None,
        allow_pickle: bool = False,
    ) -> Any:
        """Version ``step`` (default: the newest that verifies), as :func:`cryosnap.load`
        (``keys``: only those top-level keys are read and verified)."""
        return load(
            self._store,
            step=step,
            into=into,
            keys=keys,
            rank=rank,
            allow_pickle=allow_pickle,
            map_location=map_location,
        )

    # -- lineage -------------------------------------------------------------------------------

    def history(
        self,
        leaf: str,
        steps: Sequence[int] | None = None,
        *,
        rank: int = 0,
        allow_pickle: bool = False,
    ) -> Iterator[tuple[int, Any]]:
        """``(step, value)`` of one leaf, or of a subtree, across versions, ascending.

        ``leaf``: a path as ``cryosnap inspect`` and :meth:`info` print them (``model/w``;
        a container's path gives its subtree, built as :meth:`load` builds it; ``<root>``
        the whole state). ``steps``: those versions only (default: every version). Only
        the leaf's chunks are read, each verified; a version whose leaf has the chunk
        hashes (and node) of the version yielded before it is not read again: **the same
        value object is yielded again**, so copy a value before changing it. Values are
        what :meth:`load` would return for that leaf: tensors, arrays, scalars; pickled
        leaves only with ``allow_pickle=True`` (it runs code from the checkpoint).

        Every manifest is read when this is called, before any data: a version of
        ``steps`` without the leaf raises :class:`~cryosnap.errors.KeyNotFoundError`
        naming the path, the step and the closest paths. With ``steps`` None the versions
        without it are skipped, as long as one holds it (else the same error). A leaf
        whose kind, dtype or shape changes between versions yields what each version
        holds, with one ``UserWarning`` naming the steps where it changed. ``rank``: that
        rank's part of each version (as :meth:`info`'s).
        """
        if not isinstance(leaf, str):
            wrong_type(leaf, "leaf", "a leaf path (str) as `cryosnap inspect` prints it")
        if not leaf:
            raise ValueError("leaf='' names no leaf: give a path as `cryosnap inspect` prints")
        return _lineage.history(
            self._store,
            leaf,
            _steps_asked(steps),
            rank=validate_step(rank, "rank"),
            allow_pickle=boolean(allow_pickle, "allow_pickle"),
        )

    def changes(
        self, a: int, b: int, *, rank: int = 0, allow_pickle: bool = False
    ) -> Iterator[tuple[str, Any]]:
        """``(leaf path, value in b)`` of each leaf that step ``b`` added or changed since
        step ``a``, in ``b``'s tree order: found from the two versions' chunk hashes (as
        :meth:`diff`, before this returns), then only those leaves are read, in batches.
        Leaves of ``a`` that ``b`` removed are not yielded: :meth:`diff` lists them
        (status ``removed``). Values as :meth:`history`'s."""
        a, b = validate_step(a, "a"), validate_step(b, "b")
        return _lineage.changes(
            self._store,
            a,
            b,
            rank=validate_step(rank, "rank"),
            allow_pickle=boolean(allow_pickle, "allow_pickle"),
        )

    def stats(self, step: int, *, rank: int = 0) -> dict[str, LeafStats]:
        """Per floating-point leaf of ``step`` (paths as ``cryosnap inspect`` prints them), the
        :class:`~cryosnap.LeafStats` recorded when it was saved (NaN and Inf counts, min, max,
        mean, L2 norm), from rank ``rank``'s manifest: no data is read. Leaves left out:
        views into a storage shared with other tensors, and leaves whose bytes another rank
        hashed. A version saved without statistics raises
        :class:`~cryosnap.errors.StatsNotRecordedError`."""
        step = validate_step(step)
        with located(step=step, path=self._store.url):
            if not engine.step_exists(self._store, step):
                raise self._not_found(step)
            return health.version_stats(self._store, step, validate_step(rank, "rank"))

    def marks(self, step: int) -> set[str]:
        """The marks of version ``step``: the labels given with ``Checkpointer.mark``, and
        "unhealthy" where a floating-point leaf held NaN or Inf when it was saved (from the
        statistics of every rank's manifest). Reads mark records and manifests, no data."""
        step = validate_step(step)
        with located(step=step, path=self._store.url):
            if not engine.step_exists(self._store, step):
                raise self._not_found(step)
            return health.version_marks([self._store], step)

    # -- forks ---------------------------------------------------------------------------------

    def fork(
        self,
        step: int,
        dest: str | os.PathLike[str] | Store,
        *,
        storage_options: dict[str, Any] | None = None,
    ) -> Run:
        """A new run at ``dest`` whose first version is version ``step`` of this run, bit for
        bit; a ``Checkpointer(dest)`` continues it, saving incrementally against it.

        Where both runs are directories on one file system, the fork names this run's data
        files instead of copying them (creating it writes its manifests only), and this run's
        retention, ``remove`` and ``gc`` keep every file a fork still reads; elsewhere (another
        file system, an object store) only the chunks the version reads are copied, once.
        ``dest`` must be new or empty (:class:`~cryosnap.errors.CheckpointExistsError`);
        ``storage_options`` are ``dest``'s. Takes ``dest``'s write lock while it is made;
        this run's writer may go on meanwhile. docs/design/lineage.md has the protocol.
        """
        step = validate_step(step)
        with located(step=step, path=self._store.url):
            store, _shared = _forks.fork_run(self._store, step, dest, storage_options or {})
        return Run(store)

    def lineage(self) -> RunLineage:
        """Where this run was forked from (its ancestors, the parent first) and the forks that
        read its files: from ``FORK.json`` and the holds, no data read."""
        return _forks.lineage_of(self._store)

    # -- removing ------------------------------------------------------------------------------

    def remove(self, step: int, *, dry_run: bool = False) -> Removal:
        """Delete version ``step``: its commit record first, then the manifests and data files
        no remaining version needs (a later version built on it still restores).

        Takes the run's write lock (:class:`~cryosnap.errors.RunLockedError` while a writer
        holds it); with ``dry_run`` only says what would go, and takes no lock.
        """
        step = validate_step(step)
        if step not in self.steps():
            raise self._not_found(step)
        return self._retire(f"remove step {step}", dry_run, drop=[step], expect=[step])

    def gc(self, *, keep: int, dry_run: bool = False) -> Removal:
        """Keep the newest ``keep`` versions; delete the others as :meth:`remove` does, and
        every file no version references (what a killed or failed save left behind)."""
        return self._retire("collect garbage", dry_run, keep=positive_int(keep, "keep"))

    def _retire(
        self, what: str, dry_run: bool, *, expect: Sequence[int] = (), **options: Any
    ) -> Removal:
        store = self._store
        if dry_run:
            return self._removal(engine.plan_retire(store, **options), dry_run=True)
        try:
            lock = acquire_run_lock(store)
        except RunLockedError as exc:
            raise RunLockedError(f"cannot {what}: {exc}") from None
        try:
            plan = engine.plan_retire(store, **options)
            missing = [s for s in expect if s not in plan.dropped]
            if missing:  # retired by a writer between our listing and the lock
                raise self._not_found(missing[0])
            removal = self._removal(plan, dry_run=False)
            engine.apply_retire(store, plan, fence=lock.check)
        finally:
            lock.release()
        return replace(removal, kept=tuple(self.steps()))

    def _removal(self, plan: engine.RetirePlan, *, dry_run: bool) -> Removal:
        """``plan`` as a Removal, its files measured before anything is deleted."""
        store = self._store
        dropped = set(plan.dropped)
        keys = [commit_key(s) for s in plan.dropped] + plan.manifests + plan.data_files
        incomplete = engine.incomplete_files(store)
        freed = sum(_size(store, k) for k in keys) + sum(incomplete.values())
        kept = tuple(s for s in self.steps() if s not in dropped)
        return Removal(
            tuple(plan.dropped),
            kept,
            tuple(plan.manifests),
            tuple(plan.data_files),
            freed,
            dry_run,
            sum(_size(store, k) for k in self._still_read(plan)),
            tuple(sorted(incomplete)),
        )

    def _still_read(self, plan: engine.RetirePlan) -> set[str]:
        """The data files of ``plan``'s dropped versions that it keeps: kept versions read
        them (an incremental version pins what it reads until it goes itself)."""
        versions = engine.list_versions(self._store)
        files: set[str] = set()
        for step in plan.dropped:
            with contextlib.suppress(CheckpointNotFoundError):
                files.update(engine.read_commit(self._store, step, versions.get(step)).data_files)
        return files - set(plan.data_files)

    # -- helpers -------------------------------------------------------------------------------

    def _step_or_latest(self, step: int | None) -> int:
        if step is not None:
            return validate_step(step)
        latest = self.latest_step()
        if latest is None:
            raise CheckpointNotFoundError(f"no committed version in {self.url}")
        return latest

    def _not_found(self, step: int) -> CheckpointNotFoundError:
        return CheckpointNotFoundError(f"step {step} not found in {self.url}")


def _steps_asked(steps: Sequence[int] | None) -> list[int] | None:
    """``steps=`` of :meth:`Run.history`, checked and ascending (None stays None)."""
    if steps is None:
        return None
    if isinstance(steps, (str, bytes)) or not isinstance(steps, Sequence):
        wrong_type(steps, "steps", "None or a sequence of steps (int)")
    asked = [validate_step(s, "steps") for s in steps]
    if len(set(asked)) != len(asked):
        raise ValueError(f"steps={list(steps)!r:.120} names a step twice")
    return sorted(asked)


def flush(
    path: PathLike,
    *,
    scratch: ScratchLike,
    storage_options: dict[str, Any] | None = None,
    comm: Coordinator | None = None,
    retry_seconds: float = 300.0,
) -> FlushReport:
    """Finish the flush of a run whose program died: every version committed on ``scratch``
    and not yet on the persistent level at ``path`` is copied there as the writer's own flush
    would have (every chunk verified, the commit record last; superseded versions never).

    ``retry_seconds``: how long the versions' copies are retried in all when the persistent
    level fails (as ``Checkpointer(flush_retry_seconds=)``; 0: one attempt each), so that a job
    epilogue with a time limit ends within it; a version not flushed stays on scratch and is
    reported in :attr:`FlushReport.failed`.

    ``scratch``: the run's scratch device(s), as given to the Checkpointer. For a distributed
    run with node-local scratch, call it in one process per rank of the run (``mpiexec -n N``,
    ``torchrun``): ``comm`` None finds the job from the environment (torch.distributed when
    initialized or under torchrun, MPI under an MPI launcher, else a world of one). Takes the
    run's write lock (recovered from a dead writer; :class:`~cryosnap.errors.RunLockedError`
    while a live one holds it). Running it again flushes nothing. A damaged scratch copy is
    reported in :attr:`FlushReport.failed`, naming the leaf; nothing of it is committed.
    """
    if scratch is None:
        raise ValueError("scratch= is required: the run's scratch device(s) to flush from")
    retry_seconds = seconds(retry_seconds, "retry_seconds", allow_zero=True)  # named as here
    close: Callable[[], None] = _nothing
    if comm is None:
        comm, close = job_coordinator()
    try:
        options = RunOptions(
            path=path,
            scratch=scratch,
            storage_options=storage_options,
            comm=comm,
            flush_retry_seconds=retry_seconds,
        )
        return flush_run(options, comm)
    finally:
        close()


def _nothing() -> None:
    return None


def _size(store: Store, key: str) -> int:
    try:
        return store.size(key)
    except CheckpointNotFoundError:
        return 0  # already gone (a pass that failed midway deleted it)


_DAMAGE = (IntegrityError, CheckpointFormatError)


def _verify_steps(store: Store, steps: Sequence[int]) -> tuple[VersionCheck, ...]:
    checks = []
    for s in steps:
        try:
            checks.append(_verify_version(store, s))
        except CheckpointNotFoundError:  # listed, and its commit record gone since
            checks.append(VersionCheck(s, (), retired=True))
    return tuple(checks)


def _verify_level(
    name: str, store: Store, steps: Sequence[int], step: int | None, *, rank: int | None = None
) -> LevelCheck:
    """The versions ``steps`` of one level (only ``step`` if given), named ``name``; a
    scratch part of rank ``rank`` is a run of one rank, whose damage is that rank's."""
    checks = _verify_steps(store, [s for s in steps if step is None or s == step])
    named = tuple(replace(c, level=name, damage=_of_rank(c.damage, rank)) for c in checks)
    return LevelCheck(name, store.url, named, rank)


def _of_rank(damage: tuple[Damage, ...], rank: int | None) -> tuple[Damage, ...]:
    if rank is None:
        return damage
    return tuple(d if d.rank is None else replace(d, rank=rank) for d in damage)


def _scratch_steps(part: Store, persistent: Store) -> list[int]:
    """The versions on a scratch part that are versions of the run: a record superseded by
    a rewind saved later (on either level) is not one (as the flush sees them)."""
    return list(engine.versions_among(part, persistent))


def _verify_version(store: Store, step: int) -> VersionCheck:
    """Read and hash every chunk of every rank of ``step``.

    A missing commit record raises CheckpointNotFoundError (the version does not exist); any
    other failure to read it back is damage, reported rather than raised, unless the commit
    record is gone by then: the run's writer retired the version while it was read (its
    records go first, then its files), which is no damage (``retired``).
    """
    try:
        record = engine.read_commit(store, step)
    except _DAMAGE as exc:
        return VersionCheck(step, (Damage(None, _one_line(str(exc))),))
    damage: list[Damage] = []
    for ref in record.manifests:
        try:
            engine.verify_part(store, step, rank=ref.rank)
        except (*_DAMAGE, CheckpointNotFoundError) as exc:
            # Inside a committed version, a missing manifest or data file is damage too.
            damage.append(Damage(ref.rank, _one_line(str(exc))))
    figures = (record.world_size, record.leaves, record.logical_bytes)
    if damage and not store.exists(record.key):
        return VersionCheck(step, (), *figures, retired=True)
    return VersionCheck(step, tuple(damage), *figures)


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _check_is_run(store: Store) -> None:
    """Raise CheckpointNotFoundError naming ``store`` unless it holds a run (a committed
    version, or what a writer leaves before its first commit). Lists, creates nothing."""
    if engine.list_steps(store) or store.list("data") or store.list("versions"):
        return
    if store.exists(LOCK_KEY):
        return
    inner = runs_inside(store)
    if inner:
        raise CheckpointNotFoundError(
            f"no committed version in {store.url}; it holds the run(s) "
            + ", ".join(inner)
            + " (a run with scratch tiers is one run per tier)"
        )
    if _holds_anything(store):
        raise CheckpointNotFoundError(
            f"{store.url} is not a cryosnap run: it holds no versions/, data/ or {LOCK_KEY}, "
            f"and no run just below it (searched 1 level, up to {_INSIDE_ENTRIES} entries)",
            path=store.url,
        )
    raise CheckpointNotFoundError(f"no checkpoint at {store.url}")


# How many entries of a directory that is not a run are looked at for runs just below it.
_INSIDE_ENTRIES = 1000


def runs_inside(store: Store) -> list[str]:
    """Directories just below a local path that are runs (e.g. a demo's ``persistent``).

    One level, the first :data:`_INSIDE_ENTRIES` entries, unreadable ones skipped: the path
    may be any directory (``/usr``), never walked."""
    root = store.capabilities.local_path
    found: list[str] = []
    if root is None:
        return found
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in itertools.islice(entries, _INSIDE_ENTRIES):
            with contextlib.suppress(OSError):
                if entry.is_dir() and os.path.isdir(os.path.join(entry.path, "versions")):
                    found.append(entry.path)
    return sorted(found)


def _holds_anything(store: Store) -> bool:
    """Whether ``store`` holds anything: a local directory is only opened, not walked (it may
    be a whole tree that is no run); an unreadable one holds nothing it could show."""
    root = store.capabilities.local_path
    if root is None:
        return bool(store.list(""))
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        return next(entries, None) is not None
    return False


def committed_steps(path: str | os.PathLike[str] | Store) -> list[int]:
    """The committed steps of the run at ``path``, ascending; CheckpointNotFoundError when
    there are none (naming the runs just below it, if it holds runs rather than being one).

    Unlike :class:`Run`, a path holding only an unfinished run is "no committed version"
    (what ``cryosnap export`` and :class:`cryosnap.dcp.StorageReader` say by default)."""
    store = open_store(path)
    steps = engine.list_steps(store)
    if not steps:
        inner = runs_inside(store)
        if inner:
            raise CheckpointNotFoundError(
                f"no committed version in {store.url}; it holds the run(s) "
                + ", ".join(inner)
                + " (a run with scratch tiers is one run per tier)"
            )
        if _holds_anything(store):
            raise CheckpointNotFoundError(f"no committed version in {store.url}")
        raise CheckpointNotFoundError(f"no checkpoint at {store.url}")
    return steps


def is_dcp_version(store: Store, step: int) -> bool:
    """Whether ``step`` was written through torch.distributed.checkpoint (``cryosnap.dcp``):
    rank 0's state is the one key ``cryosnap.dcp`` (its manifest only is read; no torch)."""
    record = engine.read_commit(store, step)
    skeleton = engine.read_manifest(store, record, 0)[0].skeleton
    if not isinstance(skeleton, dict) or skeleton.get("t") != "dict":
        return False
    return skeleton.get("k") == [_DCP_ROOT]


# -- memory levels --------------------------------------------------------------------------------


def memory_levels() -> list[MemoryRun]:
    """This user's memory levels (``Checkpointer(memory=...)``) on this node, under
    ``$CRYOSNAP_MEMORY_ROOT`` (default ``/dev/shm``): each one's run, bytes, live holders, and
    whether it is an orphan."""
    return memory_runs(memory_root())


def remove_orphaned_memory() -> list[MemoryRun]:
    """Delete the memory levels no live process holds (a run killed and never opened again:
    its next open would have taken its level over); the ones removed."""
    return remove_orphans(memory_root())
