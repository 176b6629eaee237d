"""Multi-level checkpoints: a fast scratch tier in front of a slow persistent one, and how a
version's data is split across two scratch devices. Every configuration is measured in the same
run, interleaved, medians reported.

Part 1, stall with a slow persistent tier. A training-like loop (a "compute" phase of busy numpy
matmuls between saves, an eager ``save`` every ``--every`` iterations) over a float32 state of
``--state-mib`` (default 256 MiB in 8 tensors; one row of each tensor changes per iteration, and
``incremental=False`` makes every version write every byte) runs with:

- local: ``Checkpointer(dir, incremental=False, keep=2)``, no scratch tier (the baseline);
- tiered: ``Checkpointer(FaultyStore(LocalStore(dir), bytes_per_second=100e6), scratch=dir2,
  incremental=False, keep=2)``: a 100 MB/s persistent tier behind a scratch directory on the same
  file system as the baseline's, flushed in the background.

Segments alternate local, tiered, local, tiered, ... (``--segments``), each with a fresh
Checkpointer, one untimed drained warm-up save (the staging pool exists afterwards: the steady
state) and ``--saves`` timed saves. The stall is the wall time of the ``save`` call
(``SaveInfo.stall_seconds`` beside it); the target is tiered <= 1.1x local on the medians. Also
shown: time until durable on scratch (``result(tier="scratch").seconds``) and until persistent
(``result().seconds``), both from the ``save`` call.

Part 2, adaptive placement across two scratch devices: ``scratch=[Tier(FaultyStore(LocalStore(d0),
bytes_per_second=400e6)), Tier(FaultyStore(LocalStore(d1), bytes_per_second=100e6))]`` (d0, d1 on
tmpfs so that the throttle, not a shared disk, sets each device's speed), the persistent tier a
plain local directory. Each device's speed alone is measured first (``--probe-mib`` written
through the same FaultyStore writer in 8 MiB calls, then commit with fsync; the throttle makes
the rate independent of the call size); the optimum time for a version is
``new bytes / (r0 + r1)`` (shares proportional to the speeds, both devices finishing together).
Three Checkpointers, one per ``Placement``
strategy (``adaptive``, ``fastest``, ``round_robin``, set through the internal
``ckpt._placement`` hook right after opening), save the same ``--tier-state-mib`` state (default
512 MiB, ``incremental=False``) as ``--versions`` versions, round-robin over the strategies with
the first one rotating. Before each timed save every earlier version is persistent (the flush of
the previous version does not overlap the measurement) and ``os.sync()`` has run. The time to
scratch-durable is ``result(tier="scratch").seconds`` (from the ``save`` call, capture
included); the first version of each Checkpointer (the model learns the throughputs from it) is
shown apart, the medians are over the later ones. Targets: adaptive <= 1.2x optimum, adaptive
faster than fastest-only and than round robin.

Checks are printed as PASS / FAIL / SKIP, never asserted.

Run: ``.venv/bin/python bench/bench_tiers.py`` (about 3 minutes; ``--quick``: under 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

import _harness as h

State = dict[str, np.ndarray]

_SEED = 20240705
_MIB = 1 << 20
_MB = 10**6
_WRITE_CALL_BYTES = 8 << 20  # probe write size; the throttle sets the rate, not this
_STRATEGIES = ("adaptive", "fastest", "round_robin")


@dataclass(slots=True)
class Report:
    environment: dict[str, Any]
    args: dict[str, Any]
    stall: dict[str, Any] = field(default_factory=dict)
    placement: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)

    def write(self, path: Path | None) -> None:
        h.write_json(path, asdict(self))


_ms, _s = h.format_ms, h.format_s


# ----------------------------------------------------------------------------------- the state


def build_state(total_mib: int, tensors: int) -> State:
    """``tensors`` float32 arrays of 1024-float rows adding up to ``total_mib`` MiB, random."""
    rng = np.random.default_rng(_SEED)
    rows = max(total_mib * _MIB // (tensors * 4096), 1)
    return {f"t{i:02d}": rng.random((rows, 1024), dtype=np.float32) for i in range(tensors)}


def state_bytes(state: State) -> int:
    return sum(a.nbytes for a in state.values())


def mutate(state: State, step: int) -> None:
    """One row of every tensor changes, so that every version differs from the last."""
    for a in state.values():
        a[step % a.shape[0]] += 1.0


class Compute:
    """Busy numpy matmuls for a given wall time (every BLAS thread busy), or a sleep."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        rng = np.random.default_rng(_SEED + 1)
        self._a = rng.random((512, 512), dtype=np.float32)
        self._b = rng.random((512, 512), dtype=np.float32)

    def __call__(self, seconds: float) -> None:
        if self.kind == "sleep":
            time.sleep(seconds)
            return
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            np.matmul(self._a, self._b)


# ------------------------------------------------------------------- part 1: stall, slow tier


@dataclass(slots=True)
class Segment:
    config: str
    index: int
    calls: list[float]  # wall time of each save call
    stalls: list[float]  # SaveInfo.stall_seconds
    scratch: list[float]  # save call -> durable on the first tier
    durable: list[float]  # save call -> durable everywhere
    overlapped: int  # saves called while an earlier version was being flushed
    interval: float  # mean seconds between saves


def run_segment(
    cs: ModuleType,
    root: Path,
    persistent_root: Path,
    state: State,
    config: str,
    index: int,
    args: argparse.Namespace,
    compute: Compute,
) -> Segment:
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    directory = root / f"{config}-{index}"
    if config == "local":
        ckpt = cs.Checkpointer(directory / "run", incremental=False, keep=2)
    else:
        slow = FaultyStore(
            LocalStore(persistent_root / f"{config}-{index}"),
            bytes_per_second=args.persistent_mbps * _MB,
        )
        ckpt = cs.Checkpointer(
            slow, scratch=str(directory / "scratch"), incremental=False, keep=2, keep_scratch=2
        )
    pendings = []
    calls: list[float] = []
    try:
        mutate(state, 0)
        ckpt.save(0, state).result()  # warm-up: the staging pool, imports; drained, untimed
        os.sync()
        starts = []
        overlapped = 0
        for it in range(1, args.saves * args.every + 1):
            compute(args.compute_seconds)
            mutate(state, it)
            # A save after iterations every, 2 * every, ...: each has `every` compute phases
            # before the next one to overlap its background work (write, then flush).
            if it % args.every == 0:
                flusher = getattr(ckpt, "_flusher", None)
                overlapped += bool(flusher is not None and flusher.pending())
                t0 = time.perf_counter()
                pendings.append(ckpt.save(it, state))
                calls.append(time.perf_counter() - t0)
                starts.append(t0)
        # The first tier: scratch, or the local dir itself (a Checkpointer without scratch
        # has no tier of that name).
        first = [p.result(tier="scratch" if config == "tiered" else None) for p in pendings]
        full = [p.result() for p in pendings]
    finally:
        ckpt.close()
        h.rmtree(directory)
        h.rmtree(persistent_root / f"{config}-{index}")
        os.sync()
    interval = (starts[-1] - starts[0]) / (len(starts) - 1) if len(starts) > 1 else float("nan")
    return Segment(
        config,
        index,
        calls,
        [i.stall_seconds for i in full],
        [i.seconds for i in first],
        [i.seconds for i in full],
        overlapped,
        interval,
    )


def run_segments(
    cs: ModuleType,
    root: Path,
    persistent_root: Path,
    state: State,
    args: argparse.Namespace,
    compute: Compute,
) -> list[Segment]:
    """The segments, local and tiered alternated, each printed as it ends."""
    segments: list[Segment] = []
    t_start = time.perf_counter()
    for index in range(args.segments):
        config = ("local", "tiered")[index % 2]
        seg = run_segment(cs, root, persistent_root, state, config, index, args, compute)
        segments.append(seg)
        print(
            f"  segment {index + 1} {config:<6}: save call median {_ms(h.median(seg.calls))} "
            f"({', '.join(f'{c * 1e3:.1f}' for c in seg.calls)} ms), scratch-durable "
            f"{_s(h.median(seg.scratch))}, durable {_s(h.median(seg.durable))}"
            + (f", {seg.overlapped} with a flush in flight" if config == "tiered" else "")
            + f", interval {seg.interval:.2f} s ({time.perf_counter() - t_start:.0f} s)",
            flush=True,
        )
    return segments


def print_stall(
    segments: Sequence[Segment], args: argparse.Namespace, nbytes: int
) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """The table of part 1; returns the medians by (configuration, figure) and the minimum
    save call by configuration."""

    def pooled(config: str, name: str) -> list[float]:
        return [v for s in segments if s.config == config for v in getattr(s, name)]

    med = {
        (c, n): h.median(pooled(c, n))
        for c in ("local", "tiered")
        for n in ("calls", "stalls", "scratch", "durable")
    }
    low = {c: min(pooled(c, "calls")) for c in ("local", "tiered")}
    names = {
        "local": "local dir, no scratch (baseline)",
        "tiered": f"scratch dir + {args.persistent_mbps:g} MB/s persistent",
    }
    rows = [
        [
            names[c],
            _ms(med[(c, "calls")]),
            _ms(low[c]),
            _ms(med[(c, "stalls")]),
            f"{med[(c, 'calls')] / med[('local', 'calls')]:.2f}x",
            _s(med[(c, "scratch")]),
            "-" if c == "local" else _s(med[(c, "durable")]),
        ]
        for c in ("local", "tiered")
    ]
    headers = ["configuration", "save call", "min", "SaveInfo.stall", "x local"]
    print()
    print(h.format_table([*headers, "first tier", "persistent"], rows))
    overlapped = sum(s.overlapped for s in segments if s.config == "tiered")
    flushes = [
        d - f
        for seg in segments
        if seg.config == "tiered"
        for d, f in zip(seg.durable, seg.scratch, strict=True)
    ]
    n_tiered = len(pooled("tiered", "calls"))
    print(
        f"medians over {len(pooled('local', 'calls'))} / {n_tiered} saves (min: the fastest "
        "one); first tier: save call until durable on the local dir (baseline) or on scratch; "
        "persistent: save call until durable on the throttled tier (flushed behind scratch). "
        f"{overlapped} of {n_tiered} tiered saves were called while an earlier version was "
        f"being flushed; a flush took {_s(min(flushes))} - {_s(max(flushes))} (persistent- "
        f"minus scratch-durable; {nbytes / (args.persistent_mbps * _MB):.2f} s at the "
        f"throttle), the save interval {args.every * args.compute_seconds:g} s"
    )
    return med, low


def measure_stall(
    cs: ModuleType, root: Path, shm: Path, args: argparse.Namespace, report: Report
) -> list[h.Check]:
    persistent_root = root if args.persistent_on == "disk" else shm
    state = build_state(args.state_mib, args.tensors)
    nbytes = state_bytes(state)
    compute = Compute(args.compute)
    print(
        f"\n== part 1: stall with a {args.persistent_mbps:g} MB/s persistent tier ==\n"
        f"state {h.format_bytes(nbytes)} in {len(state)} float32 tensors (incremental=False: "
        f"every version writes it all); {args.saves} timed saves per segment, one every "
        f"{args.every} iterations of {args.compute_seconds:g} s {args.compute} compute; "
        f"segments {', '.join(['local', 'tiered'] * (args.segments // 2))}; directories "
        f"under {root}. A flush of one version takes {nbytes / (args.persistent_mbps * _MB):.2f}"
        f" s at the throttle, a save interval {args.every * args.compute_seconds:g} s.",
        flush=True,
    )
    compute(0.2)  # warm BLAS threads
    load_before = h.load_average()
    segments = run_segments(cs, root, persistent_root, state, args, compute)
    load_after = h.load_average()
    med, low = print_stall(segments, args, nbytes)
    h.print_load(load_before, load_after)
    report.stall = {
        "state_bytes": nbytes,
        "segments": [asdict(s) for s in segments],
        "medians": {f"{c}/{n}": v for (c, n), v in med.items()},
        "load_average": [load_before, load_after],
    }
    base = med[("local", "calls")]
    ratio = med[("tiered", "calls")] / base
    ratio_info = med[("tiered", "stalls")] / med[("local", "stalls")]
    return [
        h.Check(
            f"stall with a {args.persistent_mbps:g} MB/s persistent tier <= 1.1x without",
            ratio <= 1.1,
            f"{ratio:.3f}x on medians ({_ms(med[('tiered', 'calls')])} vs {_ms(base)}; "
            f"SaveInfo.stall {ratio_info:.3f}x; min {low['tiered'] / low['local']:.3f}x)",
        )
    ]


# ------------------------------------------------------------- part 2: placement on 2 devices


def probe_device(path: Path, rate_mbps: float, nbytes: int, buffer: memoryview) -> float:
    """Bytes per second of writing ``nbytes`` through a throttled writer, fsync included."""
    from cryosnap.storage import LocalStore
    from cryosnap.testing import FaultyStore

    store = FaultyStore(LocalStore(path), bytes_per_second=rate_mbps * _MB)
    os.sync()
    t0 = time.perf_counter()
    writer = store.open_writer("data/probe.dat")
    offset = 0
    while offset < nbytes:
        n = min(_WRITE_CALL_BYTES, nbytes - offset)
        writer.write([buffer[:n]])
        offset += n
    writer.commit()
    seconds = time.perf_counter() - t0
    store.delete("data/probe.dat")
    return nbytes / seconds


@dataclass(slots=True)
class Version:
    strategy: str
    index: int  # 0: the first version of this Checkpointer
    seconds: float  # SaveInfo.seconds on scratch (from the save call)
    stall: float
    written: int
    per_device: list[int]


def open_tiered(cs: ModuleType, root: Path, shm: Path, strategy: str, rates: Sequence[float]):
    from cryosnap.storage import LocalStore
    from cryosnap.storage.striped import Placement
    from cryosnap.testing import FaultyStore

    tiers = [
        cs.Tier(FaultyStore(LocalStore(shm / strategy / f"dev{d}"), bytes_per_second=r * _MB))
        for d, r in enumerate(rates)
    ]
    ckpt = cs.Checkpointer(
        root / strategy / "persistent", scratch=tiers, incremental=False, keep=1, keep_scratch=1
    )
    ckpt._placement = Placement(ckpt.scratch, strategy=strategy)
    return ckpt


def split_of(cs: ModuleType, ckpt: Any, step: int) -> list[int]:
    from cryosnap.engine import read_commit
    from cryosnap.storage.striped import device_of

    store = ckpt.scratch
    out = [0] * len(store.devices)
    for key in read_commit(store, step).data_files:
        out[device_of(key, len(out))] += store.size(key)
    return out


def probe_devices(shm: Path, args: argparse.Namespace) -> tuple[list[float], list[list[float]]]:
    """Each device alone, alternating: the median rate (bytes/s) of each and every sample (the
    throttle is a ceiling; noise only slows)."""
    rates = [args.fast_mbps, args.slow_mbps]
    probe_bytes = args.probe_mib * _MIB
    buffer = memoryview(np.random.default_rng(_SEED + 2).bytes(min(probe_bytes, _WRITE_CALL_BYTES)))
    probes: list[list[float]] = [[], []]
    for _ in range(args.probe_repeat):
        for d, rate in enumerate(rates):
            probes[d].append(probe_device(shm / "probe" / f"dev{d}", rate, probe_bytes, buffer))
    h.rmtree(shm / "probe")
    alone = [h.median(p) for p in probes]
    for d in range(2):
        print(
            f"  device {d} alone ({rates[d]:g} MB/s throttle): {alone[d] / _MB:.1f} MB/s "
            f"(median of {', '.join(f'{r / _MB:.1f}' for r in probes[d])})",
            flush=True,
        )
    return alone, probes


def save_versions(
    cs: ModuleType, root: Path, shm: Path, state: State, args: argparse.Namespace
) -> tuple[list[Version], list[float | None]]:
    """Every version through every strategy, round-robin; returns them and the rates the
    adaptive model learned."""
    ckpts = {
        s: open_tiered(cs, root, shm, s, [args.fast_mbps, args.slow_mbps]) for s in _STRATEGIES
    }
    versions: list[Version] = []
    t_start = time.perf_counter()
    try:
        for v in range(args.versions):
            for s in _STRATEGIES[v % 3 :] + _STRATEGIES[: v % 3]:
                ckpt = ckpts[s]
                mutate(state, v)
                os.sync()
                info = ckpt.save(v, state).result(tier="scratch")
                ckpt.wait()  # flushed: the next timed save runs without a flush beside it
                split = split_of(cs, ckpt, v)
                versions.append(
                    Version(s, v, info.seconds, info.stall_seconds, info.written_bytes, split)
                )
            print(
                f"  version {v}: "
                + ", ".join(
                    f"{x.strategy} {_s(x.seconds)} (d0 {x.per_device[0] / x.written:.0%})"
                    for x in versions[-3:]
                )
                + f" ({time.perf_counter() - t_start:.0f} s)",
                flush=True,
            )
        learned: list[float | None] = ckpts["adaptive"]._placement.rates()
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
        for s in _STRATEGIES:
            h.rmtree(shm / s)
            h.rmtree(root / s)
    return versions, learned


def placement_rows(
    versions: Sequence[Version], alone: Sequence[float], optimum: float
) -> tuple[list[list[str]], dict[str, float]]:
    """A row per strategy (medians of the versions after the first) below the optimum's;
    returns them and the median scratch-durable seconds by strategy."""
    share_opt = alone[0] / (alone[0] + alone[1])
    rows = [["optimum: new bytes / (r0 + r1)", "-", _s(optimum), "1.00x", f"{share_opt:.0%}"]]
    rows[0] += [_s(optimum), "-"]
    med: dict[str, float] = {}
    for s in _STRATEGIES:
        later = [x for x in versions if x.strategy == s and x.index > 0]
        first = next(x for x in versions if x.strategy == s and x.index == 0)
        med[s] = h.median([x.seconds for x in later])
        capture = h.median([x.stall for x in later])
        share = h.median([x.per_device[0] / x.written for x in later])
        # The chosen split's own time: the busiest device's bytes at its speed alone.
        split = h.median(
            [max(b / r for b, r in zip(x.per_device, alone, strict=True)) for x in later]
        )
        rows.append(
            [
                s,
                _s(first.seconds),
                _s(med[s]),
                f"{med[s] / optimum:.2f}x",
                f"{share:.0%}",
                f"{_s(split)} ({split / optimum:.2f}x)",
                _s(med[s] - capture),
            ]
        )
    return rows, med


def measure_placement(
    cs: ModuleType, root: Path, shm: Path, args: argparse.Namespace, report: Report
) -> list[h.Check]:
    state = build_state(args.tier_state_mib, args.tensors)
    nbytes = state_bytes(state)
    print(
        f"\n== part 2: placement across two scratch devices ({args.fast_mbps:g} and "
        f"{args.slow_mbps:g} MB/s FaultyStore throttles on {shm}) ==\n"
        f"state {h.format_bytes(nbytes)} in {len(state)} float32 tensors, incremental=False; "
        f"{args.versions} versions per strategy, round-robin; persistent tier under {root} "
        "(flushed before the next timed save)",
        flush=True,
    )
    alone, probes = probe_devices(shm, args)
    load_before = h.load_average()
    versions, learned = save_versions(cs, root, shm, state, args)
    load_after = h.load_average()
    written = h.median([x.written for x in versions])
    optimum = written / (alone[0] + alone[1])
    rows, med = placement_rows(versions, alone, optimum)
    headers = ["strategy", "first version", "scratch-durable", "x optimum", "share on d0"]
    print()
    print(h.format_table([*headers, "split's device time", "after capture"], rows))
    print(
        f"new bytes per version {h.format_bytes(written)}; scratch-durable: SaveInfo.seconds "
        f"(save call until committed on scratch), median of versions 1..{args.versions - 1}; "
        "split's device time: max over devices of (bytes placed there / its speed alone), the "
        "placement's quality without the fixed costs of a save; "
        "after capture: the same minus the save call (the eager capture, which the optimum "
        "does not count; SaveInfo.seconds also includes scratch retention, which deletes the "
        "previous version after the commit); the first version also allocates the staging "
        "pool, and the adaptive model places all of it before its first write completes, so "
        "it is split evenly; model's learned rates (adaptive): "
        + ", ".join("-" if r is None else f"{r / _MB:.0f} MB/s" for r in learned)
    )
    h.print_load(load_before, load_after)
    report.placement = {
        "state_bytes": nbytes,
        "device_rates_alone": alone,
        "probes": probes,
        "optimum_seconds": optimum,
        "medians": med,
        "learned_rates": learned,
        "versions": [asdict(x) for x in versions],
        "load_average": [load_before, load_after],
    }
    ad = med["adaptive"]
    return [
        h.Check(
            "adaptive placement <= 1.2x the optimum split",
            ad <= 1.2 * optimum,
            f"{ad / optimum:.2f}x ({_s(ad)} vs {_s(optimum)})",
        ),
        h.Check(
            "adaptive faster than fastest-device-only",
            ad < med["fastest"],
            f"{_s(ad)} vs {_s(med['fastest'])} ({med['fastest'] / ad:.2f}x)",
        ),
        h.Check(
            "adaptive faster than round robin",
            ad < med["round_robin"],
            f"{_s(ad)} vs {_s(med['round_robin'])} ({med['round_robin'] / ad:.2f}x)",
        ),
    ]


# ----------------------------------------------------------------------------------------- main


def pick_shm(requested: Path | None, need_bytes: int) -> tuple[Path, str]:
    """Where the throttled scratch devices live: tmpfs when it has room, else the temp dir."""
    if requested is not None:
        return requested, "as given (--shm-dir)"
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        free = shutil.disk_usage(shm).free
        if free >= 2 * need_bytes:
            return shm, f"tmpfs, {h.format_bytes(free)} free"
        note = f"/dev/shm has only {h.format_bytes(free)} free"
    else:
        note = "no writable /dev/shm"
    return Path(tempfile.gettempdir()), f"FALLBACK to the temp dir ({note}): the disk may cap it"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Multi-level checkpoints: save stall with a slow persistent tier behind "
        "scratch, and adaptive placement across two scratch devices of different speeds.",
    )
    parser.add_argument("--part", choices=["stall", "placement", "all"], default="all")
    parser.add_argument("--quick", action="store_true", help="a version in under a minute")
    p1 = parser.add_argument_group("part 1 (stall)")
    p1.add_argument("--state-mib", type=int, default=None, help="state size (default 256)")
    p1.add_argument("--tensors", type=int, default=8, help="tensors in each state (8)")
    p1.add_argument("--saves", type=int, default=None, help="timed saves per segment (4)")
    p1.add_argument("--every", type=int, default=3, help="save every N iterations (3)")
    p1.add_argument(
        "--compute-seconds", type=float, default=None, help="compute per iteration (1.0)"
    )
    p1.add_argument("--compute", choices=["matmul", "sleep"], default="matmul")
    p1.add_argument("--segments", type=int, default=6, help="local/tiered segments (6)")
    p1.add_argument("--persistent-mbps", type=float, default=100.0, help="throttle (100 MB/s)")
    p1.add_argument(
        "--persistent-on",
        choices=["shm", "disk"],
        default="shm",
        help="where the throttled persistent directory lives (default: with the scratch "
        "devices of part 2, tmpfs: a remote tier whose speed is the throttle's)",
    )
    p2 = parser.add_argument_group("part 2 (placement)")
    p2.add_argument("--tier-state-mib", type=int, default=None, help="state size (512)")
    p2.add_argument("--versions", type=int, default=None, help="versions per strategy (7)")
    p2.add_argument("--fast-mbps", type=float, default=400.0, help="device 0 throttle (400)")
    p2.add_argument("--slow-mbps", type=float, default=100.0, help="device 1 throttle (100)")
    p2.add_argument("--probe-mib", type=int, default=None, help="bytes per device probe (256)")
    p2.add_argument("--probe-repeat", type=int, default=2, help="probes per device (2)")
    parser.add_argument("--dir", type=Path, default=None, help="disk dirs (a temp folder)")
    parser.add_argument(
        "--shm-dir", type=Path, default=None, help="throttled devices (default /dev/shm)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON")
    args = parser.parse_args(argv)
    defaults = {
        "state_mib": 64 if args.quick else 256,
        "saves": 3 if args.quick else 4,
        "compute_seconds": 0.25 if args.quick else 1.0,
        "tier_state_mib": 128 if args.quick else 512,
        "versions": 3 if args.quick else 7,
        "probe_mib": 64 if args.quick else 256,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.segments < 2 or args.segments % 2:
        parser.error("--segments must be even and >= 2 (local, tiered, ...)")
    if min(args.saves, args.every, args.versions, args.probe_repeat, args.tensors) < 1:
        parser.error("--saves, --every, --versions, --probe-repeat and --tensors must be >= 1")
    if args.versions < 2:
        parser.error("--versions must be >= 2: the first version of each strategy is apart")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cs = h.import_cryosnap()
    env = h.environment()
    report = Report(env, {k: str(v) for k, v in vars(args).items()})
    print(f"environment: {json.dumps(env)}", flush=True)
    shm_base, shm_note = pick_shm(args.shm_dir, 3 * args.tier_state_mib * _MIB)
    t0 = time.perf_counter()
    checks: list[h.Check] = []
    with (
        h.scratch_dir("cryosnap-bench-tiers-", args.dir) as root,
        h.scratch_dir("cryosnap-bench-tiers-", shm_base) as shm,
    ):
        print(f"disk dirs under {root}; throttled scratch devices under {shm} ({shm_note})")
        if args.part in ("stall", "all"):
            checks += measure_stall(cs, root, shm, args, report)
            report.write(args.json)
        if args.part in ("placement", "all"):
            checks += measure_placement(cs, root, shm, args, report)
            report.write(args.json)
    print("\n== summary of checks ==")
    for check in checks:
        report.checks.append(asdict(check))
        print(check.line())
    report.write(args.json)
    print(f"total time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
