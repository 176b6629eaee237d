"""Multi-level checkpoint planning: how often each level should take a version.

:func:`plan` returns the nested schedule that minimises the expected fraction of lost time,
given each level's costs and the run's failure classes. docs/PLANNING.md has the formulas;
docs/design/planning.md an example and the modules. numpy only; pure computation on the
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
