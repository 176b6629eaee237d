"""When to save and which versions to keep: small pure policy objects.

Save policies (:class:`SavePolicy`) answer "save at this step?"; retention policies
(:class:`RetentionPolicy`) pick the versions to keep. Everything here is pure: no I/O, no
threads, no clock (time comes in as ``now``). The objects are not thread-safe: the caller
(the Checkpointer) serializes the calls. docs/design/planning.md has how they are driven.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Protocol, runtime_checkable

from cryosnap._validate import (
    bad_value,
    fraction,
    integer,
    non_negative_int,
    positive_int,
    positive_int_or_none,
    wrong_type,
)
from cryosnap._validate import seconds as _seconds  # EveryNSeconds has an argument named seconds

__all__ = [
    "Adaptive",
    "EveryNSeconds",
    "EveryNSteps",
    "KeepAny",
    "KeepBest",
    "KeepEvery",
    "KeepLast",
    "MultiLevel",
    "RetentionPolicy",
    "SavePolicy",
    "VersionInfo",
    "as_retention",
]


# --------------------------------------------------------------------------------------------
# save policies


@runtime_checkable
class SavePolicy(Protocol):
    """Decides, once per iteration, whether to save; hears what each save cost."""

    def should_save(self, step: int, *, now: float) -> bool:
        """Whether to save at ``step``; ``now`` is ``time.monotonic()`` at the call."""
        ...

    def saved(self, step: int, *, now: float, stall_seconds: float) -> None:
        """``save(step)`` returned at ``now``, having blocked the caller ``stall_seconds``."""
        ...

    def durable(self, step: int, *, now: float, seconds: float, stall_seconds: float) -> None:
        """Version ``step`` became durable at ``now``, ``seconds`` after save() was called."""
        ...


class EveryNSteps:
    """Save when ``(step - offset) % n == 0``.

    >>> policy = EveryNSteps(100)
    >>> [s for s in range(301) if policy.should_save(s, now=0.0)]
    [0, 100, 200, 300]
    """

    __slots__ = ("n", "offset")

    def __init__(self, n: int, *, offset: int = 0) -> None:
        self.n = positive_int(n, "n")
        self.offset = integer(offset, "offset")

    def should_save(self, step: int, *, now: float) -> bool:
        return (step - self.offset) % self.n == 0

    def saved(self, step: int, *, now: float, stall_seconds: float) -> None:
        pass

    def durable(self, step: int, *, now: float, seconds: float, stall_seconds: float) -> None:
        pass

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n}, offset={self.offset})"


class EveryNSeconds:
    """Save when at least ``seconds`` have passed since the last save started.

    The clock starts at the first ``should_save`` call, which does not save: the first save
    comes ``seconds`` into the run, not at its first step. The period is measured from the
    ``should_save`` call that granted the previous save (so the save's own stall does not
    stretch it). A save the policy did not ask for (a manual ``save()``) restarts the period
    too. After a long pause (evaluation, a debugger) the policy saves once, not once per
    missed period.
    """

    __slots__ = ("_granted_step", "_last_start", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = _seconds(seconds, "seconds")
        self._last_start: float | None = None
        self._granted_step: int | None = None

    def should_save(self, step: int, *, now: float) -> bool:
        if self._last_start is None:
            self._last_start = now
            return False
        if now - self._last_start >= self.seconds:
            self._last_start = now
            self._granted_step = step
            return True
        return False

    def saved(self, step: int, *, now: float, stall_seconds: float) -> None:
        if step != self._granted_step:
            self._last_start = now - stall_seconds
        self._granted_step = None

    def durable(self, step: int, *, now: float, seconds: float, stall_seconds: float) -> None:
        pass

    def __repr__(self) -> str:
        return f"EveryNSeconds({self.seconds})"


class MultiLevel:
    """Per-level frequency from a failure model: when to save, and how far up each version
    goes (scratch takes every version, persistent every k-th), re-planned as costs change.

    ``failures`` are :class:`cryosnap.plan.FailureClass` objects (mean time between failures,
    exponential or Weibull, and the lowest level that survives them). The cost of each level is
    measured as the run goes: the seconds a version takes to become durable on that level after
    the one below (reported through :meth:`reached`), a conservative stand-in for the time the
    run loses to it (asynchronous levels cost the run less). ``costs`` gives them instead, and
    ``restart_seconds`` the time to recover from each level (default: its save cost).
    :func:`cryosnap.plan.plan` (``method``) turns them into a schedule: a version every
    ``base_interval_seconds`` of the run to the first level, and to level ``j`` every
    ``every_versions``-th version. The plan is recomputed after every ``replan_every`` versions.

    Before every level has been measured (the first version, sent to every level), the policy
    saves once at its first ``should_save`` call and then waits for that version.
    """

    def __init__(
        self,
        failures: Sequence[object],
        *,
        levels: Sequence[str] = ("scratch", "persistent"),
        costs: Mapping[str, float] | None = None,
        restart_seconds: Mapping[str, float] | None = None,
        replan_every: int = 10,
        method: Literal["analytic", "search", "auto"] = "analytic",
    ) -> None:
        from cryosnap.plan import FailureClass

        if not isinstance(failures, (list, tuple)) or not failures:
            wrong_type(failures, "failures", "a non-empty list of cryosnap.plan.FailureClass")
        for f in failures:
            if not isinstance(f, FailureClass):
                wrong_type(f, "failures[...]", "a cryosnap.plan.FailureClass")
        self.failures = tuple(failures)
        self.levels = tuple(levels)
        if not self.levels or not all(isinstance(n, str) and n for n in self.levels):
            bad_value(levels, "levels", "level names, fastest first")
        self._given = self._per_level(costs, "costs")
        self._restart = self._per_level(restart_seconds, "restart_seconds")
        self.replan_every = positive_int(replan_every, "replan_every")
        if method not in ("analytic", "search", "auto"):
            bad_value(method, "method", "'analytic', 'search' or 'auto'")
        self.method = method
        self._samples: dict[str, list[float]] = {n: [] for n in self.levels}
        self._plan: object | None = None
        self._versions = 0  # versions saved so far (the next one is number _versions + 1)
        self._since_plan = 0
        self._last_save: float | None = None
        self._waiting_first = False

    def _per_level(self, values: Mapping[str, float] | None, name: str) -> dict[str, float]:
        if values is None:
            return {}
        if not isinstance(values, Mapping):
            wrong_type(values, name, "a mapping of level name -> seconds")
        out = {}
        for level, value in values.items():
            if level not in self.levels:
                bad_value(level, f"{name} key", f"one of the levels {self.levels}")
            out[level] = _seconds(value, f"{name}[{level!r}]", allow_zero=name != "costs")
        return out

    # -- what the plan says --------------------------------------------------------------------

    @property
    def plan(self) -> object | None:
        """The current :class:`cryosnap.plan.Plan` (None until every level has a cost)."""
        return self._plan

    def cost_seconds(self, level: str) -> float | None:
        """The save cost of ``level`` the plan uses: given, else the median measured."""
        if level in self._given:
            return self._given[level]
        samples = self._samples[level]
        return statistics.median(samples) if samples else None

    def _replan(self) -> None:
        from cryosnap.plan import LevelCost, plan

        costs = [self.cost_seconds(n) for n in self.levels]
        if any(c is None or c <= 0 for c in costs):
            return
        levels = [
            LevelCost(n, float(c or 0.0), self._restart.get(n, float(c or 0.0)))
            for n, c in zip(self.levels, costs, strict=True)
        ]
        self._plan = plan(levels, list(self.failures), method=self.method)
        self._since_plan = 0

    def top_level(self, step: int) -> int:
        """How far up the version saved at ``step`` goes (an index into ``levels``); counts
        it as saved. Called by the Checkpointer once per ``save``."""
        self._versions += 1
        if self._plan is None:
            return len(self.levels) - 1  # measure every level first
        return int(self._plan.last_level(self._versions))  # type: ignore[attr-defined]

    # -- the SavePolicy protocol ---------------------------------------------------------------

    def should_save(self, step: int, *, now: float) -> bool:
        if self._last_save is None:
            self._last_save = now
            self._waiting_first = True
            return True  # the first version measures every level
        if self._plan is None:
            return False
        interval = float(self._plan.base_interval_seconds)  # type: ignore[attr-defined]
        if now - self._last_save >= interval:
            self._last_save = now
            return True
        return False

    def saved(self, step: int, *, now: float, stall_seconds: float) -> None:
        pass

    def reached(self, step: int, *, level: str, now: float, seconds: float) -> None:
        """Version ``step`` became durable on ``level``, ``seconds`` after the level below
        (after ``save()`` for the first level)."""
        if level in self._samples and seconds > 0:
            samples = self._samples[level]
            samples.append(seconds)
            del samples[:-16]  # the recent costs: storage speed drifts
        if self._plan is None:
            self._replan()  # the first version has now reached one more level

    def durable(self, step: int, *, now: float, seconds: float, stall_seconds: float) -> None:
        self._since_plan += 1
        if self._plan is None or self._since_plan >= self.replan_every:
            self._replan()

    def __repr__(self) -> str:
        return f"MultiLevel(levels={self.levels}, failures={len(self.failures)} classes)"


# EWMA weights. One iteration is one sample and they come often, so a gentle weight. Costs and
# durations of checkpoints come once per checkpoint: a rise is believed at once (the overhead
# bound must hold when storage slows down), a fall only gradually (one cheap checkpoint does
# not mean storage is fast again).
_ITER_ALPHA = 0.1
_FALL_ALPHA = 0.3
# Clean iterations whose median seeds the iteration time: the first iterations (compilation,
# autotuning, cold caches) are outliers that a plain average would carry for a long time.
_SEED_SAMPLES = 8
# A save due while another is still in flight waits; but never more than this many intervals
# since the last save, so a durable() notification that never comes cannot stop saving.
_MAX_DEFER_INTERVALS = 10


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)


def _rise_fast(old: float | None, sample: float) -> float:
    if old is None or sample >= old:
        return sample
    return old + _FALL_ALPHA * (sample - old)


class Adaptive:
    """CheckFreq-style save frequency: as often as an overhead bound allows.

    The model. Let ``t`` be the time of one training step without a checkpoint in flight,
    ``c`` the overhead of one checkpoint (the caller's stall plus the extra time of the
    iterations that run while it is in flight, i.e. interference), and ``d`` the time from
    ``save()`` to durable. Saving every ``k`` steps costs about ``c / (k * t)`` of the run, so

        k = clamp(max(ceil(c / (max_overhead * t)), ceil(d / t)), min_steps, max_steps)

    The second term keeps a save from starting before the previous one is durable (saves
    never queue); ``max_steps`` wins over both (a durability requirement beats the bound).

    Profiling is online and needs no extra calls:

    * ``t``: the spacing of consecutive ``should_save`` calls per step, over intervals during
      which no checkpoint was in flight. Seeded with the median of the first clean intervals
      (the first iterations are often slow), then an EWMA.
    * ``c``: for each *episode* (from a save while none was in flight until the first
      ``should_save`` after the last one in flight became durable), the larger of the reported
      stalls and the measured extra time ``sum(spacing) - steps * t``, per checkpoint. Taking
      the larger makes a noisy iteration time unable to hide a known stall.
    * ``d``: the ``seconds`` of each ``durable()``.

    ``c`` and ``d`` follow their measurements as moving averages: an increase takes effect
    at once, a decrease with weight 0.3 per checkpoint. So the interval re-tunes when storage
    slows down or speeds up, and errs towards the bound's side.

    Warm-up: the first save comes ``warmup_steps`` steps after the first ``should_save`` call,
    before anything about its cost is known; the next one once that first checkpoint has been
    measured (it is durable and a clean iteration followed). Until then ``interval`` reports
    ``max(warmup_steps, min_steps)`` and ``overhead`` is None. The first checkpoint's cost
    is therefore spread over the warm-up only, which can exceed the bound once.

    A save that becomes due while another is in flight waits for it (up to
    ``10 * interval`` steps since the last save, so a lost notification cannot stop saving,
    and never beyond ``max_steps``). Call :meth:`failed` when a save fails, so the policy
    stops waiting for it. Steps are expected to increase; a step lower than the last save's
    (a restore) restarts the count from there.
    """

    __slots__ = (
        "_cost",
        "_durable_s",
        "_early",
        "_ep_extra_s",
        "_ep_saves",
        "_ep_stall",
        "_ep_steps",
        "_episode",
        "_first_step",
        "_in_flight",
        "_interval_busy",
        "_iter_s",
        "_last_now",
        "_last_save_step",
        "_last_step",
        "_seed",
        "max_overhead",
        "max_steps",
        "min_steps",
        "warmup_steps",
    )

    def __init__(
        self,
        max_overhead: float = 0.05,
        *,
        min_steps: int = 1,
        max_steps: int | None = None,
        warmup_steps: int = 20,
    ) -> None:
        self.max_overhead = fraction(
            max_overhead, "max_overhead", allowed="a fraction in (0, 1) (0.05 = 5%)"
        )
        self.min_steps = positive_int(min_steps, "min_steps")
        self.max_steps = positive_int_or_none(max_steps, "max_steps")
        if self.max_steps is not None and self.max_steps < self.min_steps:
            raise ValueError(f"max_steps={max_steps} is smaller than min_steps={self.min_steps}")
        self.warmup_steps = non_negative_int(warmup_steps, "warmup_steps")

        self._iter_s: float | None = None  # seconds per step, clean iterations (EWMA)
        self._seed: list[float] = []  # first clean samples, before the EWMA starts
        self._cost: float | None = None  # overhead seconds per checkpoint
        self._durable_s: float | None = None  # save() to durable, seconds
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._last_now: float | None = None
        self._last_save_step: int | None = None
        # step -> eager stall seconds, for checkpoints saved but not yet durable.
        self._in_flight: dict[int, float] = {}
        # durable() that arrived before its saved(): step -> (seconds, stall_seconds).
        self._early: dict[int, tuple[float, float]] = {}
        self._interval_busy = False
        self._episode = False
        self._ep_extra_s = 0.0
        self._ep_steps = 0
        self._ep_stall: dict[int, float] = {}
        self._ep_saves = 0

    # -- read-only estimates -----------------------------------------------------------------

    @property
    def interval(self) -> int:
        """The current save interval in steps (before the first measurement: the warm-up)."""
        k = self._planned_interval()
        return max(self.warmup_steps, self.min_steps) if k is None else k

    @property
    def overhead(self) -> float | None:
        """Predicted fraction of run time spent on checkpoints at :attr:`interval`."""
        k = self._planned_interval()
        if k is None or self._cost is None or self._iter_s is None:
            return None
        return self._cost / (k * self._iter_s)

    @property
    def iteration_seconds(self) -> float | None:
        """Estimated seconds per step without a checkpoint in flight."""
        return self._t_step()

    @property
    def cost_seconds(self) -> float | None:
        """Estimated overhead of one checkpoint: stall plus interference, in seconds."""
        return self._cost

    @property
    def durable_seconds(self) -> float | None:
        """Estimated time from ``save()`` to durable, in seconds."""
        return self._durable_s

    # -- the SavePolicy protocol -------------------------------------------------------------

    def should_save(self, step: int, *, now: float) -> bool:
        self._account_interval(step, now)
        if self._first_step is None:
            self._first_step = step
        if self._last_save_step is not None and step < self._last_save_step:
            self._last_save_step = step  # rolled back (restored): count from here
        if self._last_save_step is None:
            return step - self._first_step >= self.warmup_steps
        since = step - self._last_save_step
        if self.max_steps is not None and since >= self.max_steps:
            return True
        k = self._planned_interval()
        if k is None:
            # The first checkpoint is not measured yet: wait for it, within reason.
            return since >= _MAX_DEFER_INTERVALS * self.interval
        if since < k:
            return False
        return not self._in_flight or since >= _MAX_DEFER_INTERVALS * k

    def saved(self, step: int, *, now: float, stall_seconds: float) -> None:
        if self._iter_s is None and self._seed:
            self._iter_s = statistics.median(self._seed)
        self._last_save_step = step
        self._interval_busy = True
        if not self._episode:
            self._episode = True
            self._ep_extra_s = 0.0
            self._ep_steps = 0
            self._ep_stall = {}
            self._ep_saves = 0
        self._ep_saves += 1
        self._ep_stall[step] = max(stall_seconds, 0.0)
        early = self._early.pop(step, None)
        if early is None:
            self._in_flight[step] = stall_seconds
        else:
            self._record_durable(step, *early)

    def durable(self, step: int, *, now: float, seconds: float, stall_seconds: float) -> None:
        if step in self._in_flight:
            del self._in_flight[step]
            self._record_durable(step, seconds, stall_seconds)
        else:
            self._early[step] = (seconds, stall_seconds)

    def failed(self, step: int, *, now: float) -> None:
        """The save of ``step`` failed: stop waiting for it (its cost is still counted)."""
        self._in_flight.pop(step, None)
        self._early.pop(step, None)

    # -- internals ---------------------------------------------------------------------------

    def _record_durable(self, step: int, seconds: float, stall_seconds: float) -> None:
        self._durable_s = _rise_fast(self._durable_s, max(seconds, 0.0))
        if step in self._ep_stall:
            # The durable figure includes lazy waits that the eager one could not see.
            self._ep_stall[step] = max(self._ep_stall[step], stall_seconds)

    def _t_step(self) -> float | None:
        if self._iter_s is not None:
            return self._iter_s
        return statistics.median(self._seed) if self._seed else None

    def _observe_clean(self, seconds_per_step: float) -> None:
        if self._iter_s is None:
            self._seed.append(seconds_per_step)
            if len(self._seed) >= _SEED_SAMPLES:
                self._iter_s = statistics.median(self._seed)
        else:
            self._iter_s = _ewma(self._iter_s, seconds_per_step, _ITER_ALPHA)

    def _account_interval(self, step: int, now: float) -> None:
        """Classify the interval since the previous call: clean (profiles ``t``) or busy."""
        prev_step, prev_now = self._last_step, self._last_now
        self._last_step, self._last_now = step, now
        steps = 0 if prev_step is None else step - prev_step
        if prev_now is not None and steps > 0:
            spacing = max(now - prev_now, 0.0)
            if self._interval_busy:
                self._ep_extra_s += spacing
                self._ep_steps += steps
            else:
                self._observe_clean(spacing / steps)
        if self._episode and not self._in_flight:
            self._close_episode()
        self._interval_busy = bool(self._in_flight)

    def _close_episode(self) -> None:
        self._episode = False
        stall = sum(self._ep_stall.values())
        t = self._t_step()
        extra = stall if t is None else max(stall, self._ep_extra_s - self._ep_steps * t)
        self._cost = _rise_fast(self._cost, extra / max(self._ep_saves, 1))

    def _planned_interval(self) -> int | None:
        t, c = self._t_step(), self._cost
        if t is None or c is None or t <= 0:
            return None if t is None or c is None else self.min_steps
        # The tiny slack keeps float noise (0.05 / (0.05 * 0.1) = 10.000000000000002) from
        # adding a step.
        k = math.ceil(c / (self.max_overhead * t) - 1e-9)
        if self._durable_s is not None:
            k = max(k, math.ceil(self._durable_s / t - 1e-9))
        k = max(k, self.min_steps)
        if self.max_steps is not None:
            k = min(k, self.max_steps)
        return k

    def __repr__(self) -> str:
        return (
            f"Adaptive(max_overhead={self.max_overhead}, min_steps={self.min_steps}, "
            f"max_steps={self.max_steps}, warmup_steps={self.warmup_steps})"
        )


# --------------------------------------------------------------------------------------------
# retention policies


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """What a retention policy sees of one committed version: its step and metrics."""

    step: int
    metrics: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        integer(self.step, "step")
        # A read-only copy: the caller's dict may change later, the version's metrics may not.
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))


@runtime_checkable
class RetentionPolicy(Protocol):
    """Picks the versions to keep. The Checkpointer always keeps the newest one as well."""

    def select(self, versions: Sequence[VersionInfo]) -> set[int]:
        """The steps to keep among ``versions`` (a subset of their steps)."""
        ...


class KeepLast:
    """Keep the ``n`` newest versions (highest steps)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = positive_int(n, "n")

    def select(self, versions: Sequence[VersionInfo]) -> set[int]:
        return set(sorted({v.step for v in versions})[-self.n :])

    def __repr__(self) -> str:
        return f"KeepLast({self.n})"


class KeepEvery:
    """Keep the versions whose step is a multiple of ``n_steps`` (milestones)."""

    __slots__ = ("n_steps",)

    def __init__(self, n_steps: int) -> None:
        self.n_steps = positive_int(n_steps, "n_steps")

    def select(self, versions: Sequence[VersionInfo]) -> set[int]:
        return {v.step for v in versions if v.step % self.n_steps == 0}

    def __repr__(self) -> str:
        return f"KeepEvery({self.n_steps})"


class KeepBest:
    """Keep the ``k`` versions with the best ``metric`` (lowest for ``mode="min"``).

    Versions without the metric, or with a NaN value, are not candidates (they are kept only
    if another policy in a :class:`KeepAny` keeps them). Ties go to the newer version.
    """

    __slots__ = ("k", "metric", "mode")

    def __init__(self, k: int, metric: str = "loss", mode: Literal["min", "max"] = "min") -> None:
        self.k = positive_int(k, "k")
        if not isinstance(metric, str):
            wrong_type(metric, "metric", "a non-empty str")
        if not metric:
            bad_value(metric, "metric", "a non-empty str")
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.metric = metric
        self.mode: Literal["min", "max"] = mode

    def select(self, versions: Sequence[VersionInfo]) -> set[int]:
        sign = 1.0 if self.mode == "min" else -1.0
        candidates = [
            (sign * float(value), -v.step)
            for v in versions
            if (value := v.metrics.get(self.metric)) is not None and not math.isnan(value)
        ]
        candidates.sort()
        return {-neg_step for _, neg_step in candidates[: self.k]}

    def __repr__(self) -> str:
        return f"KeepBest({self.k}, metric={self.metric!r}, mode={self.mode!r})"


class KeepAny:
    """Keep a version if any of ``policies`` keeps it (the union of their selections)."""

    __slots__ = ("policies",)

    def __init__(self, *policies: RetentionPolicy) -> None:
        if not policies:
            raise ValueError("KeepAny needs at least one retention policy")
        for i, policy in enumerate(policies):
            if not isinstance(policy, RetentionPolicy):
                raise TypeError(
                    f"KeepAny argument {i} must be a retention policy (with select()), "
                    f"got {policy!r}"
                )
        self.policies: tuple[RetentionPolicy, ...] = policies

    def select(self, versions: Sequence[VersionInfo]) -> set[int]:
        return set[int]().union(*(policy.select(versions) for policy in self.policies))

    def __repr__(self) -> str:
        return f"KeepAny({', '.join(map(repr, self.policies))})"


def as_retention(keep: int | RetentionPolicy | None) -> RetentionPolicy | None:
    """Normalize ``Checkpointer(keep=...)``: None (keep all), an int n (KeepLast(n)), a policy."""
    if keep is None or isinstance(keep, RetentionPolicy):
        return keep
    allowed = "None, a positive int or a retention policy (with select())"
    return KeepLast(positive_int(keep, "keep", allowed=allowed))
