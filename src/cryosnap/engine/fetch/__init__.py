"""The read path of one part: a pure plan (:mod:`._plan`), its executor on the read pool
(:mod:`._execute`), the mapped data files (:mod:`._mapped`) and the cold ones read with
direct I/O (:mod:`._cold`), all cut by the one ``ReadLimits`` value of the read; design in
docs/design/read-path.md. Runs on the caller's thread and the read pool's threads.
"""

from __future__ import annotations

from cryosnap.engine.fetch._cold import ColdFiles, placer, prefaulting
from cryosnap.engine.fetch._execute import Fetched, read_blobs
from cryosnap.engine.fetch._mapped import Mapped
from cryosnap.engine.fetch._plan import ReadPlan, plan_reads

__all__ = [
    "ColdFiles",
    "Fetched",
    "Mapped",
    "ReadPlan",
    "placer",
    "plan_reads",
    "prefaulting",
    "read_blobs",
]
