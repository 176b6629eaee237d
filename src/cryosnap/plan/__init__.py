"""Multi-level checkpoint planning: how often each level should take a version.

:func:`plan` returns the nested schedule that minimises the expected fraction of lost time,
given each level's costs and the run's failure classes; :func:`predict` those costs (the stall
and the time to durable per level) from the job's shape and the machine's rates.
docs/PLANNING.md has the formulas; docs/design/planning.md an example and the modules. numpy
only; pure computation on the caller's thread: no I/O, no threads, no clock.
"""

from __future__ import annotations

from cryosnap._units import parse_bytes, parse_rate, parse_seconds
from cryosnap.plan._cost import CostPrediction, JobShape, LevelTime, Machine, predict
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
    "CostPrediction",
    "Curve",
    "FailureClass",
    "Grid",
    "JobShape",
    "LevelCost",
    "LevelPlan",
    "LevelTime",
    "Machine",
    "Plan",
    "Schedule",
    "Simulation",
    "Weibull",
    "daly_interval",
    "first_order_waste",
    "parse_bytes",
    "parse_rate",
    "parse_seconds",
    "plan",
    "predict",
    "search_grid",
    "simulate",
    "waste_profile",
    "young_interval",
]
