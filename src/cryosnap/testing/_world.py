"""SimulatedWorld: a process group of N ranks as threads of one process, with counters.

Each rank's coordinator implements :class:`~cryosnap.dist.Coordinator`; every collective is
pickled once on the way in (what is counted) and completes when the last rank arrives, which
wakes the others through one event (no thundering herd: thousands of ranks on two cores).
Runs on the ranks' threads; :meth:`SimulatedWorld.run` starts them. docs/design/distributed.md
has the cost model.
"""

from __future__ import annotations

import io
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from cryosnap._validate import integer, positive_int, seconds
from cryosnap.dist import DEFAULT_TIMEOUT_SECONDS
from cryosnap.dist._common import outgoing, to_bytes
from cryosnap.errors import CoordinationError

__all__ = ["RankCounters", "SimulatedWorld", "pickled"]

T = TypeVar("T")

# An exchange first tells every rank the size of each payload to it, as an all-to-all of int64
# (TorchCoordinator and MPICoordinator do): 8 bytes each way per other rank.
SIZE_BYTES = 8


def pickled(obj: Any) -> bytes:
    """``obj`` as the world counts it: pickled without the memo (``fast``), so its size is the
    value's and not how the sender's objects alias (a string held twice counts twice). A real
    group's wire format shares nothing either: CountingCoordinator pickles what arrives the same
    way and gets the sender's size."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.fast = True  # no memo; a collective's values are trees, never self-referencing
    pickler.dump(obj)
    return buf.getvalue()


# A broadcast's tree: each rank forwards the object to at most this many children, so what any
# rank sends is bounded whatever the world size (depth: log2 N rounds of messages).
BROADCAST_FAN_OUT = 2

# The leader: the rank whose CPU time the world measures (cryosnap's decisions are rank 0's).
LEADER = 0


@dataclass(frozen=True)
class RankCounters:
    """What one rank put on and took off the wire since the last :meth:`SimulatedWorld.reset`.

    The model is the logical one: an all-gather sends this rank's pickled object once (one
    message) and receives every other rank's (one message each); a gather sends each rank's
    object but the root's once, and the root receives them all; a broadcast runs down a
    binary tree rooted at the root (:data:`BROADCAST_FAN_OUT` children per rank): every other
    rank receives the object once and each rank sends it once to each of its children, so no
    rank sends more than two copies; a barrier is a gather of nothing to rank 0 and its
    broadcast (messages, no bytes); an exchange counts the
    8-byte sizes it sends to and receives from every other rank (the all-to-all of sizes the
    real coordinators run; bytes, not messages), then each payload to another rank as one
    message (a payload to itself costs nothing). ``rounds`` counts the
    collectives the rank took part in, on every channel.
    """

    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0


class _Tally:
    __slots__ = ("bytes_received", "bytes_sent", "messages_received", "messages_sent", "rounds")

    def __init__(self) -> None:
        self.messages_sent = self.messages_received = 0
        self.bytes_sent = self.bytes_received = self.rounds = 0

    def frozen(self) -> RankCounters:
        return RankCounters(
            self.messages_sent,
            self.messages_received,
            self.bytes_sent,
            self.bytes_received,
            self.rounds,
        )


class _Collective:
    """One collective on one channel: every rank's pickled contribution, then the result."""

    __slots__ = ("complete", "done", "kind", "pickled", "result", "root")

    def __init__(self, kind: str, root: int) -> None:
        self.kind = kind
        self.root = root
        self.pickled: dict[int, bytes] = {}
        self.done = threading.Event()  # set when complete, or on an abort
        self.complete = False
        self.result: list[Any] = []


class SimulatedWorld:
    """``ranks`` participants of one run in this process; ``coordinator(rank)`` is rank's view.

    Counts, per rank, messages and bytes sent and received and collectives (rounds), and the
    CPU time of the leader's (rank 0's) threads between its first and last collective since
    :meth:`reset` (:attr:`leader_seconds`). A rank that does not arrive within ``timeout``
    makes the collective raise :class:`~cryosnap.CoordinationError` on the others, as does
    :meth:`abort`. The ranks share the unpickled results of a collective (read-only, as the
    values a real group returns are private copies nobody else sees change).
    """

    def __init__(self, ranks: int, *, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.world_size = positive_int(ranks, "ranks")
        self.timeout = seconds(timeout, "timeout")
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], _Collective] = {}
        self._issued: dict[tuple[int, str], int] = {}
        self._tallies = [_Tally() for _ in range(self.world_size)]
        self._aborted: str | None = None
        # Per leader thread: its CPU clock at the first and the latest collective since reset.
        self._leader_clock: dict[int, tuple[float, float]] = {}

    def __repr__(self) -> str:
        return f"SimulatedWorld({self.world_size})"

    def coordinator(self, rank: int) -> SimulatedRank:
        """Rank ``rank``'s coordinator (its main channel)."""
        integer(rank, "rank", minimum=0, maximum=self.world_size - 1)
        return SimulatedRank(self, rank, "main")

    def run(
        self, body: Callable[[SimulatedRank], T], *, join_seconds: float | None = None
    ) -> list[T]:
        """Run ``body(coordinator)`` on one thread per rank; the results by rank.

        A rank that raises aborts the world (the others fail their next collective) and the
        first error raised (the cause) is raised here once every thread ended; ``join_seconds``
        bounds the wait for each thread (None: no bound).
        """
        results: list[Any] = [None] * self.world_size
        failed: list[BaseException] = []  # in the order the ranks failed: the first is the cause

        def main(rank: int) -> None:
            try:
                results[rank] = body(self.coordinator(rank))
            except BaseException as exc:  # re-raised below, on the caller's thread
                with self._lock:
                    failed.append(exc)
                self.abort(f"rank {rank} failed: {type(exc).__name__}: {exc}")

        threads = [
            threading.Thread(target=main, args=(r,), name=f"simulated-rank-{r}", daemon=True)
            for r in range(self.world_size)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(join_seconds)
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            self.abort("run() gave up waiting")
            raise CoordinationError(
                f"{len(stuck)} simulated rank(s) still running after {join_seconds:g} s "
                f"(first: {stuck[0]})"
            )
        if failed:
            raise failed[0]
        return results

    def abort(self, reason: str) -> None:
        """Fail every collective in progress and to come (a participant crashed)."""
        with self._lock:
            self._fail(reason)

    def _fail(self, reason: str) -> None:
        """Abort under the lock: wake every waiting rank (no rank polls: thousands wait)."""
        if self._aborted is None:
            self._aborted = reason
        for op in self._pending.values():
            op.done.set()

    # -- counters --------------------------------------------------------------------------

    def counters(self, rank: int) -> RankCounters:
        """Rank ``rank``'s counters since the last :meth:`reset`."""
        integer(rank, "rank", minimum=0, maximum=self.world_size - 1)
        with self._lock:
            return self._tallies[rank].frozen()

    def all_counters(self) -> list[RankCounters]:
        """Every rank's counters, by rank."""
        with self._lock:
            return [t.frozen() for t in self._tallies]

    @property
    def leader_seconds(self) -> float:
        """CPU seconds of rank 0's threads between their first and latest collective since
        :meth:`reset` (the leader's share of a save's coordinated part, its own writes
        included)."""
        with self._lock:
            return sum(last - first for first, last in self._leader_clock.values())

    def reset(self) -> None:
        """Zero every counter (between two measured saves: call it with no collective open)."""
        with self._lock:
            self._tallies = [_Tally() for _ in range(self.world_size)]
            self._leader_clock.clear()

    # -- the collective ------------------------------------------------------------------------

    def _collective(
        self, rank: int, name: str, kind: str, obj: Any, root: int, timeout: float | None
    ) -> list[Any]:
        limit = self.timeout if timeout is None else timeout
        if rank == LEADER:
            self._tick()
        payload = pickled(obj)
        with self._lock:
            if self._aborted is not None:
                raise CoordinationError(f"the simulated world was aborted: {self._aborted}")
            n = self._issued.get((rank, name), 0) + 1
            self._issued[(rank, name)] = n
            key = (name, n)
            op = self._pending.get(key)
            if op is None:
                op = self._pending[key] = _Collective(kind, root)
            elif op.kind != kind or op.root != root:
                problem = (
                    f"collective {n} on channel {name!r}: rank {rank} called {kind} (root "
                    f"{root}) where another rank called {op.kind} (root {op.root})"
                )
                self._fail(problem)
                raise CoordinationError(problem)
            op.pickled[rank] = payload
            last = len(op.pickled) == self.world_size
            if last:
                del self._pending[key]
        if last:
            op.result = [pickle.loads(op.pickled[r]) for r in range(self.world_size)]
            with self._lock:
                self._count(op)
            op.pickled.clear()
            op.complete = True
            op.done.set()
        elif not self._wait(op, limit):
            with self._lock:
                missing = sorted(set(range(self.world_size)) - set(op.pickled))
            raise CoordinationError(
                f"collective {n} ({kind}) on channel {name!r}: rank(s) {missing[:8]}"
                f"{'...' if len(missing) > 8 else ''} did not arrive within {limit:g} s "
                f"(rank {rank} waited)"
            )
        if rank == LEADER:
            self._tick()
        return op.result

    def _wait(self, op: _Collective, limit: float) -> bool:
        """Whether ``op`` completed within ``limit``; an abort raises."""
        op.done.wait(limit)
        if op.complete:
            return True
        if self._aborted is not None:
            raise CoordinationError(f"the simulated world was aborted: {self._aborted}")
        return False

    def _tick(self) -> None:
        now = time.thread_time()
        ident = threading.get_ident()
        with self._lock:
            first, _ = self._leader_clock.get(ident, (now, now))
            self._leader_clock[ident] = (first, now)

    def _count(self, op: _Collective) -> None:
        """Add one completed collective to every rank's tally (under the lock)."""
        world = self.world_size
        sizes = [len(op.pickled[r]) for r in range(world)]
        for tally in self._tallies:
            tally.rounds += 1
        if op.kind == "all_gather":
            total = sum(sizes)
            for r, tally in enumerate(self._tallies):
                tally.messages_sent += 1 if world > 1 else 0
                tally.messages_received += world - 1
                tally.bytes_sent += sizes[r] if world > 1 else 0
                tally.bytes_received += total - sizes[r]
        elif op.kind == "barrier":  # a gather of nothing to rank 0, then its tree broadcast
            for r, tally in enumerate(self._tallies):
                tally.messages_sent += len(broadcast_children(r, LEADER, world))
                if r != LEADER:
                    tally.messages_sent += 1
                    tally.messages_received += 1
            self._tallies[LEADER].messages_received += world - 1
        elif op.kind == "gather":
            for r, tally in enumerate(self._tallies):
                if r != op.root:
                    tally.messages_sent += 1
                    tally.bytes_sent += sizes[r]
            root = self._tallies[op.root]
            root.messages_received += world - 1
            root.bytes_received += sum(sizes) - sizes[op.root]
        elif op.kind == "broadcast":
            size = sizes[op.root]
            for r, tally in enumerate(self._tallies):
                children = len(broadcast_children(r, op.root, world))
                tally.messages_sent += children
                tally.bytes_sent += size * children
                if r != op.root:
                    tally.messages_received += 1
                    tally.bytes_received += size
        else:  # exchange: the sizes every rank learns (an all-to-all), then the payloads
            for tally in self._tallies:
                tally.bytes_sent += SIZE_BYTES * (world - 1)
                tally.bytes_received += SIZE_BYTES * (world - 1)
            for src, sends in enumerate(op.result):
                for dst, body in sends.items():
                    if dst == src:
                        continue
                    self._tallies[src].messages_sent += 1
                    self._tallies[src].bytes_sent += len(body)
                    self._tallies[dst].messages_received += 1
                    self._tallies[dst].bytes_received += len(body)


def broadcast_children(rank: int, root: int, world_size: int) -> list[int]:
    """The ranks ``rank`` forwards a broadcast from ``root`` to: a binary tree over the ranks
    renumbered from ``root`` (``root`` is 0; position ``p``'s children are ``2p+1, 2p+2``)."""
    position = (rank - root) % world_size
    first = BROADCAST_FAN_OUT * position + 1
    last = min(first + BROADCAST_FAN_OUT, world_size)
    return [(root + p) % world_size for p in range(first, last)]


class SimulatedRank:
    """One rank's coordinator on one channel of a :class:`SimulatedWorld`."""

    def __init__(self, world: SimulatedWorld, rank: int, name: str) -> None:
        self._world = world
        self._rank = rank
        self._name = name

    def __repr__(self) -> str:
        return f"<SimulatedWorld rank {self._rank}/{self._world.world_size} {self._name!r}>"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world.world_size

    @property
    def world(self) -> SimulatedWorld:
        """The world this rank belongs to (its counters)."""
        return self._world

    def barrier(self, *, timeout: float | None = None) -> None:
        self._world._collective(self._rank, self._name, "barrier", None, 0, timeout)

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        got = self._world._collective(self._rank, self._name, "all_gather", obj, 0, timeout)
        return list(got)

    def gather(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> list[Any] | None:
        integer(root, "root", minimum=0, maximum=self.world_size - 1)
        got = self._world._collective(self._rank, self._name, "gather", obj, root, timeout)
        return list(got) if self._rank == root else None

    def broadcast(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> Any:
        integer(root, "root", minimum=0, maximum=self.world_size - 1)
        mine = obj if self._rank == root else None
        return self._world._collective(self._rank, self._name, "broadcast", mine, root, timeout)[
            root
        ]

    def exchange(
        self, sends: Mapping[int, bytes | bytearray | memoryview], *, timeout: float | None = None
    ) -> dict[int, bytes]:
        mine = {dst: to_bytes(view) for dst, view in outgoing(sends, self.world_size).items()}
        everyone = self._world._collective(self._rank, self._name, "exchange", mine, 0, timeout)
        return {src: got[self._rank] for src, got in enumerate(everyone) if self._rank in got}

    def channel(self, name: str) -> SimulatedRank:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r} is invalid: allowed is a non-empty str")
        return SimulatedRank(self._world, self._rank, f"{self._name}/{name}")
