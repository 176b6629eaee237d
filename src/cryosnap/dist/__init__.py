"""The participants of a run and how they agree: the :class:`Coordinator` protocol.

A run may be written by several processes (ranks) at once. Every orchestration decision that
they must agree on goes through a Coordinator: whether to save now (the policy's answer and
preemption), which step to restore, when a version is committed (the commit record is written
by rank 0 once every part is durable), and what retention deletes (rank 0 decides, every rank
forgets the files before they go). A world of one (:class:`LocalCoordinator`) is the same code
path with collectives that return at once, so single-process and multi-rank runs share it.

Implementations:

- :class:`LocalCoordinator`: a world of one (the default).
- :class:`InProcessGroup`: several participants as threads of one process (tests, and programs
  that checkpoint several shards from threads); real collectives on a condition variable.
- :class:`TorchCoordinator`: the ranks of a torch.distributed job, over gloo groups of its own
  (``Checkpointer(comm=None)`` picks it when torch.distributed is initialized).
- :class:`MPICoordinator`: the ranks of an mpi4py communicator, over duplicates of it.

Collectives carry small JSON-like objects (ints, strings, lists, dicts), never tensors, except
:meth:`Coordinator.exchange`, which moves raw bytes point-to-point (each rank to the ranks it
names, under 2 GiB per message) for data the ranks hand each other. Each collective has a
timeout: a participant that does not arrive becomes a :class:`~cryosnap.CoordinationError` on
the others, never a hang. Each background thread of a Checkpointer uses its own *channel*
(:meth:`Coordinator.channel`), so collectives issued by the writer and by a flusher never
interleave.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from cryosnap.dist._common import DEFAULT_TIMEOUT_SECONDS
from cryosnap.dist._local import LocalCoordinator
from cryosnap.dist._mpi import MPICoordinator
from cryosnap.dist._threads import InProcessGroup
from cryosnap.dist._torch import TorchCoordinator

__all__ = [
    "Coordinator",
    "DEFAULT_TIMEOUT_SECONDS",
    "InProcessGroup",
    "LocalCoordinator",
    "MPICoordinator",
    "TorchCoordinator",
]


@runtime_checkable
class Coordinator(Protocol):
    """The participants of a run (ranks ``0 .. world_size - 1``) and their collectives."""

    @property
    def rank(self) -> int:
        """This participant's rank."""
        ...

    @property
    def world_size(self) -> int:
        """How many participants the run has."""
        ...

    def barrier(self, *, timeout: float | None = None) -> None:
        """Return once every participant called it."""
        ...

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        """Every participant's ``obj``, by rank."""
        ...

    def broadcast(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> Any:
        """``root``'s ``obj`` on every participant (the others' ``obj`` is ignored)."""
        ...

    def exchange(
        self, sends: Mapping[int, bytes | bytearray | memoryview], *, timeout: float | None = None
    ) -> dict[int, bytes]:
        """Send ``sends[dst]`` to each rank ``dst``; what every rank sent this one, by source.

        Collective: every participant calls it, in the same order as its other collectives
        (``{}`` when it sends nothing), and it is one collective in the channel's numbering.
        Only the sizes reach every rank; each payload goes straight from its sender to its
        receiver, so a rank holds only what is addressed to it. The result holds exactly the
        ranks that sent this one a payload, in rank order; an empty payload counts (``b""``).
        A payload to this rank itself is handed back (as bytes) without communication.

        Payloads are bytes-like (bytes, bytearray, memoryview; any buffer), at most
        ``2**31 - 1`` bytes each: send larger data in windows. A destination outside
        ``0 .. world_size - 1`` is a ``ValueError`` and a payload that is not bytes-like a
        ``TypeError``, raised on the rank that passed it before it communicates anything, so
        the other ranks then fail this collective with a ``CoordinationError`` at their
        timeout.
        """
        ...

    def channel(self, name: str) -> Coordinator:
        """The same participants on an independent sequence of collectives (one per thread)."""
        ...
