"""Multi-level checkpoint planning: how often each level should take a version.

Given what each storage level costs the run (save and restart seconds, measured or given) and
the failure classes the run faces (mean time between failures, exponential or Weibull, and the
lowest level that survives each), :func:`plan` returns the nested schedule that minimises the
expected fraction of lost time: a version every ``base_interval_seconds`` to the first level,
and every ``every``-th version of each level to the next one. The schedule is the one the
Checkpointer follows (scratch takes every version, persistent every k-th).

>>> from cryosnap.plan import FailureClass, LevelCost, plan
>>> result = plan(
...     [LevelCost("scratch", 2.0, 5.0), LevelCost("persistent", 60.0, 120.0)],
...     [FailureClass("crash", 6 * 3600.0, "scratch"),
...      FailureClass("outage", 7 * 86400.0, "persistent")],
... )
>>> [(lv.name, lv.every) for lv in result.levels]
[('scratch', 1), ('persistent', 29)]

Modules: ``_model`` (the failure model, Young, Daly and the first-order multi-level optimum),
``_simulate`` (the discrete-event simulator and its seeded failure traces), ``_search`` (the
grid, the quadratic surrogate and the search), ``_plan`` (:func:`plan` and :class:`Plan`).
docs/PLANNING.md has the formulas and their sources. numpy only; pure computation on the
caller's thread: no I/O, no threads, no clock.
"""

from __future__ import annotations

from cryosnap.plan._model import (
    FailureClass,
    LevelCost,
    Schedule,
    Weibull,
    daly_interval,
    young_interval,
)
from cryosnap.plan._plan import (
    Curve,
    LevelPlan,
    Plan,
    Simulation,
    first_order_waste,
    plan,
    search_grid,
    simulate,
    waste_profile,
)
from cryosnap.plan._search import Grid

__all__ = [
    "Curve",
    "FailureClass",
    "Grid",
    "LevelCost",
    "LevelPlan",
    "Plan",
    "Schedule",
    "Simulation",
    "Weibull",
    "daly_interval",
    "first_order_waste",
    "plan",
    "search_grid",
    "simulate",
    "waste_profile",
    "young_interval",
]
