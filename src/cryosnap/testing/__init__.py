"""Test support for cryosnap and for third-party storage backends.

- :class:`FaultyStore` (here): a store wrapper that injects failures, stalls and throttling, for
  tests and benchmarks.
- :mod:`cryosnap.testing.store`: the Store conformance suite, :class:`StoreTests`. A backend's
  test module subclasses it and provides a ``store`` fixture (an empty store)::

      import pytest
      from cryosnap.testing.store import StoreTests

      class TestMyStore(StoreTests):
          @pytest.fixture
          def store(self, tmp_path):
              return MyStore(tmp_path / "run")

  It imports pytest, hypothesis and numpy, so it is a module of its own: importing
  ``cryosnap.testing`` imports none of them. Under pytest, importing this package first asks
  pytest to rewrite the suite's asserts, so a failure shows the values compared.

Everything here runs on the calling thread.
"""

from __future__ import annotations

import sys

from cryosnap.testing._faulty import Fault, FaultyStore

__all__ = ["Fault", "FaultyStore"]

if "pytest" in sys.modules:
    # Only where pytest already runs: the package never imports it. Before the suite's import.
    sys.modules["pytest"].register_assert_rewrite("cryosnap.testing.store")
