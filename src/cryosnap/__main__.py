"""``python -m cryosnap``: the command line (see :mod:`cryosnap.cli`)."""

from __future__ import annotations

import sys

from cryosnap.cli import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
