"""The exception tree of cryosnap.

Every error cryosnap raises on purpose derives from :class:`CheckpointError`, so a caller can
catch one class. Where a builtin already means the same thing, the error derives from it too
(``CheckpointNotFoundError`` is also a ``FileNotFoundError``)::

    CheckpointError
    ├── CheckpointNotFoundError (+ FileNotFoundError)   no run, no such step, no version at all
    │   └── WorldSizeError                               a restore by another number of
    │       │                                            participants than saved the version
    │       │                                            (parts left unread, or none to read)
    │       └── PartNotFoundError                        the version has no part for this rank
    ├── CheckpointExistsError (+ FileExistsError)        the step is already committed
    ├── CheckpointFormatError                            a manifest or commit record is malformed,
    │                                                    of an unknown format_version, or escapes
    │                                                    the run directory
    ├── IntegrityError                                   content does not match its hash (and
    │   │                                                a restore without a step: every
    │   │                                                version of the run is damaged)
    │   └── TruncatedError                               a stored file ends before the bytes
    │                                                    asked of it
    ├── SourceDamagedError                               a version cannot be flushed: its copy
    │                                                    on the faster level is damaged
    ├── BenchError (+ ValueError)                        ``cryosnap bench``: an argument that is
    │                                                    not allowed
    ├── MissingDependencyError (+ ImportError)           ``cryosnap bench``: a package it needs
    │                                                    is not installed
    ├── ExportError                                      ``export`` meets a leaf the format
    │                                                    cannot hold, or cannot write OUT
    ├── DcpError                                         a torch.distributed.checkpoint save or
    │   │                                                load through cryosnap cannot go on
    │   └── DcpFormatError (+ CheckpointFormatError)     a version's DCP metadata is missing or
    │                                                    malformed
    ├── KeyNotFoundError (+ KeyError)                    ``keys=`` names a top-level key the
    │                                                    version does not hold, or ``history``
    │                                                    a leaf path (names the closest)
    ├── StatsNotRecordedError (+ LookupError)           ``Run.stats``: the version was saved
    │                                                    without statistics (before cryosnap
    │                                                    recorded them, or ``stats=False``)
    ├── StateMismatchError (+ ValueError)                ``into=`` does not match the saved tree;
    │                                                    ``apply_delta``'s state is not the
    │                                                    delta's base (nothing changed)
    ├── StepOrderError (+ ValueError)                    a save of a step below one the
    │                                                    Checkpointer saved since its last
    │                                                    restore (a rewind needs a restore)
    ├── FileLeafError (+ ValueError)                     a ``cryosnap.File`` leaf names no
    │                                                    readable regular file at ``save()``,
    │                                                    or restore cannot write its target
    ├── InexactResumeError (+ ValueError)                a framework callback asked for an exact
    │                                                    resume (``exact=True``) meets a data
    │                                                    loader or a run it cannot resume exactly
    ├── ConfigError (+ ValueError)                       ``Checkpointer.from_config``: an unknown
    │                                                    key or a value of the wrong type (names
    │                                                    the key and the file or variable); a
    │                                                    framework's checkpoint configuration
    │                                                    cryosnap refuses (torchtitan's)
    ├── UnsupportedError (+ NotImplementedError)         a framework setup a cryosnap integration
    │                                                    cannot checkpoint yet (the HF Trainer
    │                                                    with DeepSpeed or FSDP, torchtitan's
    │                                                    HF last save): names it and what to do
    │                                                    instead
    ├── CheckpointTimeoutError (+ TimeoutError)          ``result(timeout=)`` ran out of time
    ├── CoordinationError                                a collective among the run's participants
    │   │                                                failed or timed out (a rank died or
    │   │                                                disagrees)
    │   ├── ParticipantMismatchError                     at open, the participants disagree on
    │   │                                                the world size, their ranks, the run id
    │   │                                                or the format version (nothing written)
    │   └── CountersNotKeptError                         message counters asked of a coordinator
    │                                                    that keeps none (a real group not
    │                                                    wrapped in ``CountingCoordinator``)
    ├── ReplicaDivergenceError                           state saved as replicated differs
    │                                                    between ranks (names the leaf and
    │                                                    the ranks); nothing is committed
    ├── LockLostError                                    this writer no longer holds the run's
    │                                                    write lock (taken over while paused);
    │                                                    it stops instead of saving or deleting
    ├── LockFileError                                    the run's write lock is a symbolic
    │                                                    link, not a regular file, or
    │                                                    hard-linked: never written through
    ├── MemoryLevelError                                 ``memory=``: the memory root is missing,
    │                                                    or its per-user directory is not this
    │                                                    user's alone (mode 0700)
    ├── RunLockedError                                   another writer holds the run's write
    │                                                    lock (a Checkpointer is open on it), or
    │                                                    took it while this one was opening
    └── StorageError (+ OSError)                         the storage backend failed (full disk,
        │                                                permissions, unreachable endpoint)
        ├── StorageTimeoutError (+ TimeoutError)         one storage call did not return within
        │                                                the per-call timeout
        ├── DirectIOError                                ``direct_io=True`` on a level whose file
        │                                                system refuses O_DIRECT (or no local one)
        └── ConditionalWritesUnsupported                 the server refuses conditional requests

Programming errors are ``TypeError`` / ``ValueError`` themselves; messages name the step, the
tier and the leaf path. docs/design/api.md has the rules.
"""

from __future__ import annotations

__all__ = [
    "BenchError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "ConditionalWritesUnsupported",
    "ConfigError",
    "CoordinationError",
    "CountersNotKeptError",
    "DcpError",
    "DcpFormatError",
    "DirectIOError",
    "ExportError",
    "FileLeafError",
    "InexactResumeError",
    "IntegrityError",
    "KeyNotFoundError",
    "LockFileError",
    "LockLostError",
    "MemoryLevelError",
    "MissingDependencyError",
    "PartNotFoundError",
    "ParticipantMismatchError",
    "ReplicaDivergenceError",
    "RunLockedError",
    "SourceDamagedError",
    "StateMismatchError",
    "StatsNotRecordedError",
    "StepOrderError",
    "StorageError",
    "StorageTimeoutError",
    "TruncatedError",
    "UnsupportedError",
    "WorldSizeError",
]


class CheckpointError(Exception):
    """Base class of every error cryosnap raises on purpose. ``step`` and ``path`` (the run,
    tier or key it is about) are set where the raiser knows them."""

    step: int | None = None
    path: str | None = None

    def __init__(self, *args: object, step: int | None = None, path: str | None = None) -> None:
        super().__init__(*args)
        if step is not None:
            self.step = step
        if path is not None:
            self.path = path


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The run, the requested step or any committed version is missing."""

    def __str__(self) -> str:
        # FileNotFoundError's __str__ would render "[Errno None] ..." for a one-argument error.
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class WorldSizeError(CheckpointNotFoundError):
    """A restore by more or fewer participants than saved the version: some saved parts would
    be left unread, or a participant has no part to read. The message names the saved world
    size and the ways on (``replicated_only=True``, ``cryosnap.load(path, rank=k)``, a restart
    at the saved size); every participant raises it alike."""


class PartNotFoundError(WorldSizeError):
    """The version was saved by fewer ranks than the rank that asks for its part."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A version with this step is already committed in the run."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class CheckpointFormatError(CheckpointError):
    """A manifest or commit record is malformed, of an unknown version, or unsafe."""


class IntegrityError(CheckpointError):
    """Stored content does not match its recorded hash."""


class TruncatedError(IntegrityError):
    """A stored file ends before the byte range that was asked of it."""


class SourceDamagedError(CheckpointError):
    """The version cannot be flushed because its copy on the faster level (scratch) is
    incomplete or damaged: retrying would not help (the next level is not the problem)."""


class BenchError(CheckpointError, ValueError):
    """A benchmark argument that is not allowed (the message names it and what is allowed)."""


class MissingDependencyError(CheckpointError, ImportError):
    """A package the benchmark needs is not installed (the message says how to install it)."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class ExportError(CheckpointError):
    """``cryosnap.export`` meets a leaf the output format cannot hold, or OUT cannot be
    written."""


class DcpError(CheckpointError):
    """A torch.distributed.checkpoint save or load through cryosnap cannot go on: the planner
    keeps no metadata or keeps some that JSON cannot hold, DCP was called in a way cryosnap's
    global commit cannot follow, or a staged copy does not fit its budget."""


class DcpFormatError(DcpError, CheckpointFormatError):
    """A version's DCP metadata is missing or malformed, or the version was not written
    through :class:`cryosnap.dcp.StorageWriter`."""


class KeyNotFoundError(CheckpointError, KeyError):
    """``keys=`` names a top-level key that the version does not hold (the message names the
    step, the tier and the keys the version has), or :meth:`cryosnap.Run.history` a leaf
    path that the version does not hold, or that names two nodes (the message names the
    step and the closest paths)."""

    def __str__(self) -> str:
        # KeyError's __str__ would quote the whole message.
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class StatsNotRecordedError(CheckpointError, LookupError):
    """:meth:`cryosnap.Run.stats` of a version saved without per-leaf statistics: by a
    cryosnap from before they were recorded (manifest format_version below 6) or with
    ``Checkpointer(stats=False)``. The message names the step and the run."""


class StateMismatchError(CheckpointError, ValueError):
    """The ``into=`` tree does not match the saved tree (keys, shapes, dtypes, types); or the
    state given to :func:`cryosnap.apply_delta` is not the delta's base version (its leaves'
    roots differ from the base's: ``step`` names the base), and nothing was changed."""


class StepOrderError(CheckpointError, ValueError):
    """A save of a step below one the same Checkpointer saved since its last restore: the
    run's steps go up, and going back to an earlier step is a rewind, which starts with
    ``restore(step=...)`` (the next save then supersedes the later versions). The message
    names both steps."""


class FileLeafError(CheckpointError, ValueError):
    """A :class:`cryosnap.File` leaf cannot be saved (its path is missing, unreadable, a
    directory, a FIFO or another non-regular file) or restored (its target cannot be
    written); the message names the leaf path and the file."""


class InexactResumeError(CheckpointError, ValueError):
    """A training asked to resume exactly (``CryosnapCallback(exact=True)``) cannot: a train
    dataloader whose position cannot be restored mid-epoch (an ``IterableDataset``, a sampler
    without state, loaders of different lengths that ``CombinedLoader`` cycles) or a version
    saved by another number of processes. The message names the loader (or the run), why, and
    how to make it exact; raised when training starts, on every rank."""


class ConfigError(CheckpointError, ValueError):
    """A configuration (``Checkpointer.from_config``) names an unknown argument or gives one a
    value of the wrong type; the message names the key and the file or variable. Also a
    framework's checkpoint configuration that cryosnap's manager refuses (torchtitan's
    ``keep_latest_k=1``), naming the field and what to give instead."""


class UnsupportedError(CheckpointError, NotImplementedError):
    """A framework setup that a cryosnap integration cannot checkpoint yet (the Hugging Face
    ``Trainer`` with a DeepSpeed config, or with FSDP; torchtitan's ``last_save_in_hf`` and
    ``create_seed_checkpoint``; a Lightning strategy of cryosnap's beside a second
    checkpointing callback or a ``CheckpointIO`` plugin): raised before anything is saved; the
    message names the setup and what to do instead."""


class StorageError(CheckpointError, OSError):
    """The storage backend failed; the message names the tier and the key."""

    def __str__(self) -> str:
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """Waiting for a pending save ran out of time; the save itself goes on."""


class LockLostError(CheckpointError):
    """This writer's hold on the run's write lock was lost (another writer took it over, or the
    lock file was replaced); nothing more is committed or deleted by it."""


class LockFileError(CheckpointError):
    """The run's write lock is not a file cryosnap writes through (a symbolic link, not a
    regular file, or hard-linked elsewhere); ``path`` names it."""


class MemoryLevelError(CheckpointError):
    """The memory level (``Checkpointer(memory=...)``) cannot be used where it was asked for:
    its root (``$CRYOSNAP_MEMORY_ROOT``, default ``/dev/shm``) is missing, not a directory, or
    its per-user directory is not this user's alone."""


class RunLockedError(CheckpointError):
    """The run is already open for writing: another writer (a Checkpointer, ``cryosnap gc``
    or ``rm``) holds its write lock; the message names the run and the holder."""


class StorageTimeoutError(StorageError, TimeoutError):
    """A storage call did not return within the store's per-call timeout."""


class DirectIOError(StorageError):
    """``direct_io=True`` asks for direct writes where they cannot be made: a level whose file
    system refuses ``O_DIRECT`` (tmpfs, many FUSE and network file systems), or one that is not
    a local directory; the message names the level and why."""


class ConditionalWritesUnsupported(StorageError):
    """The server behind a store refuses conditional requests (some S3-compatible ones do)."""


class CoordinationError(CheckpointError):
    """A collective among the run's participants failed or did not complete within its
    timeout: a participant died, hangs, or does not take part in the same decision."""


class ParticipantMismatchError(CoordinationError):
    """The participants opening one run disagree on who they are: the world size, the ranks
    (two claim one rank), the run id or the manifest format version they write. Raised on every
    participant at open, before anything is written; the message names each side's ranks."""


class CountersNotKeptError(CoordinationError):
    """Message counters (``cryosnap.testing.counters_of``) asked of a coordinator that keeps
    none: a real group's coordinator not wrapped in ``cryosnap.testing.CountingCoordinator``."""


class ReplicaDivergenceError(CheckpointError):
    """State saved as replicated (``save(..., replicated=...)``) is not identical on every rank:
    the message names the first leaf that differs and which ranks hold which content. The
    version is not committed on any rank."""
