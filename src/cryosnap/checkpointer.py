"""Checkpointer: the facade of a managed run, and the one-shot ``save`` / ``load`` over it.

It turns the arguments into a :class:`~cryosnap._run.options.RunOptions`, has the rooms opened
(``_run/open.py``) and keeps what the caller sees: pending saves and failures not yet received.
docs/ARCHITECTURE.md draws the rooms; docs/design/run.md has the two phases of a save.
Runs on the caller's thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Generic, NoReturn, TypeVar, overload

from cryosnap import _validate, engine
from cryosnap._run.health import make_choice
from cryosnap._run.health import write_mark as mark_version
from cryosnap._run.job import Job
from cryosnap._run.levels.levels import Levels
from cryosnap._run.open import OpenRun, newest_record, open_run
from cryosnap._run.options import PathLike, RunOptions
from cryosnap._run.policy_room import PolicyRoom
from cryosnap._run.restore import Ask, device_for, restore_one, restore_run, rewound_lineage
from cryosnap._run.results import PendingSave, SaveInfo, Status
from cryosnap._run.saves import Saves
from cryosnap._validate import step as validate_step
from cryosnap.dist import Coordinator
from cryosnap.errors import CheckpointError, CheckpointNotFoundError
from cryosnap.policy import RetentionPolicy, SavePolicy
from cryosnap.storage import DEFAULT_TIMEOUT_SECONDS, Store, open_run_store
from cryosnap.storage.striped import Device, StripedStore

__all__ = [
    "Checkpointer",
    "PathLike",
    "PendingSave",
    "SaveInfo",
    "Status",
    "load",
    "run_id_of",
    "save",
]

log = logging.getLogger("cryosnap")

T = TypeVar("T")


class _Option(Generic[T]):
    """A Checkpointer attribute that reads ``options.<name>``; it cannot be assigned."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __set_name__(self, owner: type, attribute: str) -> None:
        self._attribute = attribute

    @overload
    def __get__(self, obj: None, owner: type) -> _Option[T]: ...
    @overload
    def __get__(self, obj: _Opened, owner: type) -> T: ...
    def __get__(self, obj: _Opened | None, owner: type) -> _Option[T] | T:
        if obj is None:
            return self
        value: T = getattr(obj.options, self._name)
        return value

    def __set__(self, obj: _Opened, value: object) -> NoReturn:
        raise AttributeError(
            f"Checkpointer.{self._attribute} is read-only: it is an argument of the "
            "Checkpointer, given when the run is opened (ckpt.options)"
        )


class _Opened:
    """What a :class:`Checkpointer` was opened with, read-only, and its save policy and
    preemption: the facade's accessors, apart from its lifecycle (save, restore, close)."""

    _options: RunOptions
    _run: OpenRun
    _levels: Levels
    _policies: PolicyRoom

    # what it was opened with -------------------------------------------------------------------
    @property
    def options(self) -> RunOptions:
        """The validated arguments this Checkpointer was opened with (read-only)."""
        return self._options

    @property
    def run_id(self) -> str | None:
        """The run id recorded with each version this Checkpointer saves (None: none)."""
        return self._options.run_id

    @property
    def coordinator(self) -> Coordinator:
        """The run's participants (this one's view)."""
        return self._run.coordinator

    @property
    def store(self) -> Store:
        """Where versions are written first (the scratch level, else the persistent one)."""
        return self._levels.first.store

    @property
    def persistent(self) -> Store:
        return self._run.persistent

    @property
    def scratch(self) -> StripedStore | None:
        """The scratch devices as one striped store (None: no scratch level)."""
        return self._run.scratch

    # Read-only: the options they were opened with (assigning one raises AttributeError).
    keep = _Option[RetentionPolicy | None]("retention")
    keep_scratch = _Option[int]("scratch_keep")
    incremental = _Option[bool]("incremental")
    full_every = _Option[int]("full_every")
    chunk_bytes = _Option[int]("chunk_bytes")
    max_inflight = _Option[int]("max_inflight")
    allow_pickle = _Option[bool]("allow_pickle")

    # what the last restore read ----------------------------------------------------------------
    _restored: int | None = None
    _restored_from: str | None = None

    @property
    def restored_step(self) -> int | None:
        """The step the last :meth:`restore` returned (None: none yet)."""
        return self._restored

    @property
    def restored_from(self) -> str | None:
        """The level this participant's part of the last :meth:`restore` came from: "memory",
        "partner-memory" (rebuilt at open from the other nodes'), "scratch", "persistent"."""
        return self._restored_from

    # policies and preemption ----------------------------------------------------------------
    @property
    def policy(self) -> SavePolicy | None:
        """The save policy :meth:`should_save` asks (None: saves only when called)."""
        return self._policies.policy

    @property
    def preempted(self) -> bool:
        """Whether a preemption signal arrived (``handle_signals``); settable by the program."""
        return self._policies.preempted

    @preempted.setter
    def preempted(self, value: bool) -> None:
        self._policies.preempted = bool(value)

    def should_save(self, step: int) -> bool:
        """Whether to save at ``step``: asks the save policy (call once per iteration); always
        true once the run is preempted. Every participant gets the same answer: rank 0's
        policy, or yes when any participant is preempted."""
        return self._policies.should_save(validate_step(step))


def _from_config(cls: type[Checkpointer], source: Any, /, **overrides: Any) -> Checkpointer:
    """A Checkpointer whose arguments come from ``source`` (a TOML file's path, or a
    mapping), overridden by ``CRYOSNAP_<ARGUMENT>`` environment variables (``CRYOSNAP_PATH``,
    ``CRYOSNAP_SCRATCH=/nvme0,/nvme1``, ``CRYOSNAP_KEEP=3``, ``CRYOSNAP_INCREMENTAL=false``,
    ``CRYOSNAP_FLUSH_RETRY_SECONDS=5m``...), overridden by ``overrides``.

    The keys are the constructor's arguments, ``path`` included; ``scratch`` is a path, a
    list of paths, or ``[[scratch]]`` tables of ``path`` and ``capacity_bytes``. Objects
    (``policy``, ``comm``, ``clock``) are keywords only. An unknown key or a value of the
    wrong type is a :class:`~cryosnap.ConfigError` naming the key and where it came from.
    """
    from cryosnap._run.config import config_arguments

    args = config_arguments(source, overrides)
    return cls(args.pop("path"), **args)


class Checkpointer(_Opened):
    """A managed run: versions by step, saved in the background, restored on demand.

    Parameters
    ----------
    path
        The run's persistent tier: a directory or an fsspec URL (``s3://bucket/run``).
    scratch
        The scratch level's node-local devices, fastest first: a path, a
        :class:`~cryosnap.Device` (``Tier``, its former name, is the same class), or a list of them
        (several devices: each version's data is split across them by measured throughput).
        Versions land there first and are flushed to ``path`` in the background.
    keep
        Versions to keep on the persistent tier: an int (the newest N), a retention policy from
        :mod:`cryosnap.policy` (``KeepEvery``, ``KeepBest`` by a metric given to ``save``,
        ``KeepAny`` of several), or None (all). The newest version is always kept. Others go
        after each commit; a data file or manifest only when no kept version needs it.
    keep_scratch
        Versions to keep on scratch (default 2; with ``scratch``), each until it is persistent.
    incremental
        Write only chunks new since the previous version (True), or every version in full.
    full_every
        With ``incremental``, a full (self-contained) version at least every N versions, which
        bounds the chain a restore has to resolve.
    chunk_bytes
        Chunk size for hashing and verification, 4 KiB to 64 MiB.
    staging_bytes
        Host memory budget for captured state (None: as much as the state needs, kept for
        reuse); with less, capture streams and blocks until the writer frees buffers.
    direct_io
        How data files reach a level's disk. None (default): with ``O_DIRECT`` (from the
        page-aligned staging buffers, bypassing the page cache) on every level whose file
        system takes it, probed once at open; buffered through the page cache elsewhere
        (tmpfs, object stores, many FUSE and network file systems). True: direct on every
        local level, and one whose file system refuses it is a :class:`~cryosnap.DirectIOError`
        at open naming the level. False: buffered everywhere. A :class:`~cryosnap.Device`'s
        own ``direct_io`` overrides it for that scratch device.
    max_inflight
        Versions that may be captured but not yet durable; a further ``save`` waits.
    allow_pickle
        Pickle leaves of unsupported types on save, and allow unpickling them on restore.
    policy
        When to save: a save policy from :mod:`cryosnap.policy` (``EveryNSteps``,
        ``EveryNSeconds``, ``Adaptive``), asked by :meth:`should_save`, told each save's cost.
    handle_signals
        Signals (e.g. ``(signal.SIGTERM, signal.SIGUSR1)``) that mark the run as preempted
        instead of killing it: :attr:`preempted` becomes true, :meth:`should_save` says yes,
        and the loop saves and exits. Installed on open, restored on close (main thread).
    storage_options
        Options for fsspec when ``path`` is a URL (endpoint, credentials); the usual
        ``AWS_*`` environment variables work too.
    flush_retry_seconds
        How long a failing flush to the persistent tier is retried (with backoff) before the
        version's ``result()`` and the next ``wait()`` raise; it stays on scratch meanwhile.
    storage_timeout_seconds
        The longest one storage call (a read, a write of one batch, a listing, an fsync) may
        take before it fails with :class:`~cryosnap.StorageTimeoutError`: a stalled tier (a hung
        NFS mount, an endpoint that accepts connections and never answers) becomes an error
        instead of a hang. None: no bound. With it, :meth:`close` returns within about
        ``flush_retry_seconds`` plus a few storage calls, whatever the tiers do.
    comm
        The run's participants: None (the torch.distributed job when it is initialized with
        several processes, through a ``TorchCoordinator``; else a world of one), or a
        :class:`cryosnap.dist.Coordinator` (``TorchCoordinator``, ``MPICoordinator``)
        (e.g. one rank of :class:`cryosnap.dist.InProcessGroup`). Every participant saves its
        own part of each version; rank 0 takes the write lock and commits once every part is
        durable. With ``scratch`` each participant keeps its whole part on its node's scratch
        (under ``<scratch>/rank-<r>``), and the persistent level gets each version written
        again from there, its replicated state split across the participants
        (docs/DISTRIBUTED.md).
    partner
        With several participants and ``scratch``: also copy each participant's scratch part
        to the scratch of a participant on another node (node: the host name, or
        ``$CRYOSNAP_NODE``), as part of the scratch commit. A participant whose scratch lost
        versions its partner holds gets them back when the run is opened again. ``"xor"``:
        instead of a whole copy, XOR parity across sets of k participants on k distinct nodes
        (k at most ``$CRYOSNAP_XOR_SET_SIZE``, default 8): about 1/(k-1) of a part more per
        participant; one lost node per set is rebuilt at open, verified (docs/DISTRIBUTED.md).
        ``"rs:K+M"`` (e.g. ``"rs:4+2"``): Reed-Solomon parity across sets of at least K+M
        participants on as many distinct nodes (zfec: ``pip install 'cryosnap[rs]'``): about
        M/K of a part more per participant; any M lost nodes of a set are rebuilt at open,
        verified.
    memory
        Bytes per participant (``"4GiB"``) of a memory level: its newest version in shared
        memory, read first by :meth:`restore` (README, "Memory level"). None: none.
    clock
        The monotonic clock (seconds) the save policy is told the time by; tests pass a fake.
    run_id
        Which training this is (1 to 128 of ``A-Z a-z 0-9 . _ : -``), recorded with every
        version it saves. When the run's newest version was saved by another training (another
        run id, or none), opening raises :class:`~cryosnap.CheckpointError`: a new training
        goes to a new path; resuming one passes its id (:func:`run_id_of`). None: no check,
        versions carry no id.
    device_diff
        Find the chunks that changed since the previous version where the tensors live
        (128-bit fingerprints computed on the device, kept there), and copy only those to the
        host: for GPU state, only changed chunks cross PCIe. None (default): for CUDA tensors
        of 4 MiB or more, when CUDA is available; True: for torch tensors on any device,
        the CPU included; False: never. Needs ``incremental`` and a ``chunk_bytes`` of whole
        32-bit words. Such a version builds on exactly the previous one: the first version of
        a session and one every ``full_every`` are full, and if a version fails, one captured
        against it meanwhile fails too (the next is captured in full).
    stats
        Record per float leaf its NaN and Inf counts, min, max, mean and L2 norm at save
        (:meth:`cryosnap.Run.stats`; NaN or Inf marks a version "unhealthy"). False: none, for
        the writer thread's time they take (docs/PERFORMANCE.md).
    codec
        The persistent level's data files (flushed from ``scratch`` or written directly):
        None, ``"zstd"``, ``"auto"`` (README, "Compressing the persistent level").
    """

    def __init__(
        self,
        path: PathLike,
        *,
        scratch: PathLike | Device | Sequence[PathLike | Device] | None = None,
        keep: int | RetentionPolicy | None = None,
        keep_scratch: int | None = None,
        incremental: bool = True,
        full_every: int = 16,
        chunk_bytes: int = 1 << 20,
        staging_bytes: int | None = None,
        direct_io: bool | None = None,
        max_inflight: int = 1,
        allow_pickle: bool = False,
        policy: SavePolicy | None = None,
        handle_signals: Sequence[int] = (),
        storage_options: dict[str, Any] | None = None,
        flush_retry_seconds: float = 300.0,
        storage_timeout_seconds: float | None = DEFAULT_TIMEOUT_SECONDS,
        comm: Coordinator | None = None,
        clock: Callable[[], float] = time.monotonic,
        run_id: str | None = None,
        device_diff: bool | None = None,
        partner: bool | str = False,
        stats: bool = True,
        memory: int | str | None = None,
        codec: str | None = None,
    ) -> None:
        self._options = RunOptions(
            path=path,
            scratch=scratch,
            keep=keep,
            keep_scratch=keep_scratch,
            incremental=incremental,
            full_every=full_every,
            chunk_bytes=chunk_bytes,
            staging_bytes=staging_bytes,
            direct_io=direct_io,
            max_inflight=max_inflight,
            allow_pickle=allow_pickle,
            policy=policy,
            handle_signals=handle_signals,
            storage_options=storage_options,
            flush_retry_seconds=flush_retry_seconds,
            storage_timeout_seconds=storage_timeout_seconds,
            comm=comm,
            clock=clock,
            run_id=run_id,
            device_diff=device_diff,
            partner=partner,
            stats=stats,
            memory=memory,
            codec=codec,
        )
        run = open_run(self._options)
        self._run = run
        self._levels = run.levels
        self._capturer = run.capturer
        self._writer = run.writer
        self._policies = run.policies
        self._saves = Saves(run, self._options)
        # The lineage new versions are committed in: the run's newest generation, or a new one
        # once a restore rewound the run (docs/FORMAT.md, "Superseding").
        self._lineage = run.lineage
        self._closed = False

    # context manager ---------------------------------------------------------------------------
    from_config = classmethod(_from_config)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        # Drain and release, but do not mask the exception already propagating, and do not
        # keep retrying flushes to an unreachable persistent tier meanwhile. The memory level
        self._run.keep_memory = True  # stays for the restart, as after a kill
        self._levels.abandon()
        try:
            self.close()
        except CheckpointError as err:
            log.error("background checkpoint failure during exception exit: %s", err)

    def __repr__(self) -> str:
        return f"Checkpointer({self.store.url!r})"

    # saving --------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        lazy: bool = False,
        metrics: dict[str, float] | None = None,
        replicated: bool | Sequence[str | int] | None = None,
    ) -> PendingSave:
        """Capture ``state`` as version ``step`` and write it in the background.

        Returns once the state is captured (``lazy=False``) or at once (``lazy=True``: the copy
        runs in the background; the next ``step()`` of an optimizer in the state waits for the
        leaves it mutates, and other leaves may be mutated only after ``wait_captured()``).
        ``metrics`` (name -> finite number, e.g. ``{"loss": 0.31}``) are stored with the version
        for retention policies such as ``KeepBest``. Every participant saves the same steps.
        ``replicated`` (a list of top-level keys of ``state``, or True for all of it) names
        state identical on every participant (data-parallel model and optimizer): it is
        written once in total, each participant writing its share of the new chunks, after
        the participants checked it is identical (else :class:`~cryosnap.ReplicaDivergenceError`
        on every one, nothing committed); it restores on any number of participants
        (``restore(replicated_only=True)``). In a world of one it changes nothing but the record.
        """
        t0 = time.perf_counter()
        returned = threading.Event()
        job = self._start(step, state, t0, _metrics(metrics), replicated, returned, lazy=lazy)
        try:
            if lazy:
                self._capturer.lazy(job, t0)
            else:
                captured = self._capturer.eager(job)
                error = job.pending._tracker.error
                if captured and error is not None:
                    job.pending.mark_delivered()
                    raise error
            self._policies.event("saved", step, stall_seconds=self._options.clock() - job.clock0)
        except KeyboardInterrupt as exc:
            _note_interrupt(exc, job)
            raise
        finally:
            # The whole call blocked the caller: flattening, the capture (or the start of a
            # lazy one and its thread's first hold of the GIL), the policy's bookkeeping.
            job.stall_clock = self._options.clock() - job.clock0
            job.stall_seconds = time.perf_counter() - t0
            returned.set()
        return job.pending

    def _save_durable(self, step: int, state: Any, *, reuse: bool = True) -> SaveInfo:
        """Save without staging: the writer reads the live memory while the caller waits.
        ``reuse``: keep the flatten for a next save (False: this Checkpointer saves once)."""
        t0 = time.perf_counter()
        job = self._start(step, state, t0, reuse=reuse)
        self._capturer.direct(job)
        info = job.pending.result()
        # The caller was blocked from entry until durable: all of it is the stall.
        return dataclasses.replace(info, stall_seconds=time.perf_counter() - t0)

    def _start(
        self,
        step: int,
        state: Any,
        t0: float,
        metrics: dict[str, float] | None = None,
        replicated: object = None,
        returned: threading.Event | None = None,
        *,
        reuse: bool = True,
        lazy: bool = False,
    ) -> Job:
        clock0 = self._options.clock()
        self._check_open()
        return self._saves.start(
            step,
            state,
            t0,
            clock0=clock0,
            lineage=self._lineage,
            metrics=metrics,
            replicated=replicated,
            returned=returned,
            reuse=reuse,
            lazy=lazy,
        )

    # waiting and reading -----------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every pending save is durable and the writer is done with it (the
        files that retention drops are deleted after a version is reported: once this returns
        the run's folder holds what ``keep`` says); raise the first undelivered failure."""
        self._saves.drain()
        self._writer.settle()
        self._saves.raise_undelivered()

    def steps(self) -> list[int]:
        """Versions complete on at least one tier and superseded on none, ascending."""
        return sorted(self._levels.versions())

    def status(self) -> Status:
        """Which versions each tier holds, and which are not yet on the last one."""
        return self._levels.status()

    def latest_step(self) -> int | None:
        """The newest committed version (complete on at least one tier, superseded on none),
        or None. Not necessarily one that verifies: :meth:`restore` without a step falls back
        past damage, and says which step it restored through :meth:`restored_step`."""
        steps = self.steps()
        return steps[-1] if steps else None

    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        keys: Sequence[str | int] | None = None,
        replicated_only: bool = False,
        map_location: Any = None,
        healthy: bool = False,
        mark: str | None = None,
    ) -> Any:
        """The state of ``step`` (default: the newest version that verifies, the same on every
        participant); see :func:`load` (``keys``, ``map_location``, ``healthy`` and ``mark``
        too: every participant chooses among the versions it finds allowed, and they agree).

        ``replicated_only``: only the keys saved as replicated (a dict of them; ``into``, a
        dict holding them, gets them filled and its other keys are left alone), on any number
        of participants. Without it, a version saved by another number of ranks than restore
        it (parts left unread, or a participant without a part) is a
        :class:`~cryosnap.WorldSizeError` on every participant, saying what it can do.
        """
        self._check_open()
        if step is not None:
            validate_step(step)
        state, restored, store = restore_run(
            self._levels,
            self._run.restore_channel,
            step,
            into=into,
            allow_pickle=self.allow_pickle,
            only=_validate.boolean(replicated_only, "replicated_only"),
            keys=engine.validate_keys(keys),
            device=device_for(map_location, into),
            choice=make_choice(step, healthy, mark),
            memory=self._run.memory_store,
        )
        self._restored_from = self._run.level_of(store, restored)
        self._rewound(restored)
        return state

    def mark(self, step: int, label: str) -> None:
        """Label committed version ``step`` ``label`` (say ``"eval_ok"``), durably and safe
        from kills, for ``restore(mark=)`` and :meth:`cryosnap.Run.marks` (docs/FORMAT.md,
        "Marks"). The caller's thread; no collectives: any participant may mark."""
        with self._levels.files_lock:  # not while retention removes unfinished writes
            mark_version(self._levels.stores(), step, label, fence=self._levels.fence)

    def _rewound(self, step: int) -> None:
        """After restoring ``step``: the lineage of the next versions (restore.py)."""
        self._restored = step
        self._saves.newest = None  # the next save may go back to any step (a rewind)
        channel = self._run.restore_channel
        self._lineage, restart = rewound_lineage(self._levels, channel, step, self._lineage)
        if restart:
            self._levels.chain.restart_from(step)

    def close(self) -> None:
        """Drain every pending save, stop the writer, release the write lock.

        Returns within about ``flush_retry_seconds`` plus a few storage calls (each bounded by
        ``storage_timeout_seconds``) whatever the tiers do.
        """
        if self._closed:
            return
        # Every flush still queued gets flush_retry_seconds in all, not each.
        self._levels.finish_within(self._options.flush_retry_seconds)
        try:
            self._saves.drain()
        finally:
            self._closed = True
            try:
                self._capturer.remove_spent_hooks()
                self._writer.stop()
                self._levels.close_handoffs()
                # The last versions reached the next levels: the faster ones' retention applies.
                self._levels.retire_all_after_close()
                self._capturer.clear()
                self._saves.flattened.keep(None)  # the kept packs' memory goes back too
            finally:
                self._levels.release_locks()
                self._run.release_signals()
                self._run.close_memory()
        self._saves.raise_undelivered()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"{self!r} is closed")


def _note_interrupt(exc: KeyboardInterrupt, job: Job) -> None:
    """Ctrl-C during ``save()``: say whether the version is lost or will still commit."""
    tracker = job.pending._tracker
    if tracker.captured() and tracker.error is None:
        what = (
            f"cryosnap: step {job.step} was captured before the interrupt and is still being "
            "written: it commits unless the process exits first (wait() or close() waits for it)"
        )
    else:
        what = f"cryosnap: step {job.step} was interrupted during capture and is not saved"
    if hasattr(exc, "add_note"):  # Python 3.11+
        exc.add_note(what)
    else:
        log.error("%s", what)


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
    (:class:`~cryosnap.CheckpointExistsError`): versions are never overwritten in place. No
    staging copy is made: the caller waits while the bytes go to storage.
    """
    validate_step(step)
    with Checkpointer(path, chunk_bytes=chunk_bytes, allow_pickle=allow_pickle) as ckpt:
        return ckpt._save_durable(step, state, reuse=False)


def load(
    path: PathLike,
    *,
    step: int | None = None,
    into: Any = None,
    keys: Sequence[str | int] | None = None,
    rank: int | None = None,
    allow_pickle: bool = False,
    map_location: Any = None,
    healthy: bool = False,
    mark: str | None = None,
) -> Any:
    """Load version ``step`` (default: the newest that verifies) of the run at ``path``.

    Without ``into`` the saved tree comes back (torch tensors on the CPU, numpy arrays, stateful
    objects as their state dicts). With ``into`` tensors and arrays are filled in place (on
    their own devices) and ``load_state_dict`` is called; a mismatch or damaged data raises
    before anything changes. ``keys`` (a list or tuple of top-level keys of a dict state):
    only those keys are read and verified (damage elsewhere does not matter) and a dict of
    them comes back; ``into`` gets only those keys filled. ``map_location`` (a str or
    ``torch.device``: ``"cuda"``, ``"cuda:1"``) puts every torch tensor of the returned tree
    on that device, once every chunk verified (not with ``into``). ``rank`` reads another
    rank's part of a distributed version (default: part 0). Takes no lock.

    Without ``step``: ``healthy=True`` takes the newest version not marked "unhealthy" (no
    NaN or Inf recorded in any float leaf when it was saved), ``mark="eval_ok"`` the newest
    carrying that mark (``Checkpointer.mark``); a warning names the newer versions skipped.
    Either with an explicit ``step`` is a ValueError.
    """
    if step is not None:
        validate_step(step)
    choice = make_choice(step, healthy, mark)
    part = 0 if rank is None else validate_step(rank, "rank")
    ask = Ask(
        ranks=(part,),
        shared=(True,),
        participants=None,
        allow_pickle=allow_pickle,
        keys=engine.validate_keys(keys),
        device=device_for(map_location, into),
        choice=choice,
    )
    return restore_one(open_run_store(path), step, into=into, ask=ask)


def run_id_of(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> str | None:
    """The run id of the newest version of the run at ``path`` (None: saved without one).

    Read-only, takes no lock. Raises :class:`~cryosnap.CheckpointNotFoundError` when the run
    holds no version. Resume a training with ``Checkpointer(path, run_id=run_id_of(path))``.
    """
    store = path if isinstance(path, Store) else open_run_store(path, **(storage_options or {}))
    newest = newest_record(store)
    if newest is None:
        raise CheckpointNotFoundError(f"{store.url} holds no version")
    return newest.run_id


def _metrics(metrics: object) -> dict[str, float] | None:
    if metrics is None:
        return None
    if not isinstance(metrics, dict):
        raise TypeError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metrics: names must be str, got {name!r}")
        if hasattr(value, "item") and callable(value.item):
            value = value.item()  # a 0-d tensor or numpy scalar
        out[name] = _validate.number(value, f"metrics[{name!r}]")
    return out
