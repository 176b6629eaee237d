"""The write path's former home, kept for the names imported from it: the code lives in
:mod:`cryosnap.engine.write` (docs/design/write-path.md).
"""

from __future__ import annotations

# Tests replace secrets.token_hex through this module to make data file names predictable.
import secrets as secrets

from cryosnap.engine.write import Owners, PartResult, PartWriter, assign_shares

__all__ = ["Owners", "PartResult", "PartWriter", "assign_shares"]
