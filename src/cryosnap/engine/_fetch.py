"""The read path's old home, kept for the modules that import it (``dcp``): everything lives
in :mod:`.read` now. Runs on the caller's thread and the read pool's.
"""

from __future__ import annotations

from cryosnap.engine.read import IO_BATCH_BYTES, Fetched, Mapped, read_blobs

__all__ = ["IO_BATCH_BYTES", "Fetched", "Mapped", "read_blobs"]
