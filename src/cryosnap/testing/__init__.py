"""Test support for cryosnap and for third-party storage backends.

:class:`FaultyStore` (here) injects failures, stalls and throttling, :class:`FaultySyscalls`
failures of direct writes; :mod:`cryosnap.testing.store`
is the Store conformance suite (it imports pytest, hypothesis and numpy; this package does not).
Everything here runs on the calling thread. docs/design/storage.md has an example.
"""

from __future__ import annotations

import sys

from cryosnap.testing._faulty import Fault, FaultyStore, FaultySyscalls

__all__ = ["Fault", "FaultyStore", "FaultySyscalls"]

if "pytest" in sys.modules:
    # Only where pytest already runs: the package never imports it. Before the suite's import.
    sys.modules["pytest"].register_assert_rewrite("cryosnap.testing.store")
