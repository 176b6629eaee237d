"""``python -m cryosnap.demo``: the demo's parent, or a training child with ``--child``.
Runs as its own process.
"""

from cryosnap.demo._main import main

raise SystemExit(main())
