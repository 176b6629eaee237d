"""The cost model: a job's shape and a machine's rates -> stall and time to durable per level.

Owns :class:`JobShape`, :class:`Machine`, :class:`LevelTime`, :class:`CostPrediction`,
:func:`predict` and the collective counts of one save (``*_COLLECTIVES``, which a test holds to
a real save's on a simulated world). It models what a Checkpointer does, step by step (the
capture copy, hashing, node-local writes, the shared level's bandwidth, fsync, the commit's
collectives); docs/PLANNING.md has the formulas. Pure: no I/O, no threads, no clock; runs on
the caller's thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cryosnap import _validate
from cryosnap.plan._model import LevelCost

__all__ = [
    "PARTNER_COLLECTIVES",
    "PARITY_COLLECTIVES",
    "PERSISTENT_COLLECTIVES",
    "RETENTION_COLLECTIVES",
    "SCRATCH_COLLECTIVES",
    "WINDOW_BYTES",
    "CostPrediction",
    "JobShape",
    "LevelTime",
    "Machine",
    "predict",
]

# The collectives one save runs today, per step (docs/design/distributed.md, "One protocol";
# tests/unit/plan/test_cost.py counts them on a real save on a SimulatedWorld). A decision is
# two: a gather to the leader and its broadcast (``cryosnap.dist.agree``).
# - a commit to the shared (persistent) level: where each rank's share of the replicated state
#   lies (a decision), every part's summary and rank 0's outcome (a decision);
PERSISTENT_COLLECTIVES = 4
# - retention on the shared level (``keep=``): rank 0's plan (broadcast) and two barriers;
RETENTION_COLLECTIVES = 3
# - a commit to scratch: the replicated fingerprints, every part durable, every record landed
#   (a decision each);
SCRATCH_COLLECTIVES = 6
# - partner copies: offers, wants (exchange, exchange), rounds (a decision) and the records
#   (exchange), plus one exchange per window of ``WINDOW_BYTES``;
PARTNER_COLLECTIVES = 5
# - XOR or Reed-Solomon parity: the sets' layouts (exchange) and the rounds (a decision), plus
#   one exchange per window.
PARITY_COLLECTIVES = 3
WINDOW_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class JobShape:
    """What a job saves: ``ranks`` in all, ``ranks_per_node`` on each node (the last node may
    hold fewer), ``state_bytes`` of each rank's own (sharded) state and ``replicated_bytes``
    of state identical on every rank (data-parallel weights and optimizer), which a save
    splits: each rank writes 1/N of it to the shared level."""

    ranks: int
    ranks_per_node: int
    state_bytes: int
    replicated_bytes: int = 0

    def __post_init__(self) -> None:
        _validate.positive_int(self.ranks, "ranks")
        _validate.integer(
            self.ranks_per_node, "ranks_per_node", minimum=1, maximum=max(1, self.ranks)
        )
        _validate.non_negative_int(self.state_bytes, "state_bytes")
        _validate.non_negative_int(self.replicated_bytes, "replicated_bytes")
        if self.state_bytes + self.replicated_bytes == 0:
            _validate.bad_value(0, "state_bytes + replicated_bytes", "a positive byte count")

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.ranks_per_node)

    @property
    def part_bytes(self) -> int:
        """One rank's whole part: what it holds and what it writes to its scratch."""
        return self.state_bytes + self.replicated_bytes

    @property
    def share_bytes(self) -> float:
        """One rank's share of a version on the shared level: its state and 1/N of the
        replicated state."""
        return self.state_bytes + self.replicated_bytes / self.ranks


def _rate(value: object, name: str) -> float:
    rate = _validate.number(value, name, allowed="a positive finite number of bytes per second")
    if rate <= 0:
        _validate.bad_value(value, name, "a positive finite number of bytes per second")
    return rate


@dataclass(frozen=True, slots=True)
class Machine:
    """A machine's rates, in bytes per second but the latency.

    ``memcpy``: one rank's capture copy (host memory; device-to-host where the state is on a
    GPU). ``hash``: one thread's xxh3 rate. ``local``: one node's scratch write with fsync,
    shared by its ranks. ``pfs``: the shared level's aggregate write bandwidth. ``node``: one
    node's injection bandwidth (to the shared level, and to partner nodes). ``latency``: one
    stage of a collective (a collective of N ranks takes ceil(log2 N) stages). ``cores``: per
    node, for the capture copies and the hashing threads of its ranks (None: no fewer than its
    ranks need). ``local_read``: one node's scratch read, shared by its ranks (None: as
    ``local``); the flush reads scratch back from the disk (scratch is written with direct
    I/O, so not from the page cache).
    """

    memcpy_bytes_per_second: float
    hash_bytes_per_second: float
    local_bytes_per_second: float
    pfs_bytes_per_second: float
    node_bytes_per_second: float
    latency_seconds: float
    cores_per_node: int | None = None
    local_read_bytes_per_second: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "memcpy_bytes_per_second",
            "hash_bytes_per_second",
            "local_bytes_per_second",
            "pfs_bytes_per_second",
        ):
            object.__setattr__(self, name, _rate(getattr(self, name), name))
        node = self.node_bytes_per_second
        if not (isinstance(node, float) and math.isinf(node) and node > 0):
            object.__setattr__(self, "node_bytes_per_second", _rate(node, "node_bytes_per_second"))
        latency = _validate.seconds(self.latency_seconds, "latency_seconds", allow_zero=True)
        object.__setattr__(self, "latency_seconds", latency)
        _validate.positive_int_or_none(self.cores_per_node, "cores_per_node")
        read = self.local_read_bytes_per_second
        read = (
            self.local_bytes_per_second
            if read is None
            else _rate(read, "local_read_bytes_per_second")
        )
        object.__setattr__(self, "local_read_bytes_per_second", read)

    @property
    def read_bytes_per_second(self) -> float:
        """One node's scratch read (the write rate where none was given)."""
        read = self.local_read_bytes_per_second
        return self.local_bytes_per_second if read is None else read

    def cpu_share(self, streams: int) -> float:
        """The fraction of one core each of ``streams`` busy threads of a node gets."""
        cores = self.cores_per_node
        return 1.0 if cores is None else min(1.0, cores / streams)

    def collective_seconds(self, ranks: int) -> float:
        return self.latency_seconds * math.ceil(math.log2(ranks)) if ranks > 1 else 0.0


@dataclass(frozen=True, slots=True)
class LevelTime:
    """One level's predicted figures for one save. ``seconds``: from durable on the level
    below (from ``save()`` for the first level) to durable on this one; ``durable_seconds``:
    from ``save()``. ``terms``: the times the model took the maximum or the sum of (named as
    in docs/PLANNING.md). ``restart_seconds``: reading a rank's part back from the level."""

    name: str
    seconds: float
    durable_seconds: float
    written_bytes_per_rank: float
    collectives: int
    restart_seconds: float
    terms: tuple[tuple[str, float], ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seconds": self.seconds,
            "durable_seconds": self.durable_seconds,
            "written_bytes_per_rank": self.written_bytes_per_rank,
            "collectives": self.collectives,
            "restart_seconds": self.restart_seconds,
            "terms": dict(self.terms),
        }


@dataclass(frozen=True, slots=True)
class CostPrediction:
    """The prediction of one save: the stall (capture) and each level's time to durable,
    fastest level first."""

    shape: JobShape
    stall_seconds: float
    captured_bytes_per_rank: float
    levels: tuple[LevelTime, ...]

    def level(self, name: str) -> LevelTime:
        for level in self.levels:
            if level.name == name:
                return level
        known = ", ".join(lv.name for lv in self.levels)
        raise KeyError(f"no level {name!r} in this prediction (levels: {known})")

    def level_costs(self) -> list[LevelCost]:
        """The planner's inputs: each level's cost is the time its write takes, as if the run
        waited for it (the stall added to the first level's), and its restart cost the time
        to read a part back from it. An upper bound on what an asynchronous level costs the
        run, which keeps the planned interval of each level longer than its flush."""
        out = []
        for i, level in enumerate(self.levels):
            save = level.seconds + (self.stall_seconds if i == 0 else 0.0)
            out.append(LevelCost(level.name, max(save, 1e-9), level.restart_seconds))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": self.shape.ranks,
            "ranks_per_node": self.shape.ranks_per_node,
            "nodes": self.shape.nodes,
            "state_bytes": self.shape.state_bytes,
            "replicated_bytes": self.shape.replicated_bytes,
            "stall_seconds": self.stall_seconds,
            "captured_bytes_per_rank": self.captured_bytes_per_rank,
            "levels": [level.to_dict() for level in self.levels],
        }


def _parity(partner: bool | str, xor_set_size: int) -> tuple[str, float, float] | None:
    """``(name, bytes sent per byte of a part, parity bytes written per byte of a part)`` of
    the redundancy ``partner`` names, as the Checkpointer's ``partner=`` does; None without."""
    if partner is False:
        return None
    if partner is True:
        return ("partner", 1.0, 1.0)
    if partner == "xor":
        k = _validate.integer(xor_set_size, "xor_set_size", minimum=3)
        return ("xor", 1.0, 1.0 / (k - 1))
    if isinstance(partner, str) and partner.startswith("rs:"):
        k_text, sep, m_text = partner[3:].partition("+")
        if sep and k_text.isdigit() and m_text.isdigit() and int(k_text) >= 2 and int(m_text):
            k, m = int(k_text), int(m_text)
            return (f"rs:{k}+{m}", float(m), m / k)
    _validate.bad_value(partner, "partner", "False, True, 'xor' or 'rs:K+M' (K >= 2, M >= 1)")


def _capture(shape: JobShape, machine: Machine, scratch: bool) -> tuple[float, float]:
    """``(stall seconds, bytes copied)``: a rank copies its part; saving straight to the shared
    level it copies only its share of the replicated state and hashes the rest in place."""
    share = machine.cpu_share(shape.ranks_per_node)
    copied = shape.part_bytes if scratch else shape.share_bytes
    in_place = shape.part_bytes - copied
    stall = copied / (machine.memcpy_bytes_per_second * share) + in_place / (
        machine.hash_bytes_per_second * share
    )
    return stall, copied


def _shared_rate(shape: JobShape, machine: Machine) -> float:
    """One rank's write bandwidth to the shared level: the aggregate shared by every rank, or
    its node's injection bandwidth shared by the node's ranks, whichever is less."""
    return min(
        machine.pfs_bytes_per_second / shape.ranks,
        machine.node_bytes_per_second / shape.ranks_per_node,
    )


def _scratch(
    shape: JobShape, machine: Machine, partner: bool | str, xor_set_size: int
) -> LevelTime:
    """Every rank hashes its part on its writer thread while its appender writes it to the
    node's scratch (they overlap), then the redundancy, then the commit's collectives."""
    part = shape.part_bytes
    per_rank = shape.ranks_per_node
    hash_s = part / (machine.hash_bytes_per_second * machine.cpu_share(per_rank))
    write_s = per_rank * part / machine.local_bytes_per_second
    collectives = SCRATCH_COLLECTIVES
    terms = [("hash", hash_s), ("write", write_s)]
    seconds = max(hash_s, write_s)
    parity = _parity(partner, xor_set_size)
    if parity is not None:
        name, sent, kept = parity
        network_s = per_rank * part * sent / machine.node_bytes_per_second
        parity_s = per_rank * part * kept / machine.local_bytes_per_second
        windows = math.ceil(part * max(sent, 1.0) / WINDOW_BYTES)
        collectives += windows + (PARTNER_COLLECTIVES if name == "partner" else PARITY_COLLECTIVES)
        terms += [(f"{name} network", network_s), (f"{name} write", parity_s)]
        seconds += max(network_s, parity_s)
    coordination = collectives * machine.collective_seconds(shape.ranks)
    terms.append(("coordination", coordination))
    restart = max(per_rank * part / machine.read_bytes_per_second, hash_s)
    restart += machine.collective_seconds(shape.ranks)
    written = part * (1.0 + (parity[2] if parity else 0.0))
    return LevelTime(
        "scratch", seconds + coordination, 0.0, written, collectives, restart, tuple(terms)
    )


def _persistent(shape: JobShape, machine: Machine, *, scratch: bool, retention: bool) -> LevelTime:
    """Every rank writes its share of the version at its share of the shared bandwidth, then
    the commit's and retention's collectives. How the share gets there:

    - a save without scratch: the writer hashes what the capture copied while the appender
      writes it (overlapped);
    - a flush of one rank: its scratch files are copied window by window on one thread, each
      window read, its chunks verified, then written (read, hash and write add up);
    - a flush of several ranks (``Rewriter``): each rank reads its share back from scratch,
      every chunk verified, and only then writes it as a save does (read, then write).
    """
    share = shape.share_bytes
    rate = _shared_rate(shape, machine)
    per_rank = shape.ranks_per_node
    hash_s = share / (machine.hash_bytes_per_second * machine.cpu_share(per_rank))
    read_s = per_rank * share / machine.read_bytes_per_second if scratch else 0.0
    write_s = share / rate
    if not scratch:
        moved = max(hash_s, write_s)
    elif shape.ranks > 1:
        moved = max(read_s, hash_s) + write_s
    else:
        moved = read_s + hash_s + write_s
    collectives = PERSISTENT_COLLECTIVES + (RETENTION_COLLECTIVES if retention else 0)
    coordination = collectives * machine.collective_seconds(shape.ranks)
    terms = (("read", read_s), ("hash", hash_s), ("write", write_s), ("coordination", coordination))
    # A restart reads every rank's own state and the whole replicated state on every rank.
    restart = max(shape.part_bytes / rate, shape.part_bytes / machine.hash_bytes_per_second)
    restart += machine.collective_seconds(shape.ranks)
    return LevelTime("persistent", moved + coordination, 0.0, share, collectives, restart, terms)


def predict(
    shape: JobShape,
    machine: Machine,
    *,
    scratch: bool = True,
    partner: bool | str = False,
    xor_set_size: int = 8,
    retention: bool = True,
) -> CostPrediction:
    """Predict one full save of ``shape`` on ``machine``: the stall, then each level's time to
    durable. ``scratch``: node-local scratch first, then the flush to the shared level (else
    straight to the shared level); ``partner`` as the Checkpointer's (True, ``"xor"`` with
    sets of ``xor_set_size``, ``"rs:K+M"``; with scratch only); ``retention``: the shared
    level retires versions (``keep=``), which adds its collectives."""
    if not isinstance(shape, JobShape):
        _validate.wrong_type(shape, "shape", "a JobShape")
    if not isinstance(machine, Machine):
        _validate.wrong_type(machine, "machine", "a Machine")
    _validate.boolean(scratch, "scratch")
    _validate.boolean(retention, "retention")
    if partner is not False and not scratch:
        _validate.bad_value(partner, "partner", "False without scratch (copies are of scratch)")
    stall, copied = _capture(shape, machine, scratch)
    levels: list[LevelTime] = []
    if scratch:
        levels.append(_scratch(shape, machine, partner, xor_set_size))
    levels.append(_persistent(shape, machine, scratch=scratch, retention=retention))
    durable = stall
    timed = []
    for level in levels:
        durable += level.seconds
        timed.append(
            LevelTime(
                level.name,
                level.seconds,
                durable,
                level.written_bytes_per_rank,
                level.collectives,
                level.restart_seconds,
                level.terms,
            )
        )
    return CostPrediction(shape, stall, copied, tuple(timed))
