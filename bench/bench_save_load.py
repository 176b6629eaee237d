"""Side-by-side save/load benchmark: cryosnap against its peers on the same state, in one process.

Peers, each given the same in-memory state dict and its own fresh directory per repetition:

- raw write+fsync: every tensor's bytes into one file, then fsync; read back with readinto into
  preallocated buffers. No format at all: the limit for this disk.
- torch.save + fsync of the file; torch.load(weights_only=True).
- safetensors save_file + fsync of the file; load_file with the eager pread backend.
- torch.distributed.checkpoint save (one process, no process group; FileSystemWriter with
  sync_files=True fsyncs data and metadata); load into a preallocated state.
- cryosnap.save (durable on return); cryosnap.load.

After an untimed warm-up round, repetitions go round-robin over the peers (the starting peer
rotates) so that the drift of a shared, noisy machine is spread over all of them, and the file
systems are synced (untimed) after each peer's files are removed; the table reports medians.
Loads are warm-cache: the page cache cannot be dropped here, so each peer's files are read once
after its save and before its timed load, which makes every peer equally warm. Peak load memory
is measured in a fresh child process per loader. Checks from the issue are printed, never
asserted.

Run: ``.venv/bin/python bench/bench_save_load.py --state all`` (see bench/README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

import _harness as h

REPO_ROOT = Path(__file__).resolve().parent.parent
StateDict = dict[str, torch.Tensor]

_SEED = 20240611
_MB = 10**6


# ----------------------------------------------------------------------------------- cryosnap


def import_cryosnap() -> tuple[ModuleType | None, str]:
    """cryosnap when it is importable and exports save/load, else None and the reason why.

    Falls back to the checkout's src/ so the benchmark also runs where the package is not
    installed into the interpreter.
    """
    reason = ""
    for attempt in range(2):
        try:
            import cryosnap
        except ImportError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            source_dir = str(REPO_ROOT / "src")
            if attempt == 0 and source_dir not in sys.path:
                sys.path.insert(0, source_dir)
                continue
            return None, reason
        missing = [name for name in ("save", "load") if not hasattr(cryosnap, name)]
        if missing:
            return None, f"cryosnap ({cryosnap.__path__}) does not export {', '.join(missing)}"
        return cryosnap, ""
    return None, reason


# -------------------------------------------------------------------------------------- states


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A named, deterministic state dict: (name, shape) of every fp32 tensor, in order."""

    key: str
    title: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def state_bytes(self) -> int:
        return sum(_numel(shape) * 4 for _, shape in self.shapes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def _scaled(shape: tuple[int, ...], size_scale: float) -> tuple[int, ...]:
    """Shrink the leading dimension of a matrix; vectors (norms, biases) keep their size."""
    if len(shape) < 2 or size_scale == 1.0:
        return shape
    return (max(1, round(shape[0] * size_scale)), *shape[1:])


def _title(full_size_title: str, size_scale: float) -> str:
    return full_size_title if size_scale == 1.0 else f"{full_size_title}, scaled by {size_scale}"


def state_a_spec(size_scale: float) -> StateSpec:
    """(a) 1 GiB of fp32 in 16 tensors of 64 MiB."""
    shapes = tuple((f"blocks.{i}.weight", _scaled((4096, 4096), size_scale)) for i in range(16))
    return StateSpec("a", _title("1 GiB fp32 in 16 tensors", size_scale), shapes)


def state_b_spec(size_scale: float) -> StateSpec:
    """(b) ~300 MB in ~20,000 tensors: a deep, narrow transformer-like state dict.

    1000 layers of 20 tensors each (hidden 64, MLP 256): many small biases, norms and rotary
    buffers, mid-sized projection matrices; plus two large vocabulary matrices (65536 x 64).
    """
    hidden, mlp, layers, vocab = 64, 256, 1000, 65536
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
    shapes.append(("model.norm.weight", (hidden,)))
    shapes.append(("model.norm.bias", (hidden,)))
    shapes.append(("lm_head.weight", (vocab, hidden)))
    scaled = tuple((name, _scaled(shape, size_scale)) for name, shape in shapes)
    return StateSpec("b", _title("~300 MB in ~20,000 tensors", size_scale), scaled)


def build_state(spec: StateSpec) -> StateDict:
    """Random normal tensors from a fixed seed: incompressible, and no two chunks alike, so no
    peer gains from de-duplication that a real state would not offer."""
    generator = torch.Generator().manual_seed(_SEED)
    return {
        name: torch.randn(shape, generator=generator, dtype=torch.float32)
        for name, shape in spec.shapes
    }


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy (writable when the tensor is)."""
    if not tensor.is_contiguous():
        raise ValueError("raw I/O needs contiguous tensors")
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def first_mismatch(expected: StateDict, loaded: object) -> str | None:
    """None when ``loaded`` is a mapping equal to ``expected`` leaf by leaf, else what differs."""
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


# --------------------------------------------------------------------------------------- peers


class Peer(Protocol):
    """One way to save and load a state dict, timed as a whole."""

    key: str
    label: str

    def prepare(self, state: StateDict) -> None:
        """Untimed, once per state: allocate and touch what load fills in place."""

    def save(self, path: Path, state: StateDict) -> None:
        """Write ``state`` under ``path`` (which does not exist yet), durable on return."""

    def load(self, path: Path) -> object:
        """Read back what ``save`` wrote under ``path``."""

    def release(self) -> None:
        """Drop what ``prepare`` allocated."""


def _preallocate(state: StateDict) -> StateDict:
    # zero_() touches every page now, so no timed load pays first-touch page faults for it.
    return {name: torch.empty_like(tensor).zero_() for name, tensor in state.items()}


class RawPeer:
    """Every tensor's bytes, back to back, in one file: no format, the limit of the disk."""

    key = "raw"
    label = "raw write+fsync / readinto"
    _file_name = "raw.bin"

    def __init__(self) -> None:
        self._into: StateDict = {}

    def prepare(self, state: StateDict) -> None:
        self._into = _preallocate(state)

    def save(self, path: Path, state: StateDict) -> None:
        path.mkdir()
        with open(path / self._file_name, "wb", buffering=0) as f:
            for tensor in state.values():
                view = _byte_view(tensor)
                while view:  # a raw write may be short
                    view = view[f.write(view) :]
            os.fsync(f.fileno())

    def load(self, path: Path) -> object:
        with open(path / self._file_name, "rb", buffering=0) as f:
            for tensor in self._into.values():
                view = _byte_view(tensor)
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise EOFError(f"{path / self._file_name} is shorter than the state")
                    view = view[n:]
        return self._into

    def release(self) -> None:
        self._into = {}


class TorchSavePeer:
    key = "torch"
    label = "torch.save+fsync / torch.load"
    _file_name = "state.pt"

    def prepare(self, state: StateDict) -> None:
        pass

    def save(self, path: Path, state: StateDict) -> None:
        path.mkdir()
        with open(path / self._file_name, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def load(self, path: Path) -> object:
        return torch.load(path / self._file_name, weights_only=True)

    def release(self) -> None:
        pass


class SafetensorsPeer:
    key = "safetensors"
    label = "safetensors save_file+fsync / load_file(pread)"
    _file_name = "state.safetensors"

    def prepare(self, state: StateDict) -> None:
        pass

    def save(self, path: Path, state: StateDict) -> None:
        from safetensors.torch import save_file

        path.mkdir()
        save_file(state, path / self._file_name)
        h.fsync_path(path / self._file_name)

    def load(self, path: Path) -> object:
        from safetensors.torch import load_file

        # pread reads every byte now, as torch.load and cryosnap.load do; the default mmap
        # backend returns lazily mapped tensors that have read nothing yet, so its seconds would
        # time no I/O at all and move the cost to the first use of each tensor.
        return load_file(path / self._file_name, backend="pread")

    def release(self) -> None:
        pass


class DcpPeer:
    key = "dcp"
    label = "torch DCP save / load into preallocated"

    def __init__(self) -> None:
        self._into: StateDict = {}

    def prepare(self, state: StateDict) -> None:
        self._into = _preallocate(state)

    def save(self, path: Path, state: StateDict) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        # Explicit about what the default writer already does: fsync data files and metadata.
        writer = FileSystemWriter(path, sync_files=True)
        save(state, checkpoint_id=path, storage_writer=writer)

    def load(self, path: Path) -> object:
        from torch.distributed.checkpoint.state_dict_loader import load

        load(self._into, checkpoint_id=path)
        return self._into

    def release(self) -> None:
        self._into = {}


class CryosnapPeer:
    key = "cryosnap"
    label = "cryosnap save / load"

    def __init__(self, module: ModuleType) -> None:
        self._cryosnap = module

    def prepare(self, state: StateDict) -> None:
        pass

    def save(self, path: Path, state: StateDict) -> None:
        self._cryosnap.save(path, state, step=0)

    def load(self, path: Path) -> object:
        loaded: object = self._cryosnap.load(path)
        return loaded

    def release(self) -> None:
        pass


def make_peers(cryosnap: ModuleType | None) -> list[Peer]:
    peers: list[Peer] = [RawPeer(), TorchSavePeer(), SafetensorsPeer(), DcpPeer()]
    if cryosnap is not None:
        peers.append(CryosnapPeer(cryosnap))
    return peers


# ------------------------------------------------------------------------------------- running


@dataclass(slots=True)
class PeerResult:
    key: str
    label: str
    save_seconds: list[float] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)
    disk_bytes: int | None = None
    error: str | None = None

    @property
    def save_median(self) -> float:
        return h.median(self.save_seconds)

    @property
    def load_median(self) -> float:
        return h.median(self.load_seconds)


@dataclass(frozen=True, slots=True)
class LoadMemory:
    key: str
    label: str
    rss_before_bytes: int
    peak_delta_bytes: int
    loaded_bytes: int
    hwm_reset: bool


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    value: float | None
    limit: float
    unit: str  # "x" for a ratio, "bytes"

    @property
    def passed(self) -> bool | None:
        return None if self.value is None else self.value <= self.limit


@dataclass(slots=True)
class StateResult:
    key: str
    title: str
    tensors: int
    state_bytes: int
    peers: list[PeerResult]
    load_memory: list[LoadMemory]
    checks: list[Check]
    notes: list[str]


def time_peers(
    spec: StateSpec,
    state: StateDict,
    peers: Sequence[Peer],
    *,
    repeat: int,
    warmup: int,
    root: Path,
) -> list[PeerResult]:
    """Time every peer ``repeat`` times after ``warmup`` untimed rounds, round robin.

    The first round (warm-up or not) also checks each peer's round trip leaf by leaf.
    """
    results = {peer.key: PeerResult(peer.key, peer.label) for peer in peers}
    for peer in peers:
        peer.prepare(state)
    try:
        for round_index in range(warmup + repeat):
            start = round_index % len(peers)
            for peer in [*peers[start:], *peers[:start]]:
                result = results[peer.key]
                if result.error is not None:
                    continue
                path = root / f"{spec.key}-{peer.key}-{round_index}"
                try:
                    seconds = _save_and_load(peer, state, path, verify=round_index == 0)
                    result.disk_bytes = h.tree_bytes(path)
                except Exception as exc:
                    result.error = f"{type(exc).__name__}: {exc}"
                    print(f"  ! {peer.label} failed on state {spec.key}:", file=sys.stderr)
                    traceback.print_exc(file=sys.stderr)
                    continue
                finally:
                    shutil.rmtree(path, ignore_errors=True)
                    h.settle_disk()
                if round_index >= warmup:
                    result.save_seconds.append(seconds[0])
                    result.load_seconds.append(seconds[1])
            _print_round(results.values(), round_index, warmup=warmup, repeat=repeat)
    finally:
        for peer in peers:
            peer.release()
    return [results[peer.key] for peer in peers]


def _print_round(
    results: Iterable[PeerResult], round_index: int, *, warmup: int, repeat: int
) -> None:
    if round_index < warmup:
        print(f"  warm-up round {round_index + 1}/{warmup} done (untimed)", flush=True)
        return
    rep = round_index - warmup + 1
    done = ", ".join(
        f"{r.key} {r.save_seconds[-1]:.2f}/{r.load_seconds[-1]:.2f}s"
        for r in results
        if r.error is None and len(r.load_seconds) == rep
    )
    print(f"  rep {rep}/{repeat} (save/load): {done}", flush=True)


def _save_and_load(
    peer: Peer, state: StateDict, path: Path, *, verify: bool
) -> tuple[float, float]:
    """(save seconds, load seconds) of one round trip through ``path``."""
    save_seconds, _ = h.timed(lambda: peer.save(path, state))
    h.warm_page_cache(path)
    load_seconds, loaded = h.timed(lambda: peer.load(path))
    if verify:
        mismatch = first_mismatch(state, loaded)
        if mismatch is not None:
            raise ValueError(f"round trip differs: {mismatch}")
    del loaded
    return save_seconds, load_seconds


def measure_load_memory(
    spec: StateSpec, state: StateDict, peers: Sequence[Peer], *, root: Path
) -> list[LoadMemory]:
    """Peak RSS of each loader that allocates its result, each in a fresh child process."""
    measured = []
    for peer in peers:
        if peer.key not in _CHILD_LOADERS:
            continue
        path = root / f"{spec.key}-{peer.key}-rss"
        try:
            peer.save(path, state)
            h.warm_page_cache(path)
            child = h.run_peak_rss_child(
                [str(Path(__file__).resolve()), "--child-peak-rss", peer.key, str(path)]
            )
        except Exception:
            print(f"  ! peak RSS of {peer.label} failed on state {spec.key}:", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            continue
        finally:
            shutil.rmtree(path, ignore_errors=True)
            h.settle_disk()
        measured.append(
            LoadMemory(
                key=peer.key,
                label=peer.label,
                rss_before_bytes=child.rss_before_bytes,
                peak_delta_bytes=child.peak_delta_bytes,
                loaded_bytes=child.loaded_bytes,
                hwm_reset=child.hwm_reset,
            )
        )
    return measured


def _child_load_torch(path: Path) -> object:
    return TorchSavePeer().load(path)


def _child_load_cryosnap(path: Path) -> object:
    module, reason = import_cryosnap()
    if module is None:
        raise ImportError(reason)
    return CryosnapPeer(module).load(path)


_CHILD_LOADERS: dict[str, Callable[[Path], object]] = {
    "torch": _child_load_torch,
    "cryosnap": _child_load_cryosnap,
}


def child_peak_rss(peer_key: str, path: Path) -> None:
    """In the child: load once and print the PeakRss fields as JSON on the last line."""
    loader = _CHILD_LOADERS[peer_key]
    if peer_key == "cryosnap":
        import_cryosnap()  # its import cost belongs before the baseline, like torch's
    rss_before = h.current_rss_bytes()
    hwm_reset = h.reset_peak_rss()
    loaded = loader(path)
    peak = h.peak_rss_bytes()
    values = loaded.values() if isinstance(loaded, Mapping) else []
    loaded_bytes = sum(t.nbytes for t in values if isinstance(t, torch.Tensor))
    record = h.PeakRss(rss_before, peak, loaded_bytes, hwm_reset)
    print(json.dumps(dataclasses.asdict(record)))


# -------------------------------------------------------------------------------------- checks


def _ratio(results: Mapping[str, PeerResult], a: str, b: str, which: str) -> float | None:
    ra, rb = results.get(a), results.get(b)
    if ra is None or rb is None or ra.error or rb.error:
        return None
    if which == "save":
        return ra.save_median / rb.save_median
    return ra.load_median / rb.load_median


def make_checks(
    key: str, state_bytes: int, peers: Sequence[PeerResult], memory: Sequence[LoadMemory]
) -> list[Check]:
    by_key = {r.key: r for r in peers}
    if key == "a":
        cs_memory = next((m for m in memory if m.key == "cryosnap"), None)
        return [
            Check(
                "cryosnap save <= 1.15 x raw write+fsync",
                _ratio(by_key, "cryosnap", "raw", "save"),
                1.15,
                "x",
            ),
            Check(
                "cryosnap save <= torch.save+fsync",
                _ratio(by_key, "cryosnap", "torch", "save"),
                1.0,
                "x",
            ),
            Check(
                "cryosnap load <= torch.load",
                _ratio(by_key, "cryosnap", "torch", "load"),
                1.0,
                "x",
            ),
            Check(
                "cryosnap peak load RSS <= 1.1 x state + 150 MB",
                None if cs_memory is None else float(cs_memory.peak_delta_bytes),
                1.1 * state_bytes + 150 * _MB,
                "bytes",
            ),
        ]
    return [
        Check(
            "cryosnap save <= 1.5 x torch.save+fsync",
            _ratio(by_key, "cryosnap", "torch", "save"),
            1.5,
            "x",
        ),
        Check(
            "cryosnap load <= 1.5 x torch.load",
            _ratio(by_key, "cryosnap", "torch", "load"),
            1.5,
            "x",
        ),
    ]


# ------------------------------------------------------------------------------------ printing


def _seconds(value: float) -> str:
    return "-" if value != value else f"{value:.3f}"  # NaN: no sample


def _times(value: float, reference: float) -> str:
    if value != value or reference != reference or reference == 0:
        return "-"
    return f"{value / reference:.2f}x"


def render_state(result: StateResult, *, repeat: int) -> str:
    cs = next((r for r in result.peers if r.key == "cryosnap" and r.error is None), None)
    cs_save = cs.save_median if cs else float("nan")
    cs_load = cs.load_median if cs else float("nan")
    rows = []
    for r in result.peers:
        if r.error is not None:
            rows.append([r.label, "error", "error", "-", "-", "-"])
            continue
        rows.append(
            [
                r.label,
                _seconds(r.save_median),
                _seconds(r.load_median),
                _times(r.save_median, cs_save),
                _times(r.load_median, cs_load),
                "-" if r.disk_bytes is None else h.format_bytes(r.disk_bytes),
            ]
        )
    headers = ["peer", "save s", "load s", "save/cryosnap", "load/cryosnap", "on disk"]
    lines = [
        "",
        f"== state {result.key}: {result.title}: {result.tensors:,} tensors, "
        f"{h.format_bytes(result.state_bytes)} ({result.state_bytes / _MB:,.1f} MB) ==",
        f"median of {repeat}; x/cryosnap = peer seconds / cryosnap seconds "
        "(above 1: cryosnap is faster); loads warm-cache",
        h.format_table(headers, rows),
    ]
    lines += [f"  {r.label}: {r.error}" for r in result.peers if r.error is not None]
    lines += [f"  note: {note}" for note in result.notes]

    if result.load_memory:
        lines += ["", "peak load memory (fresh child process; peak RSS - RSS before the load):"]
        mem_rows = [
            [
                m.label,
                h.format_bytes(m.peak_delta_bytes),
                f"{m.peak_delta_bytes / result.state_bytes:.3f}",
            ]
            for m in result.load_memory
        ]
        lines.append(h.format_table(["loader", "peak load RSS", "/ state bytes"], mem_rows))
        if not all(m.hwm_reset for m in result.load_memory):
            lines.append("  note: could not reset VmHWM; peaks include the child's imports")

    lines += ["", "checks:"]
    for check in result.checks:
        verdict = {None: "SKIP", True: "PASS", False: "FAIL"}[check.passed]
        if check.value is None:
            shown = "no figure (cryosnap not measured)"
        elif check.unit == "x":
            shown = f"{check.value:.2f}x (limit {check.limit:.2f}x)"
        else:
            shown = (
                f"{h.format_bytes(check.value)} (limit {h.format_bytes(check.limit)}, "
                f"{check.value / result.state_bytes:.3f} x state)"
            )
        lines.append(f"  [{verdict}] {check.name}: {shown}")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    import numpy

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import safetensors

        info["safetensors"] = safetensors.__version__
    except ImportError:
        info["safetensors"] = None
    return info


# ---------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Save/load seconds of cryosnap against raw I/O, torch.save, safetensors "
        "and torch.distributed.checkpoint on the same state, with ratios.",
    )
    parser.add_argument(
        "--state",
        choices=("a", "b", "all"),
        default="all",
        help="a: 1 GiB in 16 tensors; b: ~300 MB in ~20,000 tensors",
    )
    parser.add_argument("--repeat", type=int, default=3, help="repetitions; the median is shown")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds of every peer before the timed ones (default 1)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to write (a temporary folder is made inside and removed at "
        "the end; default: the system temp dir)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument(
        "--size-scale",
        type=float,
        default=1.0,
        help="shrink every matrix by this factor for a quick smoke run (e.g. "
        "0.05); the tensor count stays",
    )
    parser.add_argument(
        "--child-peak-rss", nargs=2, metavar=("LOADER", "PATH"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    if not 0.0 < args.size_scale <= 1.0:
        parser.error(f"--size-scale must be in (0, 1], got {args.size_scale}")
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not an existing directory")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # DCP warns on every call that it runs without a process group, which is what we mean.
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
    if args.child_peak_rss:
        loader, path = args.child_peak_rss
        child_peak_rss(loader, Path(path))
        return 0

    cryosnap, why_not = import_cryosnap()
    peers = make_peers(cryosnap)
    env = environment()
    env["cryosnap"] = (
        f"{getattr(cryosnap, '__version__', '?')} from {Path(cryosnap.__file__ or '?').parent}"
        if cryosnap is not None
        else None
    )
    print(f"environment: {json.dumps(env)}")
    if cryosnap is None:
        print(f"cryosnap not importable ({why_not}): its rows and checks are skipped")
    print(
        "loads are warm-cache: the page cache cannot be dropped here, so every peer's files are "
        "read once after its save and before its timed load"
    )
    if args.size_scale != 1.0:
        print(f"size scale {args.size_scale}: a smoke run; the checks are meant for scale 1")

    keys = ["a", "b"] if args.state == "all" else [args.state]
    spec_of = {"a": state_a_spec, "b": state_b_spec}
    root = Path(tempfile.mkdtemp(prefix="cryosnap-bench-", dir=args.dir))
    print(f"writing under {root}")
    results: list[StateResult] = []
    try:
        for key in keys:
            spec = spec_of[key](args.size_scale)
            print(f"\nbuilding state {key}: {spec.title} ...", flush=True)
            load_before = os.getloadavg()[0]
            state = build_state(spec)
            peer_results = time_peers(
                spec, state, peers, repeat=args.repeat, warmup=args.warmup, root=root
            )
            memory = measure_load_memory(spec, state, peers, root=root)
            del state
            # Other processes on a 2-core machine show up in every figure: say how busy it was.
            notes = [
                f"1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after "
                f"({os.cpu_count()} CPUs)"
            ]
            if cryosnap is None:
                notes.append(f"cryosnap not importable ({why_not})")
            result = StateResult(
                key=key,
                title=spec.title,
                tensors=len(spec.shapes),
                state_bytes=spec.state_bytes,
                peers=peer_results,
                load_memory=memory,
                checks=make_checks(key, spec.state_bytes, peer_results, memory),
                notes=notes,
            )
            results.append(result)
            print(render_state(result, repeat=args.repeat), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    if args.json is not None:
        document = {
            "environment": env,
            "args": {
                "state": args.state,
                "repeat": args.repeat,
                "warmup": args.warmup,
                "size_scale": args.size_scale,
            },
            "warm_cache": True,
            "states": [_state_json(r) for r in results],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


def _state_json(result: StateResult) -> dict[str, Any]:
    document = dataclasses.asdict(result)
    for peer, raw in zip(result.peers, document["peers"], strict=True):
        raw["save_median_seconds"] = None if peer.error else peer.save_median
        raw["load_median_seconds"] = None if peer.error else peer.load_median
    for check, raw in zip(result.checks, document["checks"], strict=True):
        raw["passed"] = check.passed
    return document


if __name__ == "__main__":
    sys.exit(main())
