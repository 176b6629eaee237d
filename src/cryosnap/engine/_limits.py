"""The sizes, shares and thread counts the read and write paths are cut by, as two frozen values
(:class:`ReadLimits`, :class:`WriteLimits`), and a scoped way to change them for a block
(:func:`read_limits`, :func:`write_limits`, over a ``ContextVar`` each).

A read takes its value once, at its entry, on the thread that starts it (the restoring thread),
and passes it down; a part writer takes its value where it is made. Nothing below reads the
context: the read pool's threads get the value, not the context. Pure: no I/O, no threads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from cryosnap import _validate

if TYPE_CHECKING:
    from typing import Unpack

__all__ = [
    "IO_BATCH_BYTES",
    "ReadChanges",
    "ReadLimits",
    "WriteChanges",
    "WriteLimits",
    "read_limits",
    "write_limits",
]

# Bytes handed to one read_ranges call (one open: on an object store a request; through a
# TimeoutStore a hand-off to a storage thread): large enough for sequential bandwidth and for
# those costs to be noise. The batches a direct capture hands the writer are of this size too.
IO_BATCH_BYTES = 64 << 20

_READ_THREADS = max(2, min(8, os.cpu_count() or 2))


def _share(value: object, name: str) -> None:
    allowed = "a number from 0 to 1"
    if not 0 <= _validate.number(value, name, allowed=allowed) <= 1:
        _validate.bad_value(value, name, allowed)


@dataclass(frozen=True, kw_only=True)
class ReadLimits:
    """What one read is cut by; the defaults are those measured best here
    (docs/design/read-path.md). Checked when made: a ``TypeError`` or ``ValueError`` names
    the field, the value and what is allowed."""

    # Bytes of a task (one read_ranges call) of a file read through the page cache.
    io_batch_bytes: int = IO_BATCH_BYTES
    # Bytes of a piece, of a task that goes through a thread's bounce buffer (into='s own
    # leaves, a cold file) and of a batch of mapped pieces hashed at once: small enough to stay
    # in the CPU's cache (a few in flight within a shared L3) from the read to the copy.
    bounce_bytes: int = 8 << 20
    # Bytes between two pieces of a file that are read (into scratch) and thrown away to read
    # them in one go; also the widest gap inside a gather's window.
    gap_bytes: int = 64 << 10
    # Runs of chunks a blob may lie in (averaging less than gap_bytes each) before it is read
    # by windowed gathers instead of piece by piece.
    fragmented_runs: int = 256
    # Threads of the read pool; a read of cold files takes cold_threads.
    read_threads: int = _READ_THREADS
    # Bytes of a fresh piece of a leaf from which its pages are mapped in before its read
    # (smaller ones are left to fault in as the read lands).
    populate_min_bytes: int = 1 << 20
    # Bytes of an into= leaf from which it is read into directly (two passes) instead of
    # copied: a fresh small leaf comes from the allocator's heap (no fresh pages), and a
    # second read costs more per leaf than the copy it saves.
    direct_min_bytes: int = 256 << 10
    # Share of a data file's pages in the page cache under which it is read cold (direct I/O).
    cold_share: float = 0.5
    # Share of the memory available that into='s leaves in cold files may be staged in (a copy
    # at the end instead of a second read from the disk).
    staging_share: float = 0.5
    # Whether into='s leaves with bytes in a cold file take the mapped path (that file is
    # mapped after all: both passes read the page cache the first fills), measured faster
    # here than staging them (fresh memory to fault in, then a copy): docs/PERFORMANCE.md,
    # "Restores, quiet re-measurement". False: staged, as where a cold file cannot be mapped.
    map_cold_into: bool = True

    def __post_init__(self) -> None:
        for name in ("io_batch_bytes", "bounce_bytes", "read_threads"):
            _validate.positive_int(getattr(self, name), name)
        for name in ("gap_bytes", "fragmented_runs", "populate_min_bytes", "direct_min_bytes"):
            _validate.non_negative_int(getattr(self, name), name)
        _share(self.cold_share, "cold_share")
        _share(self.staging_share, "staging_share")
        _validate.boolean(self.map_cold_into, "map_cold_into")

    @property
    def cold_threads(self) -> int:
        """Threads of a read of cold files: most of them wait on the disk, so a few more than
        the cores keep reads in flight while the others hash and fault in fresh pages."""
        return max(4, self.read_threads)

    @classmethod
    def current(cls) -> ReadLimits:
        """The limits of a read started here now: the innermost :func:`read_limits` block's
        in this thread's context, else the defaults."""
        return _READ.get()


@dataclass(frozen=True, kw_only=True)
class WriteLimits:
    """The groups a part writer hashes and queues its batches in (bytes). Checked when made,
    as :class:`ReadLimits`."""

    # The first bytes of a version's first batch that are hashed and queued for writing before
    # the rest of that batch is hashed (the disk waits for no more than their hashing); the
    # rest is hashed and queued in groups of next_bytes, each written while the next is hashed
    # (a first batch can be the whole version: the packs of a state of many small tensors).
    first_bytes: int = 8 << 20
    next_bytes: int = 32 << 20
    # New bytes of a version are placed on scratch devices in groups of this size.
    place_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        for name in ("first_bytes", "next_bytes", "place_bytes"):
            _validate.positive_int(getattr(self, name), name)

    @classmethod
    def current(cls) -> WriteLimits:
        """The limits of a part writer made here now: the innermost :func:`write_limits`
        block's in this thread's context, else the defaults."""
        return _WRITE.get()


# Outside any block: the defaults (frozen values, shared by every context).
_READ_DEFAULTS = ReadLimits()
_WRITE_DEFAULTS = WriteLimits()
_READ: ContextVar[ReadLimits] = ContextVar("cryosnap_read_limits", default=_READ_DEFAULTS)
_WRITE: ContextVar[WriteLimits] = ContextVar("cryosnap_write_limits", default=_WRITE_DEFAULTS)


class ReadChanges(TypedDict, total=False):
    """The fields of :class:`ReadLimits` that :func:`read_limits` may change."""

    io_batch_bytes: int
    bounce_bytes: int
    gap_bytes: int
    fragmented_runs: int
    read_threads: int
    populate_min_bytes: int
    direct_min_bytes: int
    cold_share: float
    staging_share: float
    map_cold_into: bool


class WriteChanges(TypedDict, total=False):
    """The fields of :class:`WriteLimits` that :func:`write_limits` may change."""

    first_bytes: int
    next_bytes: int
    place_bytes: int


@contextlib.contextmanager
def read_limits(**changes: Unpack[ReadChanges]) -> Iterator[ReadLimits]:
    """The reads started on this thread (in this context) inside the block are cut by the
    limits in force with ``changes`` (nested blocks add theirs); yields those limits. A thread
    started in the block reads with what its own context holds: on CPython a new thread's
    context starts empty (the defaults) unless it is handed one (``copy_context().run``)."""
    token = _READ.set(dataclasses.replace(_READ.get(), **changes))
    try:
        yield _READ.get()
    finally:
        _READ.reset(token)


@contextlib.contextmanager
def write_limits(**changes: Unpack[WriteChanges]) -> Iterator[WriteLimits]:
    """The part writers made on this thread (in this context) inside the block are cut by the
    limits in force with ``changes``; yields those limits. A Checkpointer makes its part
    writers on its writer thread, whose context the block does not reach."""
    token = _WRITE.set(dataclasses.replace(_WRITE.get(), **changes))
    try:
        yield _WRITE.get()
    finally:
        _WRITE.reset(token)
