"""The ``cryosnap`` command line: ``ls``, ``inspect``, ``verify``, ``diff``, ``export``, ``gc``,
``rm``, ``memory``, ``demo``, ``plan``, ``bench`` and ``import-dcp``, each a thin command over
the public API (:class:`cryosnap.Run`, :mod:`cryosnap.run`, :mod:`cryosnap.export`,
:mod:`cryosnap.plan`, :mod:`cryosnap.bench`, :mod:`cryosnap.dcp`). ``_main`` maps errors to
exit codes, ``_app`` wires typer, ``_render`` draws; one module per command. Runs on the
caller's thread; no collectives.
"""

from cryosnap.cli._main import main

__all__ = ["main"]
