"""cryosnap: asynchronous, incremental, multi-level checkpoints for PyTorch and scientific Python.

>>> import cryosnap
>>> info = cryosnap.save("run", {"w": weights}, step=10)   # durable on return
>>> state = cryosnap.load("run")                            # newest version that verifies

Imports nothing heavy: torch is imported only when a tensor is saved or loaded.
"""

from __future__ import annotations

from .checkpointer import Checkpointer, PendingSave, SaveInfo, load, save
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    IntegrityError,
    StateMismatchError,
    StorageError,
)

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "Checkpointer",
    "IntegrityError",
    "PendingSave",
    "SaveInfo",
    "StateMismatchError",
    "StorageError",
    "__version__",
    "load",
    "save",
]

__version__ = "0.1.0"
