"""The policy room: the save policy as the Checkpointer's threads see it.

It serialises every call into the policy and agrees with the other participants.
Runs on the caller's thread (``should_save``, signal handlers on the main thread) and the
background threads (events); its collectives use the ``"policy"`` channel, caller's thread only.
docs/design/planning.md has the why.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from cryosnap.dist import Coordinator, agree
from cryosnap.policy import SavePolicy

__all__ = ["PolicyRoom"]

log = logging.getLogger("cryosnap")


class PolicyRoom:
    """The policy (or None), preemption, and the decisions the participants share."""

    def __init__(
        self,
        policy: SavePolicy | None,
        *,
        clock: Callable[[], float],
        coordinator: Coordinator,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._coord = coordinator
        # Created at open, in the same order on every rank (collective on torch and MPI).
        self._channel = coordinator.channel("policy")
        self._lock = threading.Lock()
        self.preempted = False

    def should_save(self, step: int) -> bool:
        due = self.preempted
        if self.policy is not None:
            with self._lock:
                due = self.policy.should_save(step, now=self._clock()) or due
        elif not self.preempted and self._coord.world_size == 1:
            raise ValueError(
                "should_save needs a save policy: Checkpointer(..., policy=cryosnap.policy."
                "EveryNSteps(n) / EveryNSeconds(s) / Adaptive(max_overhead))"
            )
        if self._coord.world_size == 1:
            return due
        return agree(self._channel, [due, self.preempted], _decide)

    def on_signal(self, signum: int) -> None:
        self.preempted = True
        log.warning("received %s: the run is preempted, save and exit", signal.Signals(signum).name)

    def _on_signal(self, signum: int, frame: Any) -> None:
        """The handler _signals.py calls (main thread): the run is preempted."""
        self.on_signal(signum)

    def top_level(self, step: int, last: int) -> int:
        """How far up the levels the version of ``step`` goes: the policy's say
        (``MultiLevel``), else every level (``last``)."""
        top = getattr(self.policy, "top_level", None)
        if top is None:
            return last
        with self._lock:
            return max(0, min(int(top(step)), last))

    def reached(self, step: int, level: str, seconds: float) -> None:
        """A version reached ``level``, ``seconds`` after the level below (any thread)."""
        reached = getattr(self.policy, "reached", None)
        if reached is not None:
            with self._lock:
                reached(step, level=level, now=self._clock(), seconds=seconds)

    def event(self, event: str, step: int, **figures: float) -> None:
        """``saved`` / ``durable`` / ``failed`` of a version (any thread)."""
        method: Any = getattr(self.policy, event, None)
        if method is not None:
            with self._lock:
                method(step, now=self._clock(), **figures)


def _decide(votes: list[list[bool]]) -> bool:
    """The leader's verdict: save when rank 0's policy says so, or any rank was preempted."""
    return bool(votes[0][0] or any(preempted for _due, preempted in votes))
