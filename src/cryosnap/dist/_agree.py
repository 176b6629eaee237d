"""agree: one decision of every participant, made by the leader from what each one says.

A gather to the leader (rank 0), the leader's ``decide`` over the list, a broadcast of the
result: O(1) bytes per participant but the leader (O(N) there), two collectives. Runs on the
calling thread, on the coordinator (channel) it is given. docs/design/distributed.md has the
costs in N.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from cryosnap.errors import CoordinationError

if TYPE_CHECKING:
    from cryosnap.dist import Coordinator

__all__ = ["LEADER", "agree", "any_of", "first_errors", "largest"]

T = TypeVar("T")

# The rank that decides: rank 0, the one that writes the commit record.
LEADER = 0

# Marks a decision the leader could not make: its error, told to the others instead.
_FAILED = "__cryosnap_leader_failed__"


def agree(
    coord: Coordinator,
    value: Any,
    decide: Callable[[list[Any]], T],
    *,
    timeout: float | None = None,
) -> T:
    """``decide(every participant's value, by rank)``, computed on the leader, on everyone.

    ``value`` and the decision are JSON-like (the coordinators carry JSON). When ``decide``
    raises on the leader, the leader re-raises it and every other participant raises a
    :class:`~cryosnap.CoordinationError` naming it (nobody waits for a decision that never
    comes).
    """
    if coord.world_size == 1:
        return decide([value])
    gathered = coord.gather(value, root=LEADER, timeout=timeout)
    if gathered is None:
        told = coord.broadcast(None, root=LEADER, timeout=timeout)
        if isinstance(told, dict) and _FAILED in told:
            raise CoordinationError(
                f"rank {coord.rank}: the leader (rank {LEADER}) could not decide: {told[_FAILED]}"
            )
        return told  # type: ignore[no-any-return]
    try:
        decision = decide(gathered)
    except BaseException as exc:
        coord.broadcast({_FAILED: f"{type(exc).__name__}: {exc}"}, root=LEADER, timeout=timeout)
        raise
    return coord.broadcast(decision, root=LEADER, timeout=timeout)  # type: ignore[no-any-return]


def any_of(values: Sequence[Any]) -> bool:
    """Whether any participant said yes (a vote)."""
    return any(values)


def largest(values: Sequence[Any]) -> Any:
    """The largest value any participant gave (rounds of a windowed transfer)."""
    return max(values)


def first_errors(values: Sequence[Any]) -> list[tuple[int, Any]]:
    """``(rank, error)`` of each participant that gave a non-empty error, in rank order (a
    pair arrives as a two-item list on the other participants: unpack it, do not compare)."""
    return [(r, e) for r, e in enumerate(values) if e]
