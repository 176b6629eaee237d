"""``cryosnap bench``: cryosnap against its peers on the same state, beside the machine's limits.

Owns the measuring: the workloads (``dense``, ``many-small``, ``sparse``, ``training``), the peers
(``torch.save``, safetensors, ``torch.distributed.checkpoint`` save and ``async_save`` in one
process without a process group, torchsnapshot when installed, and cryosnap's one-shot ``save``
and ``Checkpointer`` eager and lazy), the limits measured in the same run (memcpy of the state,
raw write+fsync, raw ``readinto`` warm and, when the page cache can be dropped, cold), and the
results as samples, medians, ratios, table cells, JSON and a chart. The command line
(:mod:`cryosnap.cli`) parses, shows progress and renders; nothing here imports typer or rich.

Method: every peer runs on the same in-memory state, in one process, interleaved round robin
(the first peer rotates every round, so the drift of a shared machine spreads over all peers),
after ``warmup`` untimed rounds; each repetition writes into a fresh folder that is deleted
right after its timings (a ``Checkpointer`` of full versions lives for the whole run, as a job
holds one), and the file systems are synced (untimed) before each timed save.
Figures per peer and repetition:

- **stall**: the save call until it returns (the program is blocked); for synchronous peers the
  whole save;
- **durable**: the save call until the bytes are on disk (fsync'd);
- **written**: bytes of the files the save created or grew;
- **restore**: a fresh load, and a load into preallocated tensors (``into=``) where the peer has
  one, from a warm page cache (every peer's files read once first); cold after dropping the
  page cache where that is allowed;
- **peak memory**: peak RSS during the call minus RSS just before it, read from ``VmHWM`` reset
  through ``/proc/self/clear_refs`` (Linux), else from a sampling thread (psutil), else from
  ``ru_maxrss`` (a lower bound); :data:`BenchResult.memory_method` says which;
- **CPU seconds per GB**: ``time.process_time()`` (every thread of the process) from the save
  call until durable, per GB of state; "background" leaves out the stall's own CPU time.

torch is imported lazily (the ``torch`` extra), matplotlib only by :func:`plot` (the ``demo``
extra). Runs on the caller's thread; the peers start their own threads (cryosnap's writer, DCP's
executor) and every one of them is drained before the next peer runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime
import gc
import importlib
import importlib.util
import math
import os
import platform
import random
import re
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .progress import human_bytes

if TYPE_CHECKING:
    import torch

    StateDict = dict[str, torch.Tensor]

__all__ = [
    "WORKLOADS",
    "BenchConfig",
    "BenchError",
    "BenchResult",
    "BenchStep",
    "MissingDependencyError",
    "parse_size",
    "plot",
    "run",
]

WORKLOADS = ("dense", "many-small", "sparse", "training")
DEFAULT_SIZE_BYTES = 1 << 30
# The training state: 6 x Linear(2048, 2048) with Adam, parameters + two moments.
DEFAULT_TRAINING_SIZE_BYTES = 288 << 20
DEFAULT_TENSORS = 20_000
MIN_SIZE_BYTES = 1 << 20

_SEED = 20240611
_GB = 1e9
_CHUNK_BYTES = 1 << 20  # cryosnap's default chunk_bytes: the grid the sparse workload changes
_SPARSE_FRACTION = 0.01
_READ_BLOCK_BYTES = 8 << 20
_DENSE_TENSORS = 16
_MLP_LAYERS = 6
_TRAIN_EVERY = (1, 10)
_KIB = 1024


class BenchError(ValueError):
    """A benchmark argument that is not allowed (the message names it and what is allowed)."""


class MissingDependencyError(ImportError):
    """A package the benchmark needs is not installed (the message says how to install it)."""


# ---------------------------------------------------------------------------------- arguments

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def parse_size(text: str, *, option: str = "--size") -> int:
    """``"1GiB"``, ``"512MiB"``, ``"300MB"``, ``"4M"`` (binary), ``"1048576"`` as bytes."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise BenchError(
            f"{option} {text!r} is not a size (a number and a unit: B, KiB, MiB, GiB, TiB, "
            "or KB, MB, GB, TB; e.g. 512MiB, 1GiB, 300MB)"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
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


# --------------------------------------------------------------- files, page cache, the disk


def median(samples: Sequence[float]) -> float:
    """Median of the samples; NaN when there are none (a peer that failed or was skipped)."""
    return statistics.median(samples) if samples else float("nan")


def fsync_path(path: Path) -> None:
    """fsync one file (or directory) by path; on Linux an fsync on a read-only fd is durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def iter_files(root: Path) -> Iterator[Path]:
    """Every regular file under ``root`` (or ``root`` itself when it is a file), sorted."""
    if root.is_file():
        yield root
        return
    for dirpath, _dirnames, filenames in sorted(os.walk(root)):
        for name in sorted(filenames):
            yield Path(dirpath) / name


def tree_bytes(root: Path) -> int:
    """Bytes (apparent size) of every file under ``root``."""
    return sum(file_sizes(root).values())


def file_sizes(root: Path) -> dict[Path, int]:
    """Every file's size under ``root``; a file deleted during the walk is left out (a
    Checkpointer deletes what its retention drops after reporting the version)."""
    sizes: dict[Path, int] = {}
    if root.exists():
        for path in iter_files(root):
            with contextlib.suppress(FileNotFoundError):
                sizes[path] = path.stat().st_size
    return sizes


def written_between(before: Mapping[Path, int], after: Mapping[Path, int]) -> int:
    """Bytes of the files created or grown between two :func:`file_sizes` (deletions: 0)."""
    return sum(max(0, size - before.get(path, 0)) for path, size in after.items())


def settle_disk() -> None:
    """Flush every file system (untimed) so that the next timed save starts on a quiet disk.

    Removing a checkpoint leaves journal work behind (and, on a file system mounted with
    ``discard``, TRIMs) that would otherwise land in the next peer's fsync.
    """
    os.sync()


def warm_page_cache(root: Path) -> int:
    """Read every file under ``root`` once, so that every peer's timed loads start warm."""
    buffer = bytearray(_READ_BLOCK_BYTES)
    view = memoryview(buffer)
    total = 0
    for path in iter_files(root):
        try:
            f = open(path, "rb", buffering=0)  # noqa: SIM115
        except FileNotFoundError:
            continue  # retired by the run's writer meanwhile (see file_sizes)
        with f:
            while n := f.readinto(view):
                total += n
    return total


_DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_page_cache() -> bool:
    """Write back dirty pages, then drop the clean page cache (every file's, machine-wide).

    True when the kernel took it: needs root and a writable ``/proc/sys/vm/drop_caches``.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    os.sync()
    try:
        with open(_DROP_CACHES, "w") as f:
            f.write("1")
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------- peak memory


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise LookupError(f"{field_name} not in /proc/self/status")


def current_rss_bytes() -> int:
    """Resident set size of this process now (VmRSS)."""
    return _proc_status_kib("VmRSS") * _KIB


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where the kernel cannot.

    Writing 5 to /proc/self/clear_refs (Linux >= 4.0) resets the high-water mark, so the peak read
    afterwards belongs to what ran afterwards.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since the last :func:`reset_peak_rss` (VmHWM)."""
    return _proc_status_kib("VmHWM") * _KIB


def _malloc_trim() -> None:
    """Return freed heap pages to the kernel (glibc), so a later allocation shows in RSS."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


class _MemoryMeter:
    """Peak RSS of one call minus RSS before it, by the best method this machine offers."""

    def __init__(self) -> None:
        self.method = self._choose()
        self._before = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self._sampled = 0

    @staticmethod
    def _choose() -> str:
        try:
            current_rss_bytes()
            if reset_peak_rss():
                return "vmhwm"
        except (OSError, LookupError):
            pass
        if importlib.util.find_spec("psutil") is not None:
            return "psutil"
        return "ru_maxrss"

    @property
    def description(self) -> str:
        return {
            "vmhwm": "VmHWM reset through /proc/self/clear_refs before each call: peak RSS "
            "during the call minus RSS just before it",
            "psutil": "RSS sampled every 5 ms (psutil) during the call minus RSS just before it",
            "ru_maxrss": "growth of getrusage ru_maxrss over the call (a lower bound: only what "
            "exceeds the process's earlier peak)",
        }[self.method]

    def start(self) -> None:
        _malloc_trim()
        if self.method == "vmhwm":
            self._before = current_rss_bytes()
            reset_peak_rss()
        elif self.method == "psutil":
            import psutil

            process = psutil.Process()
            self._before = self._sampled = int(process.memory_info().rss)
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample, args=(process,), daemon=True)
            self._sampler.start()
        else:
            self._before = _maxrss_bytes()

    def _sample(self, process: Any) -> None:
        while not self._stop.wait(0.005):
            self._sampled = max(self._sampled, int(process.memory_info().rss))

    def stop(self) -> int:
        if self.method == "vmhwm":
            return max(0, peak_rss_bytes() - self._before)
        if self.method == "psutil" and self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None
            return max(0, self._sampled - self._before)
        return max(0, _maxrss_bytes() - self._before)


def _maxrss_bytes() -> int:
    # ru_maxrss is in KiB on Linux, in bytes on macOS.
    scale = 1 if sys.platform == "darwin" else _KIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


# ------------------------------------------------------------------------------------ states


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def dense_shapes(size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """fp32 in 16 tensors of (rows, 4096), about ``size_bytes`` in all (1 GiB: 4096 rows each)."""
    per_tensor = size_bytes // _DENSE_TENSORS // 4
    cols = 4096 if per_tensor >= 4096 else max(1, per_tensor)
    rows = max(1, per_tensor // cols)
    return [(f"blocks.{i}.weight", (rows, cols)) for i in range(_DENSE_TENSORS)]


def many_small_shapes(size_bytes: int, tensors: int) -> list[tuple[str, tuple[int, ...]]]:
    """A deep, narrow transformer-like state dict: ``tensors`` tensors, about ``size_bytes``.

    Layers of 20 tensors each (hidden 64, MLP 256): norms, biases and rotary buffers (small and
    fixed), projection matrices and two vocabulary matrices whose rows scale to reach the size
    (with 20,000 tensors and 300 MB it is bench_save_load.py's state b). Below the size of the
    fixed vectors, the matrices keep one row each.
    """
    hidden, mlp, vocab = 64, 256, 65536
    layers = max(1, (tensors - 5) // 20)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.append((f"{p}.input_layernorm.weight", (hidden,)))
        shapes.append((f"{p}.input_layernorm.bias", (hidden,)))
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes.append((f"{p}.attn.{proj}.weight", (hidden, hidden)))
            shapes.append((f"{p}.attn.{proj}.bias", (hidden,)))
        shapes.append((f"{p}.attn.q_norm.weight", (hidden,)))
        shapes.append((f"{p}.attn.k_norm.weight", (hidden,)))
        shapes.append((f"{p}.attn.rotary_emb.inv_freq", (hidden // 2,)))
        shapes.append((f"{p}.post_attention_layernorm.weight", (hidden,)))
        shapes.append((f"{p}.post_attention_layernorm.bias", (hidden,)))
        shapes.append((f"{p}.mlp.gate_proj.weight", (mlp, hidden)))
        shapes.append((f"{p}.mlp.up_proj.weight", (mlp, hidden)))
        shapes.append((f"{p}.mlp.up_proj.bias", (mlp,)))
        shapes.append((f"{p}.mlp.down_proj.weight", (hidden, mlp)))
        shapes.append((f"{p}.mlp.down_proj.bias", (hidden,)))
    shapes += [
        ("model.norm.weight", (hidden,)),
        ("model.norm.bias", (hidden,)),
        ("lm_head.weight", (vocab, hidden)),
    ]
    fixed = sum(_numel(s) * 4 for _, s in shapes if len(s) < 2)
    rows = sum(s[0] for _, s in shapes if len(s) >= 2)
    row_bytes = sum(_numel(s) * 4 for _, s in shapes if len(s) >= 2) / rows
    scale = max(0.0, size_bytes - fixed) / (rows * row_bytes)
    return [
        (name, shape if len(shape) < 2 else (max(1, round(shape[0] * scale)), *shape[1:]))
        for name, shape in shapes
    ]


def build_state(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> StateDict:
    """Random normal fp32 from a fixed seed: incompressible, no two chunks alike."""
    import torch

    generator = torch.Generator().manual_seed(_SEED)
    return {
        name: torch.randn(shape, generator=generator, dtype=torch.float32) for name, shape in shapes
    }


def state_nbytes(state: Mapping[str, Any]) -> int:
    return sum(int(t.numel()) * int(t.element_size()) for t in state.values())


class SparseChange:
    """Changes 1% of the state's chunks (cryosnap's 1 MiB grid from the start of each leaf)."""

    def __init__(self, state: StateDict) -> None:
        self._chunks: list[tuple[str, int, int]] = []  # (leaf, first element, elements)
        for name, tensor in state.items():
            per_chunk = _CHUNK_BYTES // tensor.element_size()
            total = int(tensor.numel())
            for start in range(0, total, per_chunk):
                self._chunks.append((name, start, min(per_chunk, total - start)))
        self.chunks = max(1, round(_SPARSE_FRACTION * len(self._chunks)))
        self._random = random.Random(_SEED)

    def apply(self, state: StateDict) -> int:
        """Overwrite a fresh random 1% of the chunks with new values; returns bytes changed."""
        import torch

        changed = 0
        for name, start, count in self._random.sample(self._chunks, self.chunks):
            flat = state[name].view(-1)
            flat[start : start + count] = torch.randn(count)
            changed += count * flat.element_size()
        return changed


def first_mismatch(expected: Mapping[str, Any], loaded: object) -> str | None:
    """None when ``loaded`` is a mapping equal to ``expected`` leaf by leaf, else what differs."""
    import torch

    if not isinstance(loaded, Mapping):
        return f"load returned {type(loaded).__name__}, not a mapping"
    if set(loaded) != set(expected):
        missing = sorted(set(expected) - set(loaded))[:3]
        extra = sorted(set(loaded) - set(expected))[:3]
        return f"keys differ: missing {missing}, unexpected {extra}"
    for name, want in expected.items():
        got = loaded[name]
        if not isinstance(got, torch.Tensor):
            return f"{name}: got {type(got).__name__}, not a torch.Tensor"
        if got.dtype != want.dtype or got.shape != want.shape:
            return (
                f"{name}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
            )
        if not torch.equal(got, want):
            return f"{name}: values differ"
    return None


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy (writable when the tensor is)."""
    import torch

    if not tensor.is_contiguous():
        raise ValueError("raw I/O needs contiguous tensors")
    view: memoryview = tensor.reshape(-1).view(torch.uint8).numpy().data
    return view


# ------------------------------------------------------------------------------------- peers


FinishFn = Callable[[], None]


class Peer:
    """One way to save and restore a state dict; the runner times its calls.

    A peer measures a subset of the figures: ``durable`` (its save makes the state durable),
    ``restores`` (a fresh load), ``restores_into`` (a load into preallocated tensors).
    """

    key = ""
    label = ""
    limit = False
    durable = True
    restores = False
    restores_into = False
    note = ""

    def setup(self, root: Path, state: StateDict) -> None:
        """Untimed, once before the first round (``root``: the run's temporary folder)."""

    def begin(self, work: Path, state: StateDict) -> None:
        """Untimed, before each timed save: ``work`` is a fresh, empty folder."""

    def folder(self, work: Path) -> Path:
        """Where the save writes: the folder whose new bytes count and whose files are warmed."""
        return work

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        """Start the save; return when the program may go on, with what waits for durability
        (None: durable already)."""
        raise NotImplementedError

    def load(self, work: Path) -> object:
        raise NotImplementedError

    def load_into(self, work: Path, into: StateDict) -> object:
        raise NotImplementedError

    def end(self) -> None:
        """Untimed, after each repetition's restores (and on the way out of a failure)."""

    def close(self) -> None:
        """Once, after the last round (also after a failure or Ctrl-C)."""
        self.end()


class MemcpyLimit(Peer):
    key = "memcpy"
    label = "memcpy (limit)"
    limit = True
    durable = False

    def __init__(self, into: StateDict) -> None:
        self._into = into

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        for name, tensor in state.items():
            self._into[name].copy_(tensor)
        return None


class RawLimit(Peer):
    """Every tensor's bytes back to back in one file: no format, the limit of the disk.

    The file is sized first (``ftruncate``, as safetensors does), so no write extends it.
    """

    key = "raw"
    label = "raw write+fsync / readinto (limit)"
    limit = True
    restores_into = True
    _file = "raw.bin"

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        with open(work / self._file, "wb", buffering=0) as f:
            os.ftruncate(f.fileno(), state_nbytes(state))
            for tensor in state.values():
                view = _byte_view(tensor)
                while view:  # a raw write may be short
                    view = view[f.write(view) :]
            os.fsync(f.fileno())
        fsync_path(work)
        return None

    def load_into(self, work: Path, into: StateDict) -> object:
        with open(work / self._file, "rb", buffering=0) as f:
            for tensor in into.values():
                view = _byte_view(tensor)
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise EOFError(f"{work / self._file} is shorter than the state")
                    view = view[n:]
        return into


class TorchSavePeer(Peer):
    key = "torch"
    label = "torch.save / torch.load"
    restores = True
    _file = "state.pt"

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        import torch

        with open(work / self._file, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(work)
        return None

    def load(self, work: Path) -> object:
        import torch

        return torch.load(work / self._file, weights_only=True)


class SafetensorsPeer(Peer):
    key = "safetensors"
    label = "safetensors save_file / load_file"
    restores = True
    note = "safetensors loads with backend='pread' (the default mmap reads nothing until used)"
    _file = "state.safetensors"

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        from safetensors.torch import save_file

        save_file(state, work / self._file)
        fsync_path(work / self._file)
        fsync_path(work)
        return None

    def load(self, work: Path) -> object:
        from safetensors import torch as st

        try:
            return st.load_file(work / self._file, backend="pread")
        except TypeError:  # before the backend argument: read every byte now, as the others do
            return st.load((work / self._file).read_bytes())


def _quiet_dcp() -> None:
    # DCP warns on every call that it runs without a process group, which is what we mean.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")


class DcpPeer(Peer):
    key = "dcp"
    label = "DCP save / load"
    restores_into = True

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        path = work / "dcp"
        # Explicit about what the default writer already does: fsync data files and metadata.
        save(state, checkpoint_id=path, storage_writer=FileSystemWriter(path, sync_files=True))
        return None

    def load_into(self, work: Path, into: StateDict) -> object:
        from torch.distributed.checkpoint.state_dict_loader import load

        load(into, checkpoint_id=work / "dcp")
        return into


def dcp_async_save(state: Mapping[str, Any], path: Path) -> tuple[Future[Any], Future[Any] | None]:
    """``torch.distributed.checkpoint.async_save``: (upload future, staging future or None)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    result = async_save(dict(state), checkpoint_id=path)
    if isinstance(result, AsyncSaveResponse):
        return result.upload_completion, result.staging_completion
    return result, None


class DcpAsyncPeer(Peer):
    key = "dcp_async"
    label = "DCP async_save"
    note = "DCP async_save writes DCP's format: its restore is DCP load's"

    def __init__(self) -> None:
        self._upload: Future[Any] | None = None

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        upload, staging = dcp_async_save(state, work / "dcp")
        self._upload = upload
        if staging is not None:
            staging.result()  # the state may not change before its staging copy is done
        return self._wait

    def _wait(self) -> None:
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.result()

    def end(self) -> None:
        with contextlib.suppress(Exception):
            self._wait()


class TorchsnapshotPeer(Peer):
    key = "torchsnapshot"
    label = "torchsnapshot take / restore"
    restores_into = True

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        import torchsnapshot

        torchsnapshot.Snapshot.take(
            str(work / "snap"), app_state={"state": torchsnapshot.StateDict(**state)}
        )
        return None

    def load_into(self, work: Path, into: StateDict) -> object:
        import torchsnapshot

        target = torchsnapshot.StateDict(**into)
        torchsnapshot.Snapshot(str(work / "snap")).restore(app_state={"state": target})
        return dict(target)


class CryosnapPeer(Peer):
    key = "cryosnap"
    label = "cryosnap save / load"
    restores = True
    restores_into = True

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        import cryosnap

        cryosnap.save(work / "run", state, step=0, chunk_bytes=_CHUNK_BYTES)
        return None

    def load(self, work: Path) -> object:
        import cryosnap

        loaded: object = cryosnap.load(work / "run")
        return loaded

    def load_into(self, work: Path, into: StateDict) -> object:
        import cryosnap

        cryosnap.load(work / "run", into=into)
        return into


class CheckpointerPeer(Peer):
    """A ``cryosnap.Checkpointer``, eager or lazy; restore is ``ckpt.restore``.

    Full versions (``incremental=False``, dense and many-small): one Checkpointer for the whole
    run, as a job holds one; its untimed first version, before the first round, allocates the
    staging pool, and each repetition times one more version (``keep=1``: the previous one is
    retired, as a bounded run does). Incremental (sparse): a new Checkpointer per repetition,
    an untimed full first version, then the timed incremental one against it.
    """

    def __init__(self, *, lazy: bool, incremental: bool) -> None:
        self.lazy = lazy
        self.incremental = incremental
        self.key = "cryosnap_lazy" if lazy else "cryosnap_eager"
        self.label = f"cryosnap Checkpointer {'lazy' if lazy else 'eager'}"
        self.restores = self.restores_into = not lazy
        if lazy:
            self.note = "the lazy Checkpointer writes the eager one's files: its restore is theirs"
        elif incremental:
            self.note = (
                "a new Checkpointer per repetition: an untimed full version, then the timed "
                "incremental one"
            )
        else:
            self.note = (
                "one Checkpointer for the run (incremental=False, keep=1): an untimed first "
                "version before the first round allocates the staging pool, then one timed "
                "version per repetition"
            )
        self._ckpt: Any = None
        self._run: Path | None = None
        self._step = 0

    def _open(self, run: Path, state: StateDict) -> None:
        import cryosnap

        self._run = run
        self._ckpt = cryosnap.Checkpointer(
            run,
            incremental=self.incremental,
            chunk_bytes=_CHUNK_BYTES,
            staging_bytes=None,
            keep=None if self.incremental else 1,
        )
        self._step = 0
        self._ckpt.save(self._step, state).result()

    def setup(self, root: Path, state: StateDict) -> None:
        if not self.incremental:
            self._open(root / f"{self.key}-run", state)

    def begin(self, work: Path, state: StateDict) -> None:
        if self.incremental:
            self._open(work / "run", state)

    def folder(self, work: Path) -> Path:
        return work if self._run is None else self._run

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        self._step += 1
        pending = self._ckpt.save(self._step, state, lazy=self.lazy)

        def durable() -> None:
            pending.result()

        return durable

    def load(self, work: Path) -> object:
        restored: object = self._ckpt.restore()
        return restored

    def load_into(self, work: Path, into: StateDict) -> object:
        self._ckpt.restore(into=into)
        return into

    def end(self) -> None:
        if self.incremental:
            self.close()

    def close(self) -> None:
        ckpt, self._ckpt, self._run = self._ckpt, None, None
        if ckpt is not None:
            ckpt.close()


def make_peers(workload: str, into: StateDict) -> tuple[list[Peer], dict[str, str]]:
    """The limits and every peer that imports, and why each missing one is missing."""
    peers: list[Peer] = [MemcpyLimit(into), RawLimit(), TorchSavePeer()]
    missing: dict[str, str] = {}
    if importlib.util.find_spec("safetensors") is not None:
        peers.append(SafetensorsPeer())
    else:
        missing["safetensors"] = "not installed"
    if _dcp_available():
        peers += [DcpPeer(), DcpAsyncPeer()]
    else:
        missing["dcp"] = "torch.distributed is not available in this torch build"
    if importlib.util.find_spec("torchsnapshot") is not None:
        peers.append(TorchsnapshotPeer())
    else:
        missing["torchsnapshot"] = "not installed"
    incremental = workload == "sparse"
    if not incremental:
        peers.append(CryosnapPeer())
    peers += [
        CheckpointerPeer(lazy=False, incremental=incremental),
        CheckpointerPeer(lazy=True, incremental=incremental),
    ]
    return peers, missing


def _import_peers() -> None:
    """Import every peer that imports now, not inside its first timed call."""
    for name in (
        "cryosnap.checkpointer",
        "safetensors.torch",
        "torch.distributed.checkpoint",
        "torch.distributed.checkpoint.state_dict_saver",
        "torch.distributed.checkpoint.state_dict_loader",
        "torchsnapshot",
    ):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _dcp_available() -> bool:
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        importlib.import_module("torch.distributed.checkpoint")
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------------------ results


METRICS = (
    "stall_seconds",
    "durable_seconds",
    "written_bytes",
    "restore_seconds",
    "restore_into_seconds",
    "restore_cold_seconds",
    "save_peak_bytes",
    "restore_peak_bytes",
    "restore_into_peak_bytes",
    "cpu_seconds",
    "background_cpu_seconds",
)


@dataclass(slots=True)
class PeerFigures:
    """Every sample of one peer (or limit), by metric name (:data:`METRICS`)."""

    key: str
    label: str
    limit: bool
    samples: dict[str, list[float]] = field(default_factory=dict)
    error: str | None = None
    note: str = ""

    def add(self, metric: str, value: float) -> None:
        self.samples.setdefault(metric, []).append(float(value))

    def median(self, metric: str) -> float:
        return median(self.samples.get(metric, []))


@dataclass(slots=True)
class TrainingFigures:
    """One checkpoint method at one interval in the training loop, over every round."""

    key: str
    label: str
    every: int
    step_seconds: list[float] = field(default_factory=list)
    save_call_seconds: list[float] = field(default_factory=list)
    durable_seconds: list[float] = field(default_factory=list)
    drain_seconds: list[float] = field(default_factory=list)
    written_bytes: list[float] = field(default_factory=list)
    cpu_seconds_per_step: list[float] = field(default_factory=list)
    saves: int = 0
    error: str | None = None

    @property
    def mean_step_seconds(self) -> float:
        return statistics.fmean(self.step_seconds) if self.step_seconds else float("nan")


@dataclass(slots=True)
class BenchResult:
    """What one ``cryosnap bench`` run measured (:meth:`to_json` is the ``--json`` document)."""

    config: BenchConfig
    machine: dict[str, Any]
    date: str
    command: str
    state_bytes: int
    tensors: int
    title: str
    memory_method: str
    cold: str
    peers: list[PeerFigures] = field(default_factory=list)
    training: list[TrainingFigures] = field(default_factory=list)
    training_setup: dict[str, Any] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)
    load_average: tuple[float, float] = (float("nan"), float("nan"))
    elapsed_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    # ---- the limits measured in the same run

    def _limit(self, key: str, metric: str) -> float:
        for peer in self.peers:
            if peer.key == key and peer.error is None:
                return peer.median(metric)
        return float("nan")

    @property
    def limits(self) -> dict[str, float]:
        return {
            "memcpy_seconds": self._limit("memcpy", "stall_seconds"),
            "write_fsync_seconds": self._limit("raw", "durable_seconds"),
            "read_warm_seconds": self._limit("raw", "restore_into_seconds"),
            "read_cold_seconds": self._limit("raw", "restore_cold_seconds"),
        }

    def ratios(self, peer: PeerFigures) -> dict[str, float]:
        """Medians against the limits: stall / memcpy, durable / raw write+fsync, restores /
        raw readinto (warm; cold against cold)."""
        limits = self.limits
        against = {
            "stall_seconds": limits["memcpy_seconds"],
            "durable_seconds": limits["write_fsync_seconds"],
            "restore_seconds": limits["read_warm_seconds"],
            "restore_into_seconds": limits["read_warm_seconds"],
            "restore_cold_seconds": limits["read_cold_seconds"],
        }
        return {m: _ratio(peer.median(m), ref) for m, ref in against.items()}

    def overhead_percent(self, figures: TrainingFigures) -> float:
        """Mean step time with checkpoints against the same interval's baseline, minus 1."""
        base = next(
            (f for f in self.training if f.key == "none" and f.every == figures.every), None
        )
        if base is None or not figures.step_seconds:
            return float("nan")
        return (figures.mean_step_seconds / base.mean_step_seconds - 1.0) * 100.0

    # ---- output

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "cryosnap_bench": 1,
            "date": self.date,
            "command": self.command,
            "machine": self.machine,
            "config": {
                "workload": self.config.workload,
                "size_bytes": self.config.state_bytes,
                "repeat": self.config.repeat,
                "warmup": self.config.warmup,
                "directory": str(self.config.directory) if self.config.directory else None,
                "tensors": self.config.tensors,
                "steps": self.config.steps,
                "step_seconds": self.config.step_seconds,
                "cold": self.config.cold,
            },
            "state": {"title": self.title, "bytes": self.state_bytes, "tensors": self.tensors},
            "memory_method": self.memory_method,
            "cold": self.cold,
            "missing_peers": self.missing,
            "load_average": list(self.load_average),
            "elapsed_seconds": self.elapsed_seconds,
            "notes": self.notes,
        }
        if self.config.workload == "training":
            doc["training"] = {
                **self.training_setup,
                "methods": [self._training_json(f) for f in self.training],
            }
            return _finite_doc(doc)
        doc["limits"] = self.limits
        doc["peers"] = [
            {
                "key": p.key,
                "label": p.label,
                "limit": p.limit,
                "error": p.error,
                "note": p.note,
                "samples": p.samples,
                "medians": {m: p.median(m) for m in METRICS if m in p.samples},
                "ratios": {k: v for k, v in self.ratios(p).items() if not math.isnan(v)},
                "cpu_seconds_per_gb": p.median("cpu_seconds") / (self.state_bytes / _GB),
                "background_cpu_seconds_per_gb": p.median("background_cpu_seconds")
                / (self.state_bytes / _GB),
            }
            for p in self.peers
        ]
        return _finite_doc(doc)

    def _training_json(self, f: TrainingFigures) -> dict[str, Any]:
        return {
            "key": f.key,
            "label": f.label,
            "every": f.every,
            "error": f.error,
            "saves": f.saves,
            "mean_step_seconds": f.mean_step_seconds,
            "overhead_percent": self.overhead_percent(f) if f.key != "none" else 0.0,
            "samples": {
                "step_seconds": f.step_seconds,
                "save_call_seconds": f.save_call_seconds,
                "durable_seconds": f.durable_seconds,
                "drain_seconds": f.drain_seconds,
                "written_bytes": f.written_bytes,
                "cpu_seconds_per_step": f.cpu_seconds_per_step,
            },
            "medians": {
                "step_seconds": median(f.step_seconds),
                "save_call_seconds": median(f.save_call_seconds),
                "durable_seconds": median(f.durable_seconds),
                "written_bytes": median(f.written_bytes),
            },
        }

    def table(self) -> tuple[list[tuple[str, bool]], list[list[str]]]:
        """(columns as (title, right-aligned), rows of cells) of the results table."""
        if self.config.workload == "training":
            return self._training_table()
        cold = any("restore_cold_seconds" in p.samples for p in self.peers)
        columns = [
            ("peer", False),
            ("stall", True),
            ("durable", True),
            ("written", True),
            ("restore", True),
            ("restore into", True),
            *([("restore cold", True)] if cold else []),
            ("peak mem save/restore/into", True),
            ("CPU s/GB (bg)", True),
        ]
        rows = []
        gb = self.state_bytes / _GB
        for p in self.peers:
            if p.error is not None:
                rows.append([p.label, "error", *[""] * (len(columns) - 2)])
                continue
            ratio = self.ratios(p)

            def cell(metric: str, p: PeerFigures = p, ratio: dict[str, float] = ratio) -> str:
                return _seconds_cell(p.median(metric), ratio[metric])

            cpu, bg = p.median("cpu_seconds") / gb, p.median("background_cpu_seconds") / gb
            rows.append(
                [
                    p.label,
                    cell("stall_seconds"),
                    cell("durable_seconds"),
                    _bytes_cell(p.median("written_bytes")),
                    cell("restore_seconds"),
                    cell("restore_into_seconds"),
                    *([cell("restore_cold_seconds")] if cold else []),
                    f"{_bytes_cell(p.median('save_peak_bytes'))} / "
                    f"{_bytes_cell(p.median('restore_peak_bytes'))} / "
                    f"{_bytes_cell(p.median('restore_into_peak_bytes'))}",
                    "-" if math.isnan(cpu) else f"{cpu:.2f} ({bg:.2f})",
                ]
            )
        return columns, rows

    def _training_table(self) -> tuple[list[tuple[str, bool]], list[list[str]]]:
        columns = [
            ("method", False),
            ("every", True),
            ("step (mean)", True),
            ("overhead", True),
            ("save call", True),
            ("durable", True),
            ("written/save", True),
        ]
        rows = []
        for f in self.training:
            if f.error is not None:
                rows.append([f.label, str(f.every), "error", *[""] * 4])
                continue
            step = _seconds_cell(f.mean_step_seconds)
            if f.key == "none":
                rows.append([f.label, str(f.every), step, "baseline", "-", "-", "-"])
                continue
            call = statistics.fmean(f.save_call_seconds) if f.save_call_seconds else math.nan
            rows.append(
                [
                    f.label,
                    str(f.every),
                    step,
                    _percent_cell(self.overhead_percent(f)),
                    _seconds_cell(call),
                    _seconds_cell(median(f.durable_seconds)),
                    _bytes_cell(median(f.written_bytes)),
                ]
            )
        return columns, rows

    def summary(self) -> list[str]:
        """The lines printed around the table: what was measured, how, and how busy it was."""
        c = self.config
        lines = [
            f"cryosnap bench: {c.workload}, {self.title}; {self.machine.get('cpus')} CPUs, "
            f"{self.machine.get('platform')}, python {self.machine.get('python')}, torch "
            f"{self.machine.get('torch')}; {self.date}",
        ]
        if c.workload == "training":
            setup = self.training_setup
            lines.append(
                f"{setup.get('steps')} timed steps per method and interval in each of "
                f"{c.repeat} round(s), after a drained warm-up save; batch {setup.get('batch')} "
                f"(~{c.step_seconds} s/step); overhead: mean step time against the same "
                "interval's no-checkpoint runs"
            )
        else:
            limits = self.limits
            lines.append(
                f"medians of {c.repeat} after {c.warmup} warm-up round(s), peers round-robin; "
                f"ratios: stall x memcpy ({_seconds_cell(limits['memcpy_seconds'])}), durable x "
                f"raw write+fsync ({_seconds_cell(limits['write_fsync_seconds'])}), restore x "
                f"raw readinto warm ({_seconds_cell(limits['read_warm_seconds'])})"
            )
            lines.append(f"cold: {self.cold}")
            lines.append(f"peak memory: {self.memory_method}")
            lines.append(
                "CPU s/GB: process CPU seconds from the save call until durable, per GB of "
                "state; (bg): without the stall's own"
            )
        lines += self.notes
        return lines


def _finite_doc(doc: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = _finite(doc)
    return out


def _finite(value: Any) -> Any:
    """JSON has no NaN: a figure that was not measured is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _ratio(value: float, reference: float) -> float:
    if math.isnan(value) or math.isnan(reference) or reference <= 0:
        return float("nan")
    return value / reference


def _seconds_cell(seconds: float, ratio: float = float("nan")) -> str:
    if math.isnan(seconds):
        return "-"
    text = f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds:.3f} s"
    return text if math.isnan(ratio) else f"{text} ({ratio:.2f}x)"


def _bytes_cell(nbytes: float) -> str:
    return "-" if math.isnan(nbytes) else human_bytes(nbytes)


def _percent_cell(percent: float) -> str:
    return "-" if math.isnan(percent) else f"{percent:+.1f}%"


# ------------------------------------------------------------------------------------ running


def machine_info() -> dict[str, Any]:
    """The machine and the software the figures belong to."""
    import numpy

    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_bytes": _memory_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = None
    for name in ("safetensors", "torchsnapshot"):
        try:
            info[name] = importlib.import_module(name).__version__
        except (ImportError, AttributeError):
            info[name] = None
    from . import __version__

    info["cryosnap"] = f"{__version__} ({Path(__file__).resolve().parent})"
    return info


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or None


def _memory_bytes() -> int | None:
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


class _CtrlC:
    """Remembers a Ctrl-C, so that a peer that wraps the ``KeyboardInterrupt`` in an exception of
    its own (DCP does: its ``CheckpointException`` carries it) still stops the run, instead of
    being recorded as that peer's failure while the benchmark goes on."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Any = None

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handler(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def failure(self, exc: Exception) -> str:
        """The one-line reason a peer failed; raises ``KeyboardInterrupt`` after a Ctrl-C."""
        if self.seen:
            raise KeyboardInterrupt from exc
        return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


class _Clock:
    """Counts finished measurements for the progress display."""

    def __init__(self, total: int, progress: ProgressFn | None) -> None:
        self.total = total
        self.done = 0
        self._progress = progress
        self._t0 = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def tick(self, what: str) -> None:
        self.done += 1
        if self._progress is not None:
            self._progress(BenchStep(self.done, self.total, what, self.elapsed))


def run(
    config: BenchConfig, *, command: str = "", progress: ProgressFn | None = None
) -> BenchResult:
    """Run the benchmark ``config`` describes; ``progress`` is called after each measurement.

    Every file goes into a temporary folder inside ``config.directory`` (default: the system
    temp dir) that is deleted at the end, also on an exception or Ctrl-C.
    """
    require_torch()
    import torch  # noqa: F401  (fails here, once, rather than inside a peer)

    _import_peers()
    root = Path(tempfile.mkdtemp(prefix="cryosnap-bench-", dir=config.directory))
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    # Garbage is collected before every timed call, so that no peer pays for another's; the
    # objects that exist now (torch's modules: a full collection of them takes ~0.2 s) are
    # moved out of the collector's way for the run.
    gc.collect()
    gc.freeze()
    try:
        with warnings.catch_warnings(), _CtrlC() as ctrl_c:
            _quiet_dcp()
            if config.workload == "training":
                result = _run_training(config, root, command, progress, ctrl_c)
            else:
                result = _run_save_load(config, root, command, progress, ctrl_c)
    finally:
        gc.unfreeze()
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    result.load_average = (load_before, load_after)
    cpus = os.cpu_count() or 1
    result.notes.append(
        f"1-minute load average {load_before:.2f} before, {load_after:.2f} after ({cpus} CPUs)"
    )
    if max(load_before, load_after) > cpus:
        result.notes.append(
            "the machine was busy: these figures carry other programs' load; compare quiet "
            "runs only"
        )
    return result


def _new_result(
    config: BenchConfig, command: str, state_bytes: int, tensors: int, title: str
) -> BenchResult:
    return BenchResult(
        config=config,
        machine=machine_info(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=command,
        state_bytes=state_bytes,
        tensors=tensors,
        title=title,
        memory_method="",
        cold="",
    )


def _title(workload: str, state: Mapping[str, Any], nbytes: int) -> str:
    what = {
        "dense": "fp32",
        "many-small": "fp32, transformer-like names and mixed sizes",
        "sparse": f"fp32, {_SPARSE_FRACTION:.0%} of its 1 MiB chunks changed before each save",
    }[workload]
    return f"{human_bytes(nbytes)} of {what} in {len(state):,} tensors"


def _run_save_load(
    config: BenchConfig,
    root: Path,
    command: str,
    progress: ProgressFn | None,
    ctrl_c: _CtrlC,
) -> BenchResult:
    import torch

    if config.workload == "many-small":
        shapes = many_small_shapes(config.state_bytes, config.tensors)
    else:
        shapes = dense_shapes(config.state_bytes)
    state = build_state(shapes)
    nbytes = state_nbytes(state)
    result = _new_result(
        config, command, nbytes, len(state), _title(config.workload, state, nbytes)
    )
    # One preallocated, touched destination for every in-place load and the memcpy limit.
    into = {name: torch.empty_like(t).zero_() for name, t in state.items()}
    peers, result.missing = make_peers(config.workload, into)
    figures = {p.key: PeerFigures(p.key, p.label, p.limit, note=p.note) for p in peers}
    result.peers = [figures[p.key] for p in peers]
    meter = _MemoryMeter()
    result.memory_method = meter.description
    cold = config.cold and drop_page_cache()
    if cold:
        result.cold = "the page cache is dropped (/proc/sys/vm/drop_caches) before each cold read"
    elif not config.cold:
        result.cold = "not measured (--no-cold)"
    else:
        result.cold = "not measured (needs root)"
    sparse = SparseChange(state) if config.workload == "sparse" else None
    if sparse is not None:
        result.notes.append(
            f"sparse: {sparse.chunks} random chunks of 1 MiB changed before every timed save; the "
            "cryosnap Checkpointers save incrementally against their untimed first version, the "
            "other peers save the whole state"
        )
    rounds = config.warmup + config.repeat
    clock = _Clock(rounds * len(peers), progress)
    try:
        for peer in peers:
            try:
                peer.setup(root, state)
            except Exception as exc:
                figures[peer.key].error = ctrl_c.failure(exc)
        for r in range(rounds):
            timed = r >= config.warmup
            shift = r % len(peers)
            label = f"round {r + 1}/{rounds}" + ("" if timed else " (warm-up)")
            for peer in peers[shift:] + peers[:shift]:
                fig = figures[peer.key]
                if fig.error is None:
                    work = root / f"{peer.key}-{r}"
                    try:
                        _measure_peer(
                            peer, fig if timed else None, state, into, work,
                            verify=r == 0, cold=cold, meter=meter, sparse=sparse,
                        )  # fmt: skip
                    except Exception as exc:
                        fig.error = ctrl_c.failure(exc)
                clock.tick(f"{label}: {peer.label}")
    finally:
        for peer in peers:
            with contextlib.suppress(Exception):
                peer.close()
    for fig in result.peers:
        if fig.error is not None:
            result.notes.append(f"{fig.label}: failed: {fig.error}")
    result.notes += [f"{p.key}: {p.note}" for p in peers if p.note]
    result.notes += [f"{key}: not measured ({why})" for key, why in result.missing.items()]
    result.elapsed_seconds = clock.elapsed
    return result


def _measure_peer(
    peer: Peer,
    fig: PeerFigures | None,
    state: StateDict,
    into: StateDict,
    work: Path,
    *,
    verify: bool,
    cold: bool,
    meter: _MemoryMeter,
    sparse: SparseChange | None,
) -> None:
    """One repetition of one peer: save (timed), then its restores (timed); ``fig`` None: a
    warm-up round (nothing recorded). ``work`` is removed at the end, whatever happens."""
    work.mkdir()
    try:
        peer.begin(work, state)
        if sparse is not None:
            sparse.apply(state)
        sample = _time_save(peer, work, state, meter)
        if fig is not None:
            for metric, value in sample.items():
                fig.add(metric, value)
        if peer.restores or peer.restores_into:
            warm_page_cache(peer.folder(work))
        if peer.restores:
            seconds, peak, loaded = _time_restore(lambda: peer.load(work), meter)
            if verify:
                _check_round_trip(state, loaded)
            del loaded
            if fig is not None:
                fig.add("restore_seconds", seconds)
                fig.add("restore_peak_bytes", peak)
        if peer.restores_into:
            if verify:
                for tensor in into.values():
                    tensor.zero_()  # so a load that fills nothing cannot pass the check
            seconds, peak, loaded = _time_restore(lambda: peer.load_into(work, into), meter)
            if verify:
                _check_round_trip(state, loaded)
            del loaded
            if fig is not None:
                fig.add("restore_into_seconds", seconds)
                fig.add("restore_into_peak_bytes", peak)
            if cold:
                drop_page_cache()
                seconds, _, loaded = _time_restore(lambda: peer.load_into(work, into), meter)
                del loaded
                if fig is not None:
                    fig.add("restore_cold_seconds", seconds)
        elif peer.restores and cold:
            drop_page_cache()
            seconds, _, loaded = _time_restore(lambda: peer.load(work), meter)
            del loaded
            if fig is not None:
                fig.add("restore_cold_seconds", seconds)
    finally:
        try:
            peer.end()
        finally:
            shutil.rmtree(work, ignore_errors=True)
            settle_disk()


def _time_save(peer: Peer, work: Path, state: StateDict, meter: _MemoryMeter) -> dict[str, float]:
    gc.collect()
    settle_disk()
    before = file_sizes(peer.folder(work))
    meter.start()
    cpu0, t0 = time.process_time(), time.perf_counter()
    finish = peer.save(work, state)
    t1, cpu1 = time.perf_counter(), time.process_time()
    if finish is not None:
        finish()
    t2, cpu2 = time.perf_counter(), time.process_time()
    peak = meter.stop()
    sample = {"stall_seconds": t1 - t0, "save_peak_bytes": float(peak)}
    if peer.durable:
        sample.update(
            durable_seconds=t2 - t0,
            written_bytes=float(written_between(before, file_sizes(peer.folder(work)))),
            cpu_seconds=cpu2 - cpu0,
            background_cpu_seconds=(cpu2 - cpu0) - (cpu1 - cpu0),
        )
    return sample


def _time_restore(fn: Callable[[], object], meter: _MemoryMeter) -> tuple[float, int, object]:
    gc.collect()
    meter.start()
    t0 = time.perf_counter()
    loaded = fn()
    seconds = time.perf_counter() - t0
    return seconds, meter.stop(), loaded


def _check_round_trip(state: StateDict, loaded: object) -> None:
    mismatch = first_mismatch(state, loaded)
    if mismatch is not None:
        raise ValueError(f"round trip differs: {mismatch}")


# ------------------------------------------------------------------------- training workload


def mlp_width(state_bytes: int) -> int:
    """Width W of 6 Linear(W, W) layers whose parameters and two Adam moments fill the size."""
    per_width = 3 * 4 * _MLP_LAYERS  # bytes per (W^2 + W), three copies (params, exp_avg(_sq))
    return max(8, math.isqrt(state_bytes // per_width))


def _make_model(width: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(_SEED)
    blocks: list[torch.nn.Module] = []
    for _ in range(_MLP_LAYERS):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def _train_step(model: Any, opt: Any, x: Any, y: Any) -> None:
    import torch

    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    torch.autograd.backward(loss)
    opt.step()


def _training_state_bytes(model: Any, opt: Any) -> int:
    import torch

    total = sum(int(p.numel()) * int(p.element_size()) for p in model.parameters())
    for st in opt.state.values():
        for value in st.values():
            if isinstance(value, torch.Tensor):
                total += int(value.numel()) * int(value.element_size())
    return total


def _tune_batch(model: Any, opt: Any, width: int, target_seconds: float) -> int:
    """A batch size for a train step of about ``target_seconds`` (between 16 and 65536)."""
    import torch

    batch = 64
    for _ in range(2):  # estimate, then correct once at the estimated size
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        _train_step(model, opt, x, y)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            _train_step(model, opt, x, y)
            times.append(time.perf_counter() - t0)
        estimate = min(65536, max(16, round(batch * target_seconds / max(median(times), 1e-6))))
        clamped = estimate in (batch, 16, 65536)  # nothing a second measurement would change
        batch = estimate
        if clamped:
            break
    return batch


class Saver:
    """A checkpoint method inside the training loop (this one: none, the baseline)."""

    key = "none"
    label = "no checkpoint (baseline)"

    def open(self, work: Path, model: Any, opt: Any) -> None:
        self.work, self.model, self.opt = work, model, opt
        self.save_seconds: list[float] = []
        self.durable_seconds: list[float] = []

    def save(self, step: int) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass


class CryosnapSaver(Saver):
    def __init__(self, *, lazy: bool) -> None:
        self.lazy = lazy
        self.key = "cryosnap_lazy" if lazy else "cryosnap_eager"
        self.label = f"cryosnap Checkpointer {'lazy' if lazy else 'eager'}"

    def open(self, work: Path, model: Any, opt: Any) -> None:
        import cryosnap

        super().open(work, model, opt)
        self.ckpt = cryosnap.Checkpointer(work / "run")  # product defaults: incremental
        self.pendings: list[Any] = []

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        state = {"model": self.model, "optim": self.opt}
        self.pendings.append(self.ckpt.save(step, state, lazy=self.lazy))
        self.save_seconds.append(time.perf_counter() - t0)

    def drain(self) -> None:
        self.ckpt.wait()
        self.durable_seconds += [p.result().seconds for p in self.pendings]
        self.pendings.clear()

    def close(self) -> None:
        self.ckpt.close()


class DcpSaver(Saver):
    key = "dcp_async"
    label = "DCP async_save"

    def open(self, work: Path, model: Any, opt: Any) -> None:
        super().open(work, model, opt)
        self.future: Future[Any] | None = None

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        if self.future is not None:
            self.future.result()  # as the DCP docs recommend: one checkpoint in flight
        state = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        future, _staging = dcp_async_save(state, self.work / f"step-{step}")
        future.add_done_callback(lambda _f: self.durable_seconds.append(time.perf_counter() - t0))
        self.future = future
        self.save_seconds.append(time.perf_counter() - t0)

    def drain(self) -> None:
        future, self.future = self.future, None
        if future is not None:
            future.result()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.drain()


class TorchSaver(Saver):
    key = "torch"
    label = "torch.save"

    def save(self, step: int) -> None:
        import torch

        t0 = time.perf_counter()
        state = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        with open(self.work / f"step-{step}.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.work)
        seconds = time.perf_counter() - t0
        self.save_seconds.append(seconds)
        self.durable_seconds.append(seconds)


def _savers() -> list[Saver]:
    savers: list[Saver] = [Saver(), CryosnapSaver(lazy=False), CryosnapSaver(lazy=True)]
    savers.append(TorchSaver())
    if _dcp_available():
        savers.append(DcpSaver())
    return savers


def _run_training(
    config: BenchConfig,
    root: Path,
    command: str,
    progress: ProgressFn | None,
    ctrl_c: _CtrlC,
) -> BenchResult:
    import torch

    width = mlp_width(config.state_bytes)
    model, opt = _make_model(width)
    batch = _tune_batch(model, opt, width, config.step_seconds)  # also creates Adam's moments
    generator = torch.Generator().manual_seed(_SEED)
    data = (
        torch.randn(batch, width, generator=generator),
        torch.randn(batch, width, generator=generator),
    )
    nbytes = _training_state_bytes(model, opt)
    params = sum(int(p.numel()) for p in model.parameters())
    title = (
        f"MLP {_MLP_LAYERS} x Linear({width}, {width}) with Adam, {params / 1e6:.1f} M "
        f"parameters, {human_bytes(nbytes)} of parameters and moments"
    )
    leaves = len(list(model.parameters())) + sum(
        isinstance(v, torch.Tensor) for st in opt.state.values() for v in st.values()
    )
    result = _new_result(config, command, nbytes, leaves, title)
    result.memory_method = "not measured in the training workload"
    result.cold = "not measured in the training workload"
    savers = _savers()
    if not _dcp_available():
        result.missing["dcp_async"] = "torch.distributed is not available in this torch build"
    result.training_setup = {
        "width": width,
        "layers": _MLP_LAYERS,
        "params": params,
        "batch": batch,
        "steps": config.steps,
        "every": list(_TRAIN_EVERY),
        "torch_threads": torch.get_num_threads(),
    }
    figures = {
        (s.key, every): TrainingFigures(s.key, s.label, every)
        for every in _TRAIN_EVERY
        for s in savers
    }
    result.training = list(figures.values())
    clock = _Clock(config.repeat * len(_TRAIN_EVERY) * len(savers), progress)
    for r in range(config.repeat):
        for every in _TRAIN_EVERY:
            # Each interval's group has its own baseline runs beside it in time, and the order
            # is reversed every other round: the load of a shared machine drifts within minutes.
            group = savers if r % 2 == 0 else savers[::-1]
            for saver in group:
                fig = figures[(saver.key, every)]
                if fig.error is None:
                    work = root / f"{saver.key}-{every}-{r}"
                    try:
                        _train_run(model, opt, data, work, saver, every, config.steps, fig)
                    except Exception as exc:
                        fig.error = ctrl_c.failure(exc)
                        result.notes.append(f"{saver.label}, every {every}: failed: {fig.error}")
                clock.tick(f"round {r + 1}/{config.repeat}: {saver.label}, every {every}")
    result.notes.append(
        "save call: mean time in the save call (DCP: including the wait for the previous "
        "Future; cryosnap: including the wait for a previous version still in flight); "
        "durable: save call until on disk (median); written/save: bytes of new files per save "
        "(median over rounds); cryosnap runs with its defaults (incremental)"
    )
    result.notes += [f"{key}: not measured ({why})" for key, why in result.missing.items()]
    result.elapsed_seconds = clock.elapsed
    return result


def _train_run(
    model: Any,
    opt: Any,
    data: tuple[Any, Any],
    work: Path,
    saver: Saver,
    every: int,
    steps: int,
    fig: TrainingFigures,
) -> None:
    """``steps`` timed train steps with a checkpoint after steps 1, 1 + every, ..."""
    x, y = data
    work.mkdir()
    saver.open(work, model, opt)
    try:
        _train_step(model, opt, x, y)  # one untimed step: caches warm after the previous run
        if saver.key != "none":
            saver.save(0)  # one untimed, drained save: staging allocated, imports warm
            saver.drain()
            saver.save_seconds.clear()
            saver.durable_seconds.clear()
        gc.collect()
        settle_disk()
        before = file_sizes(work)
        times, saves = [], 0
        cpu0 = time.process_time()
        for k in range(1, steps + 1):
            t0 = time.perf_counter()
            _train_step(model, opt, x, y)
            if saver.key != "none" and (k - 1) % every == 0:
                saver.save(k)
                saves += 1
            times.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        t0 = time.perf_counter()
        saver.drain()
        drain = time.perf_counter() - t0
        fig.step_seconds += times
        fig.save_call_seconds += saver.save_seconds
        fig.durable_seconds += saver.durable_seconds
        fig.drain_seconds.append(drain)
        fig.cpu_seconds_per_step.append(cpu / steps)
        fig.saves += saves
        if saves:
            fig.written_bytes.append(written_between(before, file_sizes(work)) / saves)
    finally:
        saver.close()
        shutil.rmtree(work, ignore_errors=True)
        settle_disk()


# -------------------------------------------------------------------------------------- plot


def check_plot_available() -> None:
    """Raise :class:`MissingDependencyError` when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        raise MissingDependencyError("--plot needs matplotlib (pip install cryosnap[demo])")


def plot(result: BenchResult, out: str | Path) -> None:
    """A bar chart of ``result`` to ``out`` (any format matplotlib writes, by its extension)."""
    check_plot_available()
    from matplotlib.figure import Figure

    if result.config.workload == "training":
        fig = _plot_training(Figure(figsize=(8.0, 4.5), layout="constrained"), result)
    else:
        fig = _plot_save_load(Figure(figsize=(11.0, 5.5), layout="constrained"), result)
    fig.savefig(out)


def _plot_save_load(fig: Any, result: BenchResult) -> Any:
    panels = [
        ("stall_seconds", "stall (s)", "memcpy_seconds", "memcpy"),
        ("durable_seconds", "time to durable (s)", "write_fsync_seconds", "raw write+fsync"),
        ("restore_seconds", "restore (s), fresh load", "read_warm_seconds", "raw readinto"),
        ("restore_into_seconds", "restore into (s)", "read_warm_seconds", "raw readinto"),
    ]
    axes = fig.subplots(1, len(panels), sharey=True)
    peers = [p for p in result.peers if p.error is None and not p.limit]
    labels = [p.label for p in peers]
    positions = list(range(len(peers)))
    limits = result.limits
    for ax, (metric, title, limit_key, limit_label) in zip(axes, panels, strict=True):
        values = [p.median(metric) for p in peers]
        colors = ["tab:blue" if p.key.startswith("cryosnap") else "tab:gray" for p in peers]
        ax.barh(positions, [0 if math.isnan(v) else v for v in values], color=colors)
        limit = limits[limit_key]
        if not math.isnan(limit):
            ax.axvline(limit, ls="--", c="black", lw=1, label=f"limit: {limit_label}")
            ax.legend(loc="lower right", fontsize="small")
        ax.set_title(title, fontsize="medium")
        ax.set_yticks(positions, labels, fontsize="small")
        ax.invert_yaxis()
    fig.suptitle(f"cryosnap bench {result.config.workload} ({result.date})\n{result.title}")
    return fig


def _plot_training(fig: Any, result: BenchResult) -> Any:
    ax = fig.subplots()
    methods = [f for f in result.training if f.key != "none"]
    keys = list(dict.fromkeys(f.key for f in methods))
    width = 0.8 / max(1, len(_TRAIN_EVERY))
    for j, every in enumerate(_TRAIN_EVERY):
        values = []
        for key in keys:
            match = next((f for f in methods if f.key == key and f.every == every), None)
            overhead = float("nan") if match is None else result.overhead_percent(match)
            values.append(0.0 if math.isnan(overhead) else overhead)
        ax.bar([i + j * width for i in range(len(keys))], values, width, label=f"every {every}")
    labels = [next(f.label for f in methods if f.key == key) for key in keys]
    ax.set_xticks([i + width * (len(_TRAIN_EVERY) - 1) / 2 for i in range(len(keys))], labels)
    ax.tick_params(axis="x", labelsize="small", labelrotation=15)
    ax.axhline(0, c="black", lw=0.8)
    ax.set_ylabel("training-step overhead vs no checkpoint (%)")
    ax.legend()
    ax.set_title(f"cryosnap bench training ({result.date})\n{result.title}", fontsize="medium")
    return fig
