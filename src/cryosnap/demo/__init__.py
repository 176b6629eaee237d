"""The demo, ``make demo`` (``python -m cryosnap.demo``, ``cryosnap demo``): train, get
SIGKILLed at a random step, resume and finish bit for bit equal to an uninterrupted run, then
restore from the persistent tier alone (:func:`main` tells the whole story). Three processes:
the parent and two training children (``--child``). Needs torch; matplotlib for the plot.
"""

from cryosnap.demo._main import main
from cryosnap.demo._report import plot
from cryosnap.demo._workdir import MARKER, prepare

__all__ = ["MARKER", "main", "plot", "prepare"]
