"""The participants of a run and how they agree: the :class:`Coordinator` protocol.

:class:`LocalCoordinator` (a world of one, the default), :class:`InProcessGroup` (threads),
:class:`TorchCoordinator` (torch.distributed), :class:`MPICoordinator` (mpi4py); :func:`agree`
(gather to the leader, its decision broadcast: O(1) bytes per participant).
Every collective has a timeout (:class:`~cryosnap.CoordinationError`, never a hang); each
background thread of a Checkpointer uses its own channel (:meth:`Coordinator.channel`).
docs/design/distributed.md has the why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from cryosnap.dist._agree import LEADER, agree
from cryosnap.dist._common import DEFAULT_TIMEOUT_SECONDS
from cryosnap.dist._local import LocalCoordinator
from cryosnap.dist._mpi import MPICoordinator
from cryosnap.dist._threads import InProcessGroup
from cryosnap.dist._torch import TorchCoordinator

__all__ = [
    "Coordinator",
    "DEFAULT_TIMEOUT_SECONDS",
    "InProcessGroup",
    "LEADER",
    "LocalCoordinator",
    "MPICoordinator",
    "TorchCoordinator",
    "agree",
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

    def gather(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> list[Any] | None:
        """Every participant's ``obj``, by rank, on ``root``; None on the others.

        Each participant but ``root`` sends one message and ``root`` receives one from each:
        O(1) bytes per participant, O(N) on ``root`` (where :meth:`all_gather` gives every
        participant O(N)). A ``root`` outside ``0 .. world_size - 1`` is a ``ValueError``.
        """
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
