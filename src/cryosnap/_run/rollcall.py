"""The roll call at open: the participants agree on who they are before anything is written.

Each rank's ``[rank, world size, run id, formats]`` gathered to the leader, which checks the
list and broadcasts what it found (:func:`cryosnap.dist.agree`: O(1) bytes per rank but the
leader's), so a disagreement is a :class:`~cryosnap.errors.ParticipantMismatchError` on all of
them alike, before the stores are opened. Runs on the caller's thread (``open_run``), on the
coordinator's main channel; :func:`disagreement` is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cryosnap._format.commit import FORK_COMMIT_FORMAT_VERSION
from cryosnap._format.manifest import CODEC_FORMAT_VERSION
from cryosnap.dist import Coordinator, agree
from cryosnap.errors import ParticipantMismatchError

__all__ = ["disagreement", "roll_call", "written_formats"]


def written_formats() -> list[int]:
    """The newest manifest and commit record formats this code writes: ranks of two cryosnap
    releases would write one version in two formats (a reader of the older refuses it)."""
    return [CODEC_FORMAT_VERSION, FORK_COMMIT_FORMAT_VERSION]


def roll_call(coord: Coordinator, *, run_id: str | None) -> None:
    """Raise :class:`ParticipantMismatchError` on every rank when they disagree."""
    if coord.world_size == 1:
        return
    mine = [coord.rank, coord.world_size, run_id, written_formats()]
    problem = agree(coord, mine, disagreement)
    if problem:
        raise ParticipantMismatchError(
            f"rank {coord.rank}: the participants opening this run disagree: {problem}; "
            "nothing was written (start every rank with the same launcher settings, run_id "
            "and cryosnap release)"
        )


def disagreement(told: Sequence[Sequence[Any]]) -> str:
    """What the roll call ``told`` (each rank's entry, by position in the group) disagrees
    on, or ``""``: ranks that are not their positions, world sizes, run ids, formats."""
    wrong = [(pos, entry[0]) for pos, entry in enumerate(told) if entry[0] != pos]
    if wrong:
        named = ", ".join(f"the participant at position {p} says rank {r}" for p, r in wrong[:4])
        return f"ranks: {named}"
    for index, what in ((1, "world size"), (2, "run id"), (3, "format versions")):
        sides = _sides([entry[index] for entry in told])
        if len(sides) > 1:
            shown = " vs ".join(f"{value!r} (ranks {_ranks(r)})" for value, r in sides)
            return f"{what}: {shown} (the group has {len(told)})"
    return ""


def _sides(values: list[Any]) -> list[tuple[Any, list[int]]]:
    out: list[tuple[Any, list[int]]] = []
    for rank, value in enumerate(values):
        for seen, ranks in out:
            if seen == value:
                ranks.append(rank)
                break
        else:
            out.append((value, [rank]))
    return out


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
