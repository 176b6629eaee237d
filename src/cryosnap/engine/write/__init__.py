"""The write path of one version on one store: :class:`PartWriter` composes the differ (pure
over hashes), the appenders (one I/O thread per data file) and the share map of replicated
blobs. Runs on the writer thread; the appenders on their I/O threads.
"""

from __future__ import annotations

from cryosnap.engine.write._shares import Owners, assign_shares
from cryosnap.engine.write.part_writer import PartResult, PartWriter
from cryosnap.engine.write.part_writer import _split_pieces as _split_pieces

__all__ = ["Owners", "PartResult", "PartWriter", "assign_shares"]
