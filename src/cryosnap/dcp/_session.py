"""What the storage writers of one process share: the run's participants and its saves in flight.

Each save through a writer opens the run (a Checkpointer: the write lock, the chain read back
from the newest version) and closes it once committed; the coordinator (its gloo groups, made
once per process group, not per save) and a lock per run (a second save of the run in this
process waits for the first instead of being refused as another writer) outlive the saves.
Runs on the caller's thread (``coordinator``) and DCP's save threads (``in_flight``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from cryosnap._run.open import CHANNELS
from cryosnap.dcp._schema import DcpError
from cryosnap.dist import Coordinator, LocalCoordinator, TorchCoordinator
from cryosnap.dist._torch import initialized_world
from cryosnap.storage import Store

__all__ = ["DCP_CHANNEL", "coordinator", "in_flight", "run_key"]

_lock = threading.Lock()
# (the default process group, the coordinator made over it): one, that of the current group.
_coordinators: list[tuple[Any, Coordinator]] = []
_runs: dict[str, threading.Lock] = {}
# The writer's own channel; a Checkpointer's rooms take theirs (_run/open.py's CHANNELS).
DCP_CHANNEL = "dcp"


def coordinator(comm: Coordinator | None) -> Coordinator:
    """``comm``, or the participants a Checkpointer would take without one: the
    torch.distributed job's (one TorchCoordinator per default process group, shared by every
    writer of this process), else a world of one. Collective the first time in a job."""
    if comm is not None:
        return comm
    if not initialized_world():
        return LocalCoordinator()
    group = sys.modules["torch.distributed"].distributed_c10d._get_default_group()
    with _lock:
        for known, coord in _coordinators:
            if known is group:
                return coord
        # A destroyed and re-initialized job has a new default group: the old one's goes.
        coord = TorchCoordinator()
        # The channels' gloo groups are made here, on the caller's thread, rather than at the
        # first save, which dcp.async_save runs on a thread of its own while training goes on.
        for name in (DCP_CHANNEL, *CHANNELS):
            coord.channel(name)
        _coordinators[:] = [(group, coord)]
        return coord


def run_key(path: str | os.PathLike[str] | Store) -> str:
    """The name a run's saves in flight are serialized under in this process."""
    if isinstance(path, Store):
        return path.url
    text = os.fspath(path)
    return text if "://" in text else os.path.realpath(text)


@contextmanager
def in_flight(key: str, *, timeout_seconds: float) -> Iterator[None]:
    """Hold the run ``key`` for one save: a save of it in flight in this process (another
    writer's ``dcp.async_save``) finishes first."""
    with _lock:
        lock = _runs.setdefault(key, threading.Lock())
    if not lock.acquire(timeout=timeout_seconds):
        raise DcpError(
            f"{key}: another save of this run in this process did not finish within "
            f"{timeout_seconds:g} s: wait for each dcp.async_save to finish before the next one"
        )
    try:
        yield
    finally:
        lock.release()
