"""Test support for cryosnap and for third-party storage backends.

:class:`FaultyStore` (here) injects failures, stalls and throttling, :class:`FaultySyscalls`
failures of direct writes; :class:`SimulatedWorld` is a process group of N ranks as threads that
counts each rank's messages, bytes and rounds, :class:`CountingCoordinator` counts the same on a
real group's rank (:func:`counters_of` reads either); :func:`cpu_fsdp2_accelerator` and
:func:`as_cpu_fsdp2` run Accelerate's FSDP2 path on a CPU job; :mod:`cryosnap.testing.store`
is the Store conformance suite (it imports pytest, hypothesis and numpy; this package does not).
Everything here runs on the calling thread but :meth:`SimulatedWorld.run`, which starts a
thread per rank. docs/design/storage.md has an example.
"""

from __future__ import annotations

import sys

from cryosnap.testing._accelerate import as_cpu_fsdp2, cpu_fsdp2_accelerator
from cryosnap.testing._counting import CountingCoordinator, counters_of
from cryosnap.testing._faulty import Fault, FaultyStore, FaultySyscalls
from cryosnap.testing._world import RankCounters, SimulatedRank, SimulatedWorld

__all__ = [
    "CountingCoordinator",
    "Fault",
    "FaultyStore",
    "FaultySyscalls",
    "RankCounters",
    "SimulatedRank",
    "SimulatedWorld",
    "as_cpu_fsdp2",
    "counters_of",
    "cpu_fsdp2_accelerator",
]

if "pytest" in sys.modules:
    # Only where pytest already runs: the package never imports it. Before the suite's import.
    sys.modules["pytest"].register_assert_rewrite("cryosnap.testing.store")
