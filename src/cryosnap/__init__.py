"""cryosnap: asynchronous, incremental, multi-level checkpoints for PyTorch and scientific Python.

>>> import cryosnap
>>> info = cryosnap.save("run", {"w": weights}, step=10)   # durable on return
>>> state = cryosnap.load("run")                            # newest version that verifies
>>> cryosnap.save("run", {"grid": cryosnap.File("out/grid.h5")}, step=11)  # a file's bytes

Imports nothing heavy: torch is imported only when a tensor is saved or loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from cryosnap._delta import apply_delta
from cryosnap._format.stats import LeafStats
from cryosnap._state.files import File
from cryosnap.checkpointer import Checkpointer, PendingSave, SaveInfo, Status, load, run_id_of, save
from cryosnap.errors import (
    BenchError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ConditionalWritesUnsupported,
    ConfigError,
    CoordinationError,
    CountersNotKeptError,
    DcpError,
    DcpFormatError,
    DirectIOError,
    ExportError,
    FileLeafError,
    InexactResumeError,
    IntegrityError,
    KeyNotFoundError,
    LockFileError,
    LockLostError,
    MemoryLevelError,
    MissingDependencyError,
    ParticipantMismatchError,
    PartNotFoundError,
    ReplicaDivergenceError,
    RunLockedError,
    SourceDamagedError,
    StateMismatchError,
    StatsNotRecordedError,
    StepOrderError,
    StorageError,
    StorageTimeoutError,
    TruncatedError,
    UnsupportedError,
    WorldSizeError,
)
from cryosnap.run import (
    FlushedVersion,
    FlushFailure,
    FlushReport,
    Run,
    VerifyReport,
    VersionInfo,
    flush,
)
from cryosnap.storage.striped import Device, Tier

if _TYPE_CHECKING:
    from cryosnap.integrations.torch import RNGState

__all__ = [
    "BenchError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "Checkpointer",
    "ConditionalWritesUnsupported",
    "ConfigError",
    "CoordinationError",
    "CountersNotKeptError",
    "DcpError",
    "DcpFormatError",
    "Device",
    "DirectIOError",
    "ExportError",
    "File",
    "FileLeafError",
    "FlushFailure",
    "FlushReport",
    "FlushedVersion",
    "InexactResumeError",
    "IntegrityError",
    "KeyNotFoundError",
    "LeafStats",
    "LockFileError",
    "LockLostError",
    "MemoryLevelError",
    "MissingDependencyError",
    "PartNotFoundError",
    "ParticipantMismatchError",
    "PendingSave",
    "RNGState",
    "ReplicaDivergenceError",
    "Run",
    "RunLockedError",
    "SaveInfo",
    "SourceDamagedError",
    "StateMismatchError",
    "StatsNotRecordedError",
    "Status",
    "StepOrderError",
    "StorageError",
    "StorageTimeoutError",
    "Tier",
    "TruncatedError",
    "UnsupportedError",
    "VerifyReport",
    "VersionInfo",
    "WorldSizeError",
    "__version__",
    "apply_delta",
    "flush",
    "load",
    "run_id_of",
    "save",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> _Any:
    # RNGState lives with the torch integration; imported on first use, so that importing
    # cryosnap never imports torch.
    if name == "RNGState":
        from cryosnap.integrations.torch import RNGState

        return RNGState
    raise AttributeError(f"module 'cryosnap' has no attribute {name!r}")
