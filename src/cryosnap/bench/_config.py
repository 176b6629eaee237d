"""What ``cryosnap bench`` is asked to measure: the workloads, sizes and options
(:class:`BenchConfig`, :func:`parse_size`), the progress step, the two errors a bad argument or a
missing package raises, and the constants the modules share. Pure; no torch import.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryosnap._units import parse_bytes
from cryosnap.errors import BenchError, MissingDependencyError

WORKLOADS = ("dense", "many-small", "sparse", "training")
DEFAULT_SIZE_BYTES = 1 << 30
# The training state: 6 x Linear(2048, 2048) with Adam, parameters + two moments.
DEFAULT_TRAINING_SIZE_BYTES = 288 << 20
DEFAULT_TENSORS = 20_000
MIN_SIZE_BYTES = 1 << 20

SEED = 20240611
CHUNK_BYTES = 1 << 20  # cryosnap's default chunk_bytes: the grid the sparse workload changes
SPARSE_FRACTION = 0.01
TRAIN_EVERY = (1, 10)


# ---------------------------------------------------------------------------------- arguments


def parse_size(text: str, *, option: str = "--size") -> int:
    """``"1GiB"``, ``"512MiB"``, ``"300MB"``, ``"4M"`` (binary), ``"1048576"`` as bytes."""
    size = parse_bytes(text)
    if size is None:
        raise BenchError(
            f"{option} {text!r} is not a size (a number and a unit: B, KiB, MiB, GiB, TiB, "
            "or KB, MB, GB, TB; e.g. 512MiB, 1GiB, 300MB)"
        )
    if size < MIN_SIZE_BYTES:
        raise BenchError(f"{option} {text!r} is below the smallest state, 1 MiB")
    return size


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """What to measure. ``size_bytes`` None: the workload's default (1 GiB; training 288 MiB)."""

    workload: str = "dense"
    size_bytes: int | None = None
    repeat: int = 3
    warmup: int = 1
    directory: Path | None = None
    tensors: int = DEFAULT_TENSORS
    steps: int = 20
    step_seconds: float = 1.0
    cold: bool = True

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise BenchError(f"--workload {self.workload!r} is not one of: {', '.join(WORKLOADS)}")
        if self.size_bytes is not None and self.size_bytes < MIN_SIZE_BYTES:
            raise BenchError(f"--size {self.size_bytes} bytes is below the smallest state, 1 MiB")
        for name, value, low in (
            ("--repeat", self.repeat, 1),
            ("--warmup", self.warmup, 0),
            ("--steps", self.steps, 1),
            ("--tensors", self.tensors, 25),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise BenchError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (math.isfinite(self.step_seconds) and self.step_seconds > 0):
            raise BenchError(f"--step-seconds must be a positive number, got {self.step_seconds}")
        if self.directory is not None and not Path(self.directory).is_dir():
            raise BenchError(f"--dir {self.directory} is not an existing directory")

    @property
    def state_bytes(self) -> int:
        if self.size_bytes is not None:
            return self.size_bytes
        return DEFAULT_TRAINING_SIZE_BYTES if self.workload == "training" else DEFAULT_SIZE_BYTES


@dataclass(frozen=True, slots=True)
class BenchStep:
    """One step of progress: ``done`` of ``total`` measurements, ``what`` just finished."""

    done: int
    total: int
    what: str
    elapsed_seconds: float


ProgressFn = Callable[[BenchStep], None]


def require_torch() -> None:
    """Raise :class:`MissingDependencyError` (one line) when torch cannot be imported."""
    if importlib.util.find_spec("torch") is None:
        raise MissingDependencyError("cryosnap bench needs torch (pip install 'cryosnap[torch]')")
