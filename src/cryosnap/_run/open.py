"""open_run: a managed run's I/O at open, from validated :class:`RunOptions` to live rooms.

Checks that the participants agree on who they are (the roll call), opens the stores, takes
the write locks, agrees on partners and rebuilds from them, drops
versions only some ranks' scratch committed, resumes interrupted hand-offs and starts the
threads, in that order; a failure anywhere undoes what was done (one ExitStack).
Runs on the caller's thread; collectives on the coordinator's channels, created in open order.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field

import cryosnap._run.signals as _signals
from cryosnap import engine
from cryosnap._format.commit import CommitRecord
from cryosnap._format.keys import Lineage, commit_key
from cryosnap._run.capture.capturer import Capturer
from cryosnap._run.chain import ChainIndex
from cryosnap._run.levels.codec import LevelCodec
from cryosnap._run.levels.levels import Level, Levels
from cryosnap._run.lock import RunLock, acquire_run_lock
from cryosnap._run.memory import MemoryLevel
from cryosnap._run.options import RunOptions
from cryosnap._run.policy_room import PolicyRoom
from cryosnap._run.redundancy.partner import Partners, rebuild
from cryosnap._run.redundancy.rs import RSParity
from cryosnap._run.redundancy.rs_rebuild import rebuild as rebuild_rs
from cryosnap._run.redundancy.xor import Parity
from cryosnap._run.redundancy.xor_rebuild import rebuild as rebuild_parity
from cryosnap._run.restore import current_lineage
from cryosnap._run.results import PendingSave
from cryosnap._run.rollcall import roll_call
from cryosnap._run.writer import Rewriter, VersionWriter, WriterThread
from cryosnap.dist import Coordinator, LocalCoordinator, agree
from cryosnap.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    RunLockedError,
)
from cryosnap.storage import (
    Store,
    check_direct_io,
    join_location,
    open_run_store,
    open_store,
    unwrap,
)
from cryosnap.storage.striped import Device, Placement, StripedStore

__all__ = ["CHANNELS", "OpenRun", "flush_channel", "newest_record", "open_run", "resume_handoffs"]

SCRATCH, PERSISTENT = "scratch", "persistent"

# The channels the rooms of a run use, each a coordinator of its own (creating one is
# collective on torch.distributed and MPI): the caller thread's (policy: PolicyRoom; restore),
# the writer thread's (retire: Levels; writer: VersionWriter), and the hand-off's into level i
# when every rank writes it again (flush_channel(i)). open_run creates CHANNELS first, in
# this order; cryosnap.dcp creates them once per process for its writers.
CHANNELS: tuple[str, ...] = ("policy", "restore", "retire", "writer")


def flush_channel(index: int) -> str:
    """The channel of the collective flush into level ``index`` (1: persistent after scratch)."""
    return f"flush-{index}"


log = logging.getLogger("cryosnap")


@dataclass(eq=False)
class OpenRun:
    """The rooms of an open run. ``pending``: the versions whose interrupted hand-off was
    resumed; ``lineage``: the one new versions are committed in (docs/FORMAT.md,
    "Superseding"); ``signals``: the preemption signals ``policies`` is subscribed to."""

    coordinator: Coordinator
    policies: PolicyRoom
    restore_channel: Coordinator
    persistent: Store
    scratch: StripedStore | None
    levels: Levels
    partners: Partners | None
    parity: Parity | RSParity | None
    memory: MemoryLevel | None
    capturer: Capturer
    writer: WriterThread
    lineage: Lineage | None
    pending: list[PendingSave] = field(default_factory=list)
    signals: list[int] = field(default_factory=list)
    # Set when the run closes on an exception: its memory level stays for the restart.
    keep_memory: bool = False

    @property
    def memory_store(self) -> Store | None:
        """The memory level's store (restore reads it first), None without one."""
        return self.memory.store if self.memory is not None else None

    def level_of(self, store: Store, step: int) -> str:
        """The name of the level whose ``store`` a restore of ``step`` read."""
        if self.memory is not None and store is self.memory.store:
            name = self.memory.level_of(step)
        else:
            name = self.levels.name_of(store)
        log.info("step %d restored from the %s level", step, name)
        return name

    def close_memory(self) -> None:
        """Remove this participant's memory level (at close), or only release it when the
        run closes on an exception (``keep_memory``): the restart reads it, as after a kill."""
        if self.memory is not None and self.keep_memory:
            self.memory.release()
        elif self.memory is not None:
            self.memory.close()

    def release_signals(self) -> None:
        """Put the program's own handlers back (where this was the last run using them)."""
        signals, self.signals = self.signals, []
        for signum in signals:
            _signals.unsubscribe(signum, self.policies)


def open_run(options: RunOptions) -> OpenRun:
    """Open the run ``options`` describe: every participant calls it at the same point."""
    coord = _coordinator(options.comm)
    options.check_world(coord.world_size)
    # One channel per thread that issues collectives: the caller's (policy, restore),
    # the writer's and the hand-offs' never interleave. Created here, in one order on every
    # rank; the rooms below take theirs by name (a channel is made once per name).
    for name in CHANNELS:
        coord.channel(name)
    roll_call(coord, run_id=options.run_id)  # before any store is opened: nothing written
    policies = PolicyRoom(options.policy, clock=options.clock, coordinator=coord)
    restore_channel = coord.channel("restore")
    persistent, scratch = open_stores(options, coord)
    if options.run_id is not None:
        check_run_id([persistent] if scratch is None else [scratch, persistent], options.run_id)
    chain = ChainIndex(
        incremental=options.incremental,
        full_every=options.full_every,
        chunk_bytes=options.chunk_bytes,
        # A distributed run's scratch holds each rank's part as a run of its own (rank 0).
        rank=coord.rank if scratch is None else 0,
    )
    with ExitStack() as undo:
        levels = open_levels(options, coord, persistent, scratch, chain, undo)
        partners = open_partners(options, coord, levels) if options.partner is True else None
        parity = open_parity(options, coord, levels)
        memory = open_memory(options, coord, persistent, undo)
        levels.observe = policies.reached
        capturer = Capturer(
            chunk_bytes=options.chunk_bytes,
            budget=options.staging_bytes,
            clock=options.clock,
            diff=options.device_diff_for(cuda=_cuda()),
            # Decided at open_levels: whether the first level writes with direct I/O.
            through=check_direct_io(levels.levels[0].store, None, levels.levels[0].name),
        )
        lineage = current_lineage(levels.records())
        # What a killed or failed save left (retention with keep=None never removes it), now
        # that this writer holds the run and before anything of its own is written.
        levels.sweep()
        inflight = threading.BoundedSemaphore(options.max_inflight)
        resumed = start_background(options, coord, levels, partners, capturer, undo)
        signals = subscribe_signals(options.signals, policies, undo)
        version = VersionWriter(
            level=levels.first,
            chain=chain,
            coordinator=coord,
            chunk_bytes=options.chunk_bytes,
            fence=levels.fence,
            placement=Placement(scratch) if scratch is not None else None,
            run_id=options.run_id,
            partners=partners,
            parity=parity,
            stats=options.stats,
        )
        writer = WriterThread(
            version,
            levels=levels,
            policy_event=policies.event,
            clock=options.clock,
            inflight=inflight,
            keep_in_memory=memory_keeper(memory, levels),
        )
        undo.pop_all()
    return OpenRun(
        coordinator=coord,
        policies=policies,
        restore_channel=restore_channel,
        persistent=persistent,
        scratch=scratch,
        levels=levels,
        partners=partners,
        parity=parity,
        memory=memory,
        capturer=capturer,
        writer=writer,
        lineage=lineage,
        pending=resumed,
        signals=signals,
    )


def _cuda() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available())


def _coordinator(comm: Coordinator | None) -> Coordinator:
    """``comm``, or without one the job this process is part of: a TorchCoordinator when
    torch.distributed is initialized with several processes (each Checkpointer gets gloo groups
    of its own, created collectively), else a world of one."""
    if comm is None:
        from cryosnap.dist._torch import TorchCoordinator, initialized_world

        return TorchCoordinator() if initialized_world() else LocalCoordinator()
    return comm


# -- stores and locks --------------------------------------------------------------------------


def open_stores(options: RunOptions, coord: Coordinator) -> tuple[Store, StripedStore | None]:
    """The persistent store and the scratch devices as one striped store (or None)."""
    timeout = options.storage_timeout_seconds
    devices = list(options.scratch_devices)
    if devices and coord.world_size > 1:
        # Node-local: ranks of one node may share a scratch path, each keeps its own run.
        devices = [Device(_rank_dir(d, coord.rank), d.capacity_bytes, d.direct_io) for d in devices]
    persistent = open_run_store(
        options.path,
        timeout_seconds=timeout,
        direct_io=options.direct_io,
        **(options.storage_options or {}),
    )
    stores = [
        open_store(t.path, timeout_seconds=timeout, direct_io=options.direct_io_of(t))
        for t in devices
    ]
    _check_distinct(persistent, stores)
    if not stores:
        return persistent, None
    return persistent, StripedStore(stores, [t.capacity_bytes for t in devices])


def _rank_dir(device: Device, rank: int) -> str:
    """``<device>/rank-<r>``: where rank ``r`` keeps its scratch part (a path: check_world)."""
    assert not isinstance(device.path, Store)
    return join_location(os.fspath(device.path), f"rank-{rank:05d}")


def _check_distinct(persistent: Store, scratch: Sequence[Store]) -> None:
    """A scratch device that is the persistent directory itself would be one run opened twice
    (its own lock would report this very process as the other writer)."""
    for device in scratch:
        if unwrap(device) == unwrap(persistent):
            raise ValueError(
                f"scratch={device.url!r} is the persistent path itself: a scratch tier must be "
                "another directory (node-local: tmpfs, NVMe)"
            )


def open_levels(
    options: RunOptions,
    coord: Coordinator,
    persistent: Store,
    scratch: StripedStore | None,
    chain: ChainIndex,
    undo: ExitStack,
) -> Levels:
    """The levels, fastest first, each with its write lock (the shared persistent level's is
    taken by rank 0 for every participant); ``undo`` releases them."""
    levels: list[Level] = []
    if scratch is not None:
        levels.append(Level(SCRATCH, scratch, options.scratch_keep, shared=False))
    codec = LevelCodec(options.codec) if options.codec is not None else None
    levels.append(Level(PERSISTENT, persistent, options.retention, shared=True, codec=codec))
    opened = Levels(levels, chain=chain, coordinator=coord)
    undo.callback(opened.release_locks)
    levels[-1].locks.extend(_shared_lock(persistent, coord))
    for dev in scratch.devices if scratch is not None else ():
        levels[0].locks.append(acquire_run_lock(dev))
    # Decided once per level, at open (the probe writes in the level's directory).
    check_direct_io(persistent, options.direct_io, PERSISTENT)
    devices = scratch.devices if scratch is not None else []
    for dev, tier in zip(devices, options.scratch_devices, strict=True):
        check_direct_io(dev, options.direct_io_of(tier), f"{SCRATCH} ({dev.url})")
    return opened


def _shared_lock(store: Store, coord: Coordinator) -> list[RunLock]:
    """Rank 0 takes the shared level's write lock for every participant; all of them learn
    whether it could, so a second writer fails on every rank alike."""
    lock: RunLock | None = None
    error, locked = "", False
    if coord.rank == 0:
        try:
            lock = acquire_run_lock(store)
        except CheckpointError as exc:
            if coord.world_size == 1:
                raise
            error, locked = str(exc), isinstance(exc, RunLockedError)
    if coord.world_size > 1:
        error, locked = coord.broadcast([error, locked])
        if error:
            if lock is not None:
                lock.release()
            kind = RunLockedError if locked else CheckpointError
            raise kind(f"rank {coord.rank}: the run's write lock: {error}")
    return [lock] if lock is not None else []


def open_partners(options: RunOptions, coord: Coordinator, levels: Levels) -> Partners:
    """Agree on the partners, open the copies this rank holds (their locks go with the
    scratch level's), and get back from the partner what this rank's scratch lost."""
    root = options.scratch_devices[0].path
    assert not isinstance(root, Store)  # refused by check_world
    partners = Partners.open(
        coord, os.fspath(root), open_store=open_store, timeout=options.storage_timeout_seconds
    )
    levels.first.locks.extend(partners.locks)
    partners.locks = []
    rebuild(coord, levels.first.store, partners)
    return partners


def open_parity(
    options: RunOptions, coord: Coordinator, levels: Levels
) -> Parity | RSParity | None:
    """With ``partner="xor"`` or ``"rs:K+M"``: agree on the sets, open this rank's parity
    store, and rebuild the lost ranks of each set from the others' files and parity."""
    rs = options.rs
    if options.partner != "xor" and rs is None:
        return None
    root = options.scratch_devices[0].path
    assert not isinstance(root, Store)  # refused by check_world
    if rs is not None:
        sets = RSParity.open(
            coord,
            os.fspath(root),
            k=rs[0],
            m=rs[1],
            open_store=open_store,
            timeout=options.storage_timeout_seconds,
        )
        rebuild_rs(coord, levels.first.store, sets)
        return sets
    parity = Parity.open(
        coord, os.fspath(root), open_store=open_store, timeout=options.storage_timeout_seconds
    )
    rebuild_parity(coord, levels.first.store, parity)
    return parity


def open_memory(
    options: RunOptions, coord: Coordinator, persistent: Store, undo: ExitStack
) -> MemoryLevel | None:
    """With ``memory=``: open this participant's memory level (collective), protected as the
    first level is, and get back what its node lost from the others' memory; ``undo``
    releases its locks (and keeps its files: they may be all that is left of a version)."""
    budget = options.memory_bytes
    if budget is None:
        return None
    memory = MemoryLevel.open(coord, persistent.url, budget, partner=options.partner, rs=options.rs)
    undo.callback(memory.release)
    return memory


def memory_keeper(
    memory: MemoryLevel | None, levels: Levels
) -> Callable[[int, engine.PartResult, Lineage | None], bool] | None:
    """What the writer calls after each commit on the first level: the copy into memory."""
    if memory is None:
        return None

    def keep(step: int, part: engine.PartResult, lineage: Lineage | None) -> bool:
        return memory.keep(levels.first.store, step, part, lineage)

    return keep


# -- the run id --------------------------------------------------------------------------------


def newest_record(*stores: Store) -> CommitRecord | None:
    """The commit record of the newest version on any of ``stores`` that reads (a damaged
    record is skipped, as restore skips it)."""
    steps = sorted({(s, i) for i, st in enumerate(stores) for s in engine.list_steps(st)})
    for step, i in reversed(steps):
        try:
            return engine.read_commit(stores[i], step)
        except (CheckpointFormatError, CheckpointNotFoundError) as exc:
            log.warning("step %d of %s: %s; looking at the previous one", step, stores[i].url, exc)
    return None


def check_run_id(stores: Sequence[Store], run_id: str) -> None:
    """Refuse to open a run whose newest version another training saved."""
    newest = newest_record(*stores)
    if newest is None or newest.run_id == run_id:
        return
    where = stores[-1].url
    if newest.run_id is None:
        theirs, resume = "no run id", "open it without run_id"
    else:
        theirs = f"run id {newest.run_id!r}"
        resume = f"pass run_id={newest.run_id!r} (cryosnap.run_id_of(path))"
    raise CheckpointError(
        f"{where}: its newest version (step {newest.step}) was saved by another training "
        f"({theirs}), not by run_id={run_id!r}: start a new training in a new path, or, to "
        f"resume that one, {resume}"
    )


# -- the background ----------------------------------------------------------------------------


def start_background(
    options: RunOptions,
    coord: Coordinator,
    levels: Levels,
    partners: Partners | None,
    capturer: Capturer,
    undo: ExitStack,
) -> list[PendingSave]:
    """Start the hand-offs, resuming the flushes a crash interrupted (their PendingSaves);
    ``undo`` stops them."""
    if len(levels.levels) > 1 and coord.world_size > 1:
        drop_partial_scratch(coord, levels.first.store, levels.levels[-1].store, partners)
    return resume_handoffs(options, coord, levels, undo, yield_to=capturer.wait_no_capture)


def resume_handoffs(
    options: RunOptions,
    coord: Coordinator,
    levels: Levels,
    undo: ExitStack,
    *,
    yield_to: Callable[[], None],
) -> list[PendingSave]:
    """Start the hand-offs and hand them the versions a crash left on a faster level (their
    PendingSaves): at open, and in ``cryosnap flush`` (_run/scavenge.py), which is this alone.
    ``undo`` stops them."""
    undo.callback(levels.close_handoffs)
    undo.callback(levels.abandon)
    levels.start_handoffs(
        retry_seconds=options.flush_retry_seconds,
        yield_to=yield_to,
        rewrite=lambda index: rewriter(options, coord, levels, index),
    )
    return levels.resume_unflushed(options.retention)


def subscribe_signals(signals: Sequence[int], policies: PolicyRoom, undo: ExitStack) -> list[int]:
    """Install the preemption handlers (``policies`` is told); ``undo`` removes them."""
    subscribed: list[int] = []

    def release() -> None:
        for signum in subscribed:
            _signals.unsubscribe(signum, policies)

    undo.callback(release)
    for signum in signals:
        _signals.subscribe(signum, policies)
        subscribed.append(signum)
    return subscribed


def rewriter(options: RunOptions, coord: Coordinator, levels: Levels, index: int) -> Rewriter:
    """The flush into level ``index`` when every rank writes it again (levels.py)."""
    chain = ChainIndex(
        incremental=options.incremental,
        full_every=options.full_every,
        chunk_bytes=options.chunk_bytes,
        rank=coord.rank,
    )
    levels.chains[index] = chain
    writer = VersionWriter(
        level=levels.levels[index],
        chain=chain,
        coordinator=coord,
        chunk_bytes=options.chunk_bytes,
        fence=levels.fence,
        run_id=options.run_id,
        channel=flush_channel(index),
    )
    return Rewriter(writer)


def drop_partial_scratch(
    coord: Coordinator, scratch: Store, persistent: Store, partners: Partners | None
) -> None:
    """At open (collective): a version committed on some ranks' scratch only (a rank was
    killed between the commit records) exists for no restore; unless the persistent level
    has it, its commit record goes from this rank's scratch (and from the partner copies this
    rank holds), so it is saved again normally."""
    own = engine.list_steps(scratch)
    common = set(agree(coord, own, _common))
    on_persistent = set(engine.list_steps(persistent))
    stores = [scratch, *(partners.held.values() if partners is not None else ())]
    for store in stores:
        for step, lineage in engine.list_versions(store).items():
            if step in common or step in on_persistent:
                continue
            log.warning(
                "step %d is on %s but not on every rank's scratch: a rank stopped while it was "
                "committed; removing it there",
                step,
                store.url,
            )
            store.delete(commit_key(step, lineage))


def _common(told: list[list[int]]) -> list[int]:
    """The leader's verdict: the steps on every rank's scratch."""
    return sorted(set.intersection(*(set(t) for t in told)))
