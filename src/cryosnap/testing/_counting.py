"""CountingCoordinator: a real group's coordinator (torch, MPI) with SimulatedWorld's counters.

Wraps any :class:`~cryosnap.dist.Coordinator` and counts, per rank, what a
:class:`SimulatedWorld` counts for the same calls: each object pickled as the world pickles it
(the bytes are comparable with the simulation's, whatever the inner coordinator puts on the
wire), the same logical model per collective. Runs on the caller's thread; the channels of one
rank share one tally under a lock (the writer's thread and the program's count into it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from cryosnap._validate import wrong_type
from cryosnap.dist import Coordinator
from cryosnap.errors import CountersNotKeptError
from cryosnap.testing._world import (
    LEADER,
    SIZE_BYTES,
    RankCounters,
    SimulatedRank,
    broadcast_children,
    pickled,
)

__all__ = ["CountingCoordinator", "counters_of"]


def _pickled(obj: Any) -> int:
    return len(pickled(obj))


class _Tally:
    """One rank's counters, shared by all its channels."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counters = RankCounters()
        self.uncounted: set[str] = set()

    def add(
        self,
        *,
        messages_sent: int = 0,
        messages_received: int = 0,
        bytes_sent: int = 0,
        bytes_received: int = 0,
    ) -> None:
        with self.lock:
            c = self.counters
            self.counters = RankCounters(
                c.messages_sent + messages_sent,
                c.messages_received + messages_received,
                c.bytes_sent + bytes_sent,
                c.bytes_received + bytes_received,
                c.rounds + 1,
            )


class CountingCoordinator:
    """``inner`` (this rank's coordinator of a real group), counting as :class:`SimulatedWorld`.

    Every collective of the :class:`~cryosnap.dist.Coordinator` protocol is forwarded and
    counted (messages, bytes sent and received, rounds); :meth:`channel` wraps the inner
    channel into the same tally, so :meth:`counters` is the rank's total over its channels, as
    the world's are. A collective the protocol does not name (one a newer protocol adds) is
    forwarded and counted as a round only, and its name listed in :attr:`uncounted`, so a
    comparison with the simulation can refuse figures that miss its bytes.
    """

    def __init__(self, inner: Coordinator, *, _tally: _Tally | None = None) -> None:
        if not isinstance(inner, Coordinator):
            wrong_type(inner, "inner", "a cryosnap.dist.Coordinator")
        self._inner = inner
        self._tally = _Tally() if _tally is None else _tally
        self._channels: dict[str, CountingCoordinator] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CountingCoordinator({self._inner!r})"

    @property
    def inner(self) -> Coordinator:
        """The wrapped coordinator."""
        return self._inner

    @property
    def rank(self) -> int:
        return self._inner.rank

    @property
    def world_size(self) -> int:
        return self._inner.world_size

    # -- counters ------------------------------------------------------------------------------

    def counters(self) -> RankCounters:
        """This rank's counters over every channel since construction or :meth:`reset`."""
        with self._tally.lock:
            return self._tally.counters

    def reset(self) -> None:
        """Zero the counters (between two measured saves, with no collective open)."""
        with self._tally.lock:
            self._tally.counters = RankCounters()

    @property
    def uncounted(self) -> frozenset[str]:
        """Collectives forwarded whose bytes were not counted (names the protocol lacks)."""
        with self._tally.lock:
            return frozenset(self._tally.uncounted)

    # -- the protocol --------------------------------------------------------------------------

    def barrier(self, *, timeout: float | None = None) -> None:
        # As the world counts it: a gather of nothing to rank 0, then its tree broadcast.
        self._inner.barrier(timeout=timeout)
        me, world = self.rank, self.world_size
        children = len(broadcast_children(me, LEADER, world))
        if me == LEADER:
            self._tally.add(messages_sent=children, messages_received=world - 1)
        else:
            self._tally.add(messages_sent=children + 1, messages_received=1)

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        sent = _pickled(obj)
        got = self._inner.all_gather(obj, timeout=timeout)
        received = sum(_pickled(o) for r, o in enumerate(got) if r != self.rank)
        others = self.world_size - 1
        self._tally.add(
            messages_sent=min(others, 1),
            messages_received=others,
            bytes_sent=sent if others else 0,
            bytes_received=received,
        )
        return got

    def gather(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> list[Any] | None:
        sent = _pickled(obj)
        got = self._inner.gather(obj, root=root, timeout=timeout)
        if self.rank != root:
            self._tally.add(messages_sent=1, bytes_sent=sent)
        elif got is not None:
            received = sum(_pickled(o) for r, o in enumerate(got) if r != root)
            self._tally.add(messages_received=self.world_size - 1, bytes_received=received)
        return got

    def broadcast(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> Any:
        # As the world counts it: a binary tree from ``root``; each rank receives once and
        # forwards to its children.
        got = self._inner.broadcast(obj, root=root, timeout=timeout)
        size = _pickled(got)
        children = len(broadcast_children(self.rank, root, self.world_size))
        if self.rank == root:
            self._tally.add(messages_sent=children, bytes_sent=size * children)
        else:
            self._tally.add(
                messages_sent=children,
                bytes_sent=size * children,
                messages_received=1,
                bytes_received=size,
            )
        return got

    def exchange(
        self, sends: Mapping[int, bytes | bytearray | memoryview], *, timeout: float | None = None
    ) -> dict[int, bytes]:
        got = self._inner.exchange(sends, timeout=timeout)
        me, sizes = self.rank, SIZE_BYTES * (self.world_size - 1)
        out = [memoryview(body).nbytes for dst, body in sends.items() if dst != me]
        back = [len(body) for src, body in got.items() if src != me]
        self._tally.add(
            messages_sent=len(out),
            messages_received=len(back),
            bytes_sent=sizes + sum(out),
            bytes_received=sizes + sum(back),
        )
        return got

    def channel(self, name: str) -> CountingCoordinator:
        with self._lock:
            known = self._channels.get(name)
            if known is None:
                known = CountingCoordinator(self._inner.channel(name), _tally=self._tally)
                self._channels[name] = known
            return known

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class lacks: a collective a newer protocol adds is
        # forwarded (the run must not break), counted as a round, and listed as uncounted.
        if name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr
        return self._forward(name, attr)

    def _forward(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs)
            with self._tally.lock:
                self._tally.uncounted.add(name)
            self._tally.add()
            return out

        return counted


def counters_of(coord: object) -> RankCounters:
    """The counters of ``coord``: a :class:`CountingCoordinator` or a rank of a
    :class:`SimulatedWorld`; any other coordinator keeps none, which is a
    :class:`~cryosnap.errors.CountersNotKeptError` saying how to get them."""
    if isinstance(coord, CountingCoordinator):
        return coord.counters()
    if isinstance(coord, SimulatedRank):
        return coord.world.counters(coord.rank)
    raise CountersNotKeptError(
        f"{coord!r} keeps no message counters: wrap the real group's coordinator, "
        "comm=cryosnap.testing.CountingCoordinator(coordinator), before the Checkpointer "
        "opens (or measure on a cryosnap.testing.SimulatedWorld)"
    )
