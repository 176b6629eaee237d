"""The read path of one part: a pure plan (:mod:`._plan`), its executor on the read pool
(:mod:`._execute`), the mapped data files (:mod:`._mapped`) and the cold ones read with
direct I/O (:mod:`._cold`); design in docs/design/read-path.md. Runs on the caller's thread
and the read pool's threads.
"""

from __future__ import annotations

from cryosnap.engine.fetch._cold import ColdFiles, placer, prefaulting
from cryosnap.engine.fetch._execute import Fetched, read_blobs
from cryosnap.engine.fetch._mapped import Mapped
from cryosnap.engine.fetch._plan import _FRAGMENTED_RUNS as _FRAGMENTED_RUNS
from cryosnap.engine.fetch._plan import IO_BATCH_BYTES, ReadLimits, ReadPlan, plan_reads

__all__ = [
    "ColdFiles",
    "Fetched",
    "IO_BATCH_BYTES",
    "Mapped",
    "ReadLimits",
    "ReadPlan",
    "placer",
    "plan_reads",
    "prefaulting",
    "read_blobs",
]
