"""InProcessGroup: several participants of one run as threads of one process.

Each participant is a thread holding its own coordinator (``group.coordinator(rank)``); values
are deep-copied on the way in; one that does not arrive in time makes the collective raise
:class:`~cryosnap.CoordinationError` on the others. docs/design/distributed.md has the why.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Mapping
from typing import Any

from cryosnap._validate import integer, positive_int, seconds
from cryosnap.dist._common import DEFAULT_TIMEOUT_SECONDS, outgoing, to_bytes
from cryosnap.errors import CoordinationError

__all__ = ["InProcessGroup"]


class _Slot:
    __slots__ = ("read", "values")

    def __init__(self) -> None:
        self.values: dict[int, Any] = {}
        self.read = 0


class InProcessGroup:
    """``world_size`` participants in one process; ``coordinator(rank)`` is rank's view."""

    def __init__(self, world_size: int, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.world_size = positive_int(world_size, "world_size")
        self.timeout = seconds(timeout, "timeout")
        self._cond = threading.Condition()
        self._slots: dict[tuple[str, int], _Slot] = {}
        # Collectives issued so far per (rank, channel): every view of a channel continues
        # the same numbering, however many times ``channel(name)`` was called.
        self._issued: dict[tuple[int, str], int] = {}
        self._aborted: str | None = None

    def coordinator(self, rank: int) -> _Participant:
        integer(rank, "rank", minimum=0, maximum=self.world_size - 1)
        return _Participant(self, rank, "main")

    def abort(self, reason: str) -> None:
        """Fail every collective in progress and to come (a participant crashed)."""
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()

    def _next(self, rank: int, name: str) -> tuple[str, int]:
        with self._cond:
            n = self._issued.get((rank, name), 0) + 1
            self._issued[(rank, name)] = n
            return (name, n)

    def _exchange(
        self, key: tuple[str, int], rank: int, obj: Any, timeout: float | None
    ) -> list[Any]:
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._cond:
            slot = self._slots.setdefault(key, _Slot())
            slot.values[rank] = copy.deepcopy(obj)
            self._cond.notify_all()
            while len(slot.values) < self.world_size and self._aborted is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world_size)) - set(slot.values))
                    raise CoordinationError(
                        f"collective {key[1]} on channel {key[0]!r}: rank(s) {missing} did not "
                        f"arrive within {limit:g} s (rank {rank} waited)"
                    )
                self._cond.wait(left)
            if self._aborted is not None:
                raise CoordinationError(f"the group was aborted: {self._aborted}")
            out = [copy.deepcopy(slot.values[r]) for r in range(self.world_size)]
            slot.read += 1
            if slot.read == self.world_size:
                del self._slots[key]
            return out


class _Participant:
    """One rank's coordinator on one channel of an :class:`InProcessGroup`."""

    def __init__(self, group: InProcessGroup, rank: int, name: str) -> None:
        self._group = group
        self._rank = rank
        self._name = name

    def __repr__(self) -> str:
        return f"<InProcessGroup rank {self._rank}/{self._group.world_size} {self._name!r}>"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._group.world_size

    def _next(self) -> tuple[str, int]:
        return self._group._next(self._rank, self._name)

    def barrier(self, *, timeout: float | None = None) -> None:
        self._group._exchange(self._next(), self._rank, None, timeout)

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        return self._group._exchange(self._next(), self._rank, obj, timeout)

    def gather(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> list[Any] | None:
        integer(root, "root", minimum=0, maximum=self.world_size - 1)
        everyone = self._group._exchange(self._next(), self._rank, obj, timeout)
        return everyone if self._rank == root else None

    def broadcast(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> Any:
        integer(root, "root", minimum=0, maximum=self.world_size - 1)
        mine = obj if self._rank == root else None
        return self._group._exchange(self._next(), self._rank, mine, timeout)[root]

    def exchange(
        self, sends: Mapping[int, bytes | bytearray | memoryview], *, timeout: float | None = None
    ) -> dict[int, bytes]:
        mine = {dst: to_bytes(view) for dst, view in outgoing(sends, self.world_size).items()}
        everyone = self._group._exchange(self._next(), self._rank, mine, timeout)
        return {src: got[self._rank] for src, got in enumerate(everyone) if self._rank in got}

    def channel(self, name: str) -> _Participant:
        return _Participant(self._group, self._rank, f"{self._name}/{name}")
