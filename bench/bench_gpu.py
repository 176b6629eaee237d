"""GPU state (issue #15): fingerprints on the device, the stall of an eager save against a plain
device-to-pinned copy, a 1%-sparse update over PCIe, and restores to the device.

Made to run once, unattended, on a rented GPU machine (through ``bench/gpu.sh``), in well under
the time it is given: every part runs in its own ``try`` (a failure is recorded, with the last
line of its traceback, and the next part goes on), the results are rewritten to
``OUT/gpu.json`` after every part, a SIGTERM (``timeout``) still writes them, and a watchdog
dumps every thread's stack to stderr shortly before ``--budget`` runs out, so that a hang can be
diagnosed from the log.

For each state size (``--gib``, default 4 GiB: 16 float32 tensors, plus a small odd-sized one
and a 0-d one), on ``--device`` (default ``cuda``):

a. fingerprints: ``Fingerprinter(1 MiB).chunks`` over the 16 large tensors (Triton kernel on
   CUDA when Triton works, else torch ops; which one ran is reported) against the pure-torch
   ``Fingerprinter.chunks_torch``: GB/s, best of 3 after a warm-up, and whether they agree.
b. stall: a ``copy_(non_blocking=True)`` of the state into one preallocated pinned buffer (the
   floor of any capture) and a plain ``.cpu()`` of each tensor, against the ``save()`` call of
   ``Checkpointer(dir, device_diff=False, chunk_bytes=1 MiB)`` (one warm-up save, then best of
   3; ``result()`` waits for durability, reported apart). Between saves one element per tensor
   changes.
c. sparse: ``Checkpointer(dir, device_diff=True)``: a full save, then saves after 1% of the 1 MiB
   chunks changed (one element each, at random): bytes captured (crossed PCIe) / logical bytes
   (must be <= 2%), the stall against the pinned copy, and a bitwise check of the restored state.
d. restore to the device: ``cryosnap.load(dir, map_location=device)``,
   ``Checkpointer(dir).restore(into=tensors on the device)``, ``torch.load(map_location=...)``
   of a ``torch.save`` file and safetensors ``load_file(device=...)``; warm page cache, best of 2,
   each checked bit for bit.

Times are never asserted. Correctness (bitwise restores, fingerprints agreeing, captured bytes of
the sparse update) is: the script exits 1 at the very end if any of those checks failed.

Smoke run without a GPU: ``PYTHONPATH=src .venv/bin/python bench/bench_gpu.py --device cpu
--gib 0.0625 --out /tmp/gpu-smoke``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import gc
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

_CHUNK = 1 << 20
_GIB = 1 << 30
_TENSORS = 16
_SEED = 15
_T0 = time.perf_counter()


class Terminated(BaseException):
    """SIGTERM (the stage's ``timeout``) or the budget ran out: stop, but write what we have."""


class Skipped(Exception):
    """Not enough of the budget left for this part (recorded as skipped, not as a failure)."""


def log(message: str) -> None:
    now = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{now} +{time.perf_counter() - _T0:6.1f}s] {message}", flush=True)


# ------------------------------------------------------------------------------------ report


class Report:
    """Everything measured so far; rewritten to ``OUT/gpu.json`` after every part."""

    def __init__(self, out: Path, env: dict[str, Any]) -> None:
        self.out = out
        self.data: dict[str, Any] = {
            **env,
            "sizes": {},
            "checks": [],
            "errors": [],
            "table": [],
            "terminated": False,
        }
        self.rows: list[list[str]] = []

    def size(self, gib: float) -> dict[str, Any]:
        sizes: dict[str, Any] = self.data["sizes"]
        return sizes.setdefault(f"{gib:g}", {})

    def check(self, name: str, passed: bool, detail: str = "") -> None:
        self.data["checks"].append({"name": name, "passed": bool(passed), "detail": detail})
        log(f"check {'PASS' if passed else 'FAIL'}: {name} {detail}".rstrip())

    def error(self, where: str, exc: BaseException) -> str:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        last = f"{type(exc).__name__}: {exc}".strip().splitlines()
        line = last[0] if last else type(exc).__name__
        self.data["errors"].append(
            {"part": where, "error": line, "traceback": "".join(lines)[-4000:]}
        )
        return line

    def row(
        self,
        name: str,
        seconds: float | None,
        nbytes: int | None = None,
        ratio: float | None = None,
        vs: str = "",
        note: str = "",
    ) -> None:
        gbs = nbytes / seconds / 1e9 if seconds and nbytes else None
        self.data["table"].append(
            {
                "name": name,
                "seconds": seconds,
                "gb_per_s": gbs,
                "ratio": ratio,
                "vs": vs,
                "note": note,
            }
        )
        self.rows.append(
            [
                name,
                "-" if seconds is None else f"{seconds:.4f}",
                "-" if gbs is None else f"{gbs:.1f}",
                "-" if ratio is None else f"{ratio:.3f}",
                vs,
                note,
            ]
        )

    def failed_checks(self) -> list[str]:
        return [c["name"] for c in self.data["checks"] if not c["passed"]]

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - _T0, 2)
        self.data["correct"] = not self.failed_checks()
        path = self.out / "gpu.json"
        tmp = path.with_suffix(".json.tmp")
        try:
            tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            log(f"could not write {path}: {exc}")


# ----------------------------------------------------------------------------------- budget


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def need(self, seconds: float, what: str) -> None:
        if self.left() < seconds:
            raise Skipped(f"{what}: {self.left():.0f} s of the budget left, needs ~{seconds:.0f} s")

    def room_for(self, seconds: float) -> bool:
        return self.left() >= seconds


# ------------------------------------------------------------------------------ the machine


class Device:
    """Synchronize, time and free memory the same way on CUDA and on the CPU (smoke runs)."""

    def __init__(self, torch: ModuleType, name: str) -> None:
        self.torch = torch
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"
        self.pin = bool(torch.cuda.is_available())

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
            self.torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int | None:
        if not self.cuda:
            return None
        return int(self.torch.cuda.max_memory_allocated(self.device))

    def kernel_seconds(self, fn: Callable[[], object]) -> float:
        """Device time of ``fn``'s work (CUDA events on the current stream; wall time on CPU)."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        cuda = self.torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        cuda.synchronize(self.device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def wall_seconds(self, fn: Callable[[], object]) -> tuple[float, object]:
        """Wall time of ``fn`` with the device synchronized before the start and the stop."""
        gc.collect()
        self.sync()
        t0 = time.perf_counter()
        result = fn()
        self.sync()
        return time.perf_counter() - t0, result


def best(samples: Sequence[float]) -> float | None:
    return min(samples) if samples else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ------------------------------------------------------------------------------------ state


def make_state(torch: ModuleType, dev: Device, gib: float) -> dict[str, Any]:
    """16 float32 tensors of ``gib`` GiB together, plus an odd-sized and a 0-d tensor."""
    total = int(gib * _GIB)
    per = max(_CHUNK, (total // _TENSORS) // _CHUNK * _CHUNK)  # whole 1 MiB chunks
    width = 1024
    rows = per // 4 // width
    gen = torch.Generator(device=dev.device)
    gen.manual_seed(_SEED)
    state: dict[str, Any] = {}
    for i in range(_TENSORS):
        state[f"layers.{i:02d}.weight"] = torch.randn(
            (rows, width), generator=gen, device=dev.device, dtype=torch.float32
        )
    state["extra.bias"] = torch.randn(3001, generator=gen, device=dev.device)
    state["extra.step"] = torch.tensor(7, dtype=torch.int64, device=dev.device)
    dev.sync()
    return state


def big_tensors(state: dict[str, Any]) -> list[Any]:
    return [v for k, v in state.items() if k.startswith("layers.")]


def state_bytes(state: dict[str, Any]) -> int:
    return sum(int(v.numel() * v.element_size()) for v in state.values())


def bitwise_mismatches(torch: ModuleType, live: dict[str, Any], got: Any, device: Any) -> list[str]:
    """Keys whose restored tensor differs from the live one in any bit (or dtype, shape,
    device type); empty when the restore is exact."""
    if not isinstance(got, dict):
        return [f"<restored a {type(got).__name__}, not a dict>"]
    bad = sorted(set(live) ^ set(got))
    for key, want in live.items():
        have = got.get(key)
        if have is None:
            continue
        if not isinstance(have, torch.Tensor):
            bad.append(f"{key} (a {type(have).__name__})")
        elif have.dtype != want.dtype or have.shape != want.shape:
            bad.append(f"{key} ({have.dtype}{tuple(have.shape)})")
        elif have.device.type != device.type:
            bad.append(f"{key} (on {have.device})")
        else:
            a = want.detach().contiguous().reshape(-1).view(torch.uint8)
            b = have.detach().contiguous().reshape(-1).view(torch.uint8)
            if not torch.equal(a, b):
                bad.append(key)
    return bad


def load_to(cryosnap: ModuleType, dev: Device, run_dir: Path, step: int | None) -> tuple[Any, bool]:
    """``cryosnap.load(run_dir, step=step, map_location=device)``; without ``map_location``
    (an older tree) a plain load then ``.to(device)``. Returns (state, map_location used)."""
    try:
        return cryosnap.load(run_dir, step=step, map_location=str(dev.device)), True
    except TypeError as exc:
        if "map_location" not in str(exc):
            raise
    state = cryosnap.load(run_dir, step=step)
    return {k: v.to(dev.device) if hasattr(v, "to") else v for k, v in state.items()}, False


# ------------------------------------------------------------------------------------ parts


def part_fingerprint(
    torch: ModuleType, dev: Device, state: dict[str, Any], res: dict[str, Any], report: Report
) -> None:
    import cryosnap._run.capture.fingerprint as fp

    tensors = big_tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    datas = [t.view(-1).view(torch.uint8) for t in tensors]
    f = fp.Fingerprinter(_CHUNK)
    keys = f._keys_on(dev.device)
    words = [f._as_words(d, -(-d.numel() // _CHUNK)) for d in datas]

    def run_chunks() -> list[Any]:
        return [f.chunks(d) for d in datas]

    def run_torch() -> list[Any]:
        return [fp.Fingerprinter.chunks_torch(w, keys) for w in words]

    t0 = time.perf_counter()
    first = run_chunks()  # warm-up: compiles the Triton kernel on CUDA
    dev.sync()
    res["warmup_s"] = time.perf_counter() - t0
    if not dev.cuda:
        path = "torch (not CUDA)"
    elif f._triton is False:
        path = "torch (Triton fell back)"
    else:
        path = "triton"
    res["path"] = path
    res["triton_kernel_built"] = fp._kernel is not None
    log(f"fingerprint path: {path} (warm-up {res['warmup_s']:.2f} s)")
    reference = run_torch()
    dev.sync()
    same = all(torch.equal(a, b) for a, b in zip(first, reference, strict=True))
    shapes_ok = all(tuple(a.shape) == (w.shape[0], 2) for a, w in zip(first, words, strict=True))
    res["triton_matches_torch"] = bool(same)
    res["shape_ok"] = bool(shapes_ok)
    res["on_device"] = all(a.device.type == dev.device.type for a in first)
    report.check("fingerprint: chunks() equals chunks_torch()", same, f"path {path}")
    report.check(
        "fingerprint: (n_chunks, 2) on the tensor's device", shapes_ok and res["on_device"]
    )
    # One changed element changes its chunk's fingerprint and no other.
    probe = tensors[0].view(-1)
    index = probe.numel() // 2
    old = probe[index].clone()
    probe[index] += 1.0
    after = f.chunks(datas[0])
    probe[index] = old
    dev.sync()
    diff_rows = (after != first[0]).any(1).nonzero().flatten().tolist()
    want_row = index * 4 // _CHUNK
    res["change_detected_rows"] = diff_rows
    report.check(
        "fingerprint: one changed element changes exactly its chunk",
        diff_rows == [want_row],
        f"rows {diff_rows[:5]} (want [{want_row}])",
    )
    del first, reference, after
    for name, fn in (("chunks", run_chunks), ("chunks_torch", run_torch)):
        samples = [dev.kernel_seconds(fn) for _ in range(3)]
        res[f"{name}_s"] = samples
        res[f"{name}_gb_per_s"] = nbytes / min(samples) / 1e9
        log(
            f"fingerprint {name}: best {min(samples) * 1e3:.2f} ms, "
            f"{res[f'{name}_gb_per_s']:.1f} GB/s over {nbytes / _GIB:.2f} GiB"
        )
    res["bytes"] = nbytes
    t_c, t_t = min(res["chunks_s"]), min(res["chunks_torch_s"])
    report.row(f"fingerprint chunks() [{path}]", t_c, nbytes, ratio(t_c, t_t), "chunks_torch")
    report.row("fingerprint chunks_torch()", t_t, nbytes)


def pinned_copy_baseline(
    torch: ModuleType, dev: Device, items: list[Any], res: dict[str, Any], report: Report
) -> float:
    """One preallocated pinned buffer, ``copy_(non_blocking=True)``, synchronize: the floor of
    any capture. Returns its best seconds."""
    nbytes = sum(t.numel() * t.element_size() for t in items)
    t0 = time.perf_counter()
    padded = sum(-(-(t.numel() * t.element_size()) // 64) * 64 for t in items)
    flat = torch.empty(padded, dtype=torch.uint8, pin_memory=dev.pin)
    res["pinned_alloc_s"] = time.perf_counter() - t0
    res["pinned"] = dev.pin
    views, offset = [], 0
    for t in items:
        n = t.numel() * t.element_size()
        views.append(flat[offset : offset + n].view(t.dtype).view(t.shape))
        offset += -(-n // 64) * 64  # aligned for every dtype

    def pinned_copy() -> None:
        for v, t in zip(views, items, strict=True):
            v.copy_(t, non_blocking=True)
        dev.sync()

    pinned_copy()  # touches the buffer
    samples = [dev.wall_seconds(pinned_copy)[0] for _ in range(3)]
    res["pinned_copy_s"] = samples
    base = min(samples)
    res["pinned_copy_best_s"] = base
    res["pinned_copy_gb_per_s"] = nbytes / base / 1e9
    log(f"pinned copy_: best {base:.4f} s, {nbytes / base / 1e9:.1f} GB/s (pinned={dev.pin})")
    label = f"copy_ to pinned buffer{'' if dev.pin else ' (not pinned)'}"
    report.row(label, base, nbytes, 1.0, "pinned copy_")
    views.clear()
    del flat
    gc.collect()
    return base


def plain_copy_baseline(
    dev: Device, items: list[Any], base: float, res: dict[str, Any], report: Report
) -> None:
    """A plain ``.cpu()`` of each tensor (pageable memory, allocated per call)."""
    nbytes = sum(t.numel() * t.element_size() for t in items)

    def plain_cpu() -> list[Any]:
        return [t.cpu() if dev.cuda else t.clone() for t in items]

    cpu_samples = []
    for _ in range(3):
        seconds, copies = dev.wall_seconds(plain_cpu)
        del copies
        cpu_samples.append(seconds)
    res["cpu_copy_s"] = cpu_samples
    label = ".cpu() per tensor" if dev.cuda else ".clone() per tensor (CPU run)"
    report.row(label, min(cpu_samples), nbytes, ratio(min(cpu_samples), base), "pinned copy_")
    log(f"{label}: best {min(cpu_samples):.4f} s")
    gc.collect()


def timed_save(
    ckpt: Any, step: int, state: dict[str, Any], dev: Device, budget: Budget
) -> tuple[dict[str, Any], Any]:
    """``save()`` timed from a synchronized device (the stall), then ``result()`` (until
    durable): the record of the save and its SaveInfo."""
    dev.sync()
    t0 = time.perf_counter()
    pending = ckpt.save(step, state)
    stall = time.perf_counter() - t0
    t1 = time.perf_counter()
    info = pending.result(timeout=max(5.0, budget.left()))
    record = {
        "step": step,
        "stall_s": stall,
        "info_stall_s": info.stall_seconds,
        "durable_wait_s": time.perf_counter() - t1,
        "info_seconds": info.seconds,
        "captured_bytes": getattr(info, "captured_bytes", None),
        "logical_bytes": info.logical_bytes,
        "written_bytes": info.written_bytes,
        "incremental": info.incremental,
        "new_chunks": info.new_chunks,
        "chunks": info.chunks,
    }
    return record, info


def eager_saves(
    cryosnap: ModuleType,
    dev: Device,
    state: dict[str, Any],
    run_dir: Path,
    base: float,
    res: dict[str, Any],
    budget: Budget,
) -> list[dict[str, Any]]:
    """A warm-up save then up to 3 timed ones of ``Checkpointer(device_diff=False)``, one
    element per large tensor changed between them."""
    saves: list[dict[str, Any]] = []
    try:
        with cryosnap.Checkpointer(
            run_dir, device_diff=False, chunk_bytes=_CHUNK, staging_bytes=None
        ) as ckpt:
            for step in range(4):
                if step:
                    estimate = max(s["durable_wait_s"] for s in saves) + 2 * base + 5
                    if not budget.room_for(estimate):
                        res["skipped_saves"] = f"budget: {budget.left():.0f} s left at step {step}"
                        log(res["skipped_saves"])
                        break
                    for t in big_tensors(state):  # each version differs from the last
                        t.view(-1)[step] += 1.0
                record, info = timed_save(ckpt, step, state, dev, budget)
                saves.append(record)
                stall, wait = record["stall_s"], record["durable_wait_s"]
                log(
                    f"eager save {step}{' (warm-up)' if not step else ''}: stall {stall:.4f} s "
                    f"({stall / base:.2f}x pinned copy), durable after {wait:.2f} s more, "
                    f"captured {record['captured_bytes']}, written {info.written_bytes}"
                )
    finally:
        res["saves"] = saves
        shutil.rmtree(run_dir, ignore_errors=True)
    return saves


def part_eager(
    torch: ModuleType,
    cryosnap: ModuleType,
    dev: Device,
    state: dict[str, Any],
    root: Path,
    res: dict[str, Any],
    report: Report,
    budget: Budget,
) -> None:
    nbytes = state_bytes(state)
    items = list(state.values())
    base = pinned_copy_baseline(torch, dev, items, res, report)
    plain_copy_baseline(dev, items, base, res, report)
    # cryosnap eager: save() returns once the state is captured to pinned host memory.
    saves = eager_saves(cryosnap, dev, state, root / "eager", base, res, budget)
    stalls = [s["stall_s"] for s in saves[1:]]
    res["stall_best_s"] = best(stalls)
    res["stall_ratio"] = ratio(best(stalls), base)
    res["captured_bytes"] = saves[-1]["captured_bytes"] if saves else None
    if saves:
        report.check(
            "eager: captured_bytes == logical bytes (device_diff=False)",
            all(s["captured_bytes"] in (None, s["logical_bytes"]) for s in saves),
            f"{[s['captured_bytes'] for s in saves]}",
        )
    if stalls:
        waits = [s["durable_wait_s"] for s in saves[1:]]
        note = f"best of {len(stalls)}"
        report.row(
            "cryosnap eager save() stall",
            best(stalls),
            nbytes,
            res["stall_ratio"],
            "pinned copy_",
            note,
        )
        note = "incremental, 1 elem/tensor changed"
        report.row("  ... then result() (durable)", best(waits), nbytes, None, "", note)
    first = saves[0] if saves else {}
    report.row(
        "  warm-up save() stall",
        first.get("stall_s"),
        nbytes,
        ratio(first.get("stall_s"), base),
        "pinned copy_",
        "allocates pinned slabs",
    )
    wait = first.get("durable_wait_s")
    report.row("  warm-up result() (full write)", wait, nbytes, None, "", "full write + fsync")


def change_one_percent(torch: ModuleType, dev: Device, state: dict[str, Any], seed: int) -> int:
    """Add 1.0 to one element in each of 1% of the 1 MiB chunks of the large tensors, chosen at
    random over all of them; returns how many chunks changed."""
    chunks = []
    for key, t in state.items():
        if key.startswith("layers."):
            n = -(-(t.numel() * t.element_size()) // _CHUNK)
            chunks.extend((key, j) for j in range(n))
    rng = random.Random(seed)
    picked = rng.sample(chunks, max(1, round(len(chunks) / 100)))
    per_chunk = _CHUNK // 4
    for key, j in picked:
        flat = state[key].view(-1)
        lo = j * per_chunk
        index = lo + rng.randrange(min(per_chunk, flat.numel() - lo))
        flat[index] += 1.0
    dev.sync()
    return len(picked)


def sparse_saves(
    torch: ModuleType,
    cryosnap: ModuleType,
    dev: Device,
    state: dict[str, Any],
    run_dir: Path,
    res: dict[str, Any],
    budget: Budget,
) -> list[dict[str, Any]]:
    """``Checkpointer(device_diff=True)``: a full save, then up to 3 saves after 1% of the
    chunks changed; the run is left for the restore part."""
    saves: list[dict[str, Any]] = []
    dev.reset_peak()
    try:
        with cryosnap.Checkpointer(
            run_dir, device_diff=True, chunk_bytes=_CHUNK, staging_bytes=None
        ) as ckpt:
            for step in range(4):
                changed = 0
                if step:
                    estimate = 3 * max(
                        s["durable_wait_s"] + s["stall_s"] for s in saves[1:] or saves
                    )
                    if step > 1 and not budget.room_for(estimate + 60):
                        res["skipped_saves"] = f"budget: {budget.left():.0f} s left at step {step}"
                        log(res["skipped_saves"])
                        break
                    changed = change_one_percent(torch, dev, state, _SEED + step)
                record, info = timed_save(ckpt, step, state, dev, budget)
                captured = record["captured_bytes"]
                frac = captured / info.logical_bytes if captured else captured
                record = {**record, "changed_chunks": changed, "captured_fraction": frac}
                saves.append(record)
                log(
                    f"device_diff save {step}: {changed} chunks changed, stall "
                    f"{record['stall_s']:.4f} s, durable after {record['durable_wait_s']:.2f} s "
                    f"more, captured {'?' if frac is None else f'{frac * 100:.2f}%'} of "
                    f"{info.logical_bytes}, written {info.written_bytes}, new_chunks "
                    f"{info.new_chunks}, incremental {info.incremental}"
                )
    finally:
        res["saves"] = saves
        res["gpu_peak_allocated_bytes"] = dev.peak_bytes()
    return saves


def report_sparse(
    saves: list[dict[str, Any]],
    nbytes: int,
    pinned_copy_s: float | None,
    res: dict[str, Any],
    report: Report,
) -> None:
    """The checks on what each save captured, and the table's rows."""
    stalls = [s["stall_s"] for s in saves[1:]]
    if saves:
        first = saves[0]
        report.check(
            "sparse: step 0 captures everything",
            first["captured_bytes"] in (None, first["logical_bytes"]),
            f"captured {first['captured_bytes']} of {first['logical_bytes']}",
        )
        report.row(
            "  device_diff full save() stall (step 0)",
            first["stall_s"],
            nbytes,
            ratio(first["stall_s"], pinned_copy_s),
            "pinned copy_",
            "fingerprints + copy",
        )
    for s in saves[1:]:
        frac = s["captured_fraction"]
        report.check(
            f"sparse: step {s['step']} captured <= 2% of the state",
            frac is not None and frac <= 0.02,
            "captured_bytes missing" if frac is None else f"{frac * 100:.3f}%",
        )
        report.check(f"sparse: step {s['step']} is incremental", bool(s["incremental"]))
    if not stalls:
        return
    one = saves[1]
    fields = ("captured_fraction", "written_bytes", "incremental", "new_chunks")
    res.update({k: one[k] for k in (*fields, "captured_bytes", "logical_bytes")})
    note = (
        f"captured {one['captured_fraction'] * 100:.2f}%, written {one['written_bytes']}"
        if one["captured_fraction"] is not None
        else "captured_bytes missing"
    )
    label = "cryosnap device_diff 1% save() stall"
    report.row(label, best(stalls), nbytes, res["stall_ratio"], "pinned copy_", note)
    wait = best([s["durable_wait_s"] for s in saves[1:]])
    note = f"new_chunks {one['new_chunks']}"
    report.row("  ... then result() (durable)", wait, nbytes, None, "", note)


def verify_sparse(
    torch: ModuleType,
    cryosnap: ModuleType,
    dev: Device,
    state: dict[str, Any],
    run_dir: Path,
    step: int,
    res: dict[str, Any],
    report: Report,
) -> None:
    """The newest version (the end of the incremental chain) loaded, bit for bit."""
    seconds, got_used = dev.wall_seconds(lambda: load_to(cryosnap, dev, run_dir, step))
    got, used = got_used
    res["map_location_supported"] = used
    bad = bitwise_mismatches(torch, state, got, dev.device)
    res["verify_step"] = step
    res["verify_mismatches"] = bad[:20]
    res["restore_bitwise_equal"] = not bad
    report.check(
        f"sparse: load(step={step}) equals the live state bit for bit",
        not bad,
        f"{len(bad)} mismatched: {bad[:5]}" if bad else f"{seconds:.2f} s",
    )
    del got, got_used


def part_sparse(
    torch: ModuleType,
    cryosnap: ModuleType,
    dev: Device,
    state: dict[str, Any],
    run_dir: Path,
    res: dict[str, Any],
    report: Report,
    budget: Budget,
    pinned_copy_s: float | None,
) -> None:
    saves = sparse_saves(torch, cryosnap, dev, state, run_dir, res, budget)
    stalls = [s["stall_s"] for s in saves[1:]]
    res["pinned_copy_best_s"] = pinned_copy_s
    res["stall_best_s"] = best(stalls)
    res["stall_ratio"] = ratio(best(stalls), pinned_copy_s)
    res["last_step"] = saves[-1]["step"] if saves else None
    report_sparse(saves, state_bytes(state), pinned_copy_s, res, report)
    if saves and saves[-1]["step"] > 0:
        verify_sparse(torch, cryosnap, dev, state, run_dir, saves[-1]["step"], res, report)


def serial_load_seconds(
    cryosnap: ModuleType, dev: Device, run_dir: Path, budget: Budget
) -> list[float]:
    """The same load with the device copies made once every blob verified (the restore before
    it was pipelined), for the ratio in one run; [] on a tree without the pipelined path."""
    try:
        from cryosnap.engine import _read
    except ImportError:
        return []
    if not hasattr(_read, "_pipelined"):
        return []
    real = _read._pipelined
    _read._pipelined = lambda device: False
    out: list[float] = []
    try:
        for _ in range(2):
            if not budget.room_for(60):  # the peers' restores come first
                break
            seconds, _got = dev.wall_seconds(lambda: load_to(cryosnap, dev, run_dir, None))
            out.append(seconds)
            del _got
            dev.free()
    finally:
        _read._pipelined = real
    return out


def cryosnap_loads(
    torch: ModuleType,
    cryosnap: ModuleType,
    dev: Device,
    state: dict[str, Any],
    run_dir: Path,
    res: dict[str, Any],
    report: Report,
    budget: Budget,
) -> tuple[float, str]:
    """``cryosnap.load(map_location=device)`` twice (the first checked bit for bit), then the
    same with the copies after every read; returns the best seconds and the row's label."""
    cryo_s: list[float] = []
    used = True
    for i in range(2):
        budget.need(20, "restore: cryosnap.load")
        seconds, got_used = dev.wall_seconds(lambda: load_to(cryosnap, dev, run_dir, None))
        got, used = got_used
        cryo_s.append(seconds)
        if i == 0:
            bad = bitwise_mismatches(torch, state, got, dev.device)
            report.check("restore: cryosnap.load(map_location) bit for bit", not bad, str(bad[:5]))
        del got, got_used
        dev.free()
    res["map_location_supported"] = used
    res["cryosnap_load_s"] = cryo_s
    base = min(cryo_s)
    label = "cryosnap.load(map_location)" if used else "cryosnap.load() + .to(device)"
    log(f"{label}: best {base:.3f} s")
    serial = serial_load_seconds(cryosnap, dev, run_dir, budget)
    if serial:
        res["cryosnap_load_serial_s"] = serial
        log(
            f"cryosnap.load(map_location), copies after every read (not pipelined): best "
            f"{min(serial):.3f} s; pipelined {base:.3f} s "
            f"(serial / pipelined: {min(serial) / base:.2f})"
        )
    return base, label


def restore_into_seconds(
    torch: ModuleType,
    cryosnap: ModuleType,
    dev: Device,
    state: dict[str, Any],
    run_dir: Path,
    report: Report,
    budget: Budget,
) -> list[float]:
    """``Checkpointer(run_dir).restore(into=)`` tensors on the device, twice (zeroed first; the
    first checked bit for bit)."""
    like = {k: torch.empty_like(v) for k, v in state.items()}
    into_s: list[float] = []
    with cryosnap.Checkpointer(run_dir) as ckpt:
        for i in range(2):
            budget.need(20, "restore: Checkpointer.restore(into=)")
            for v in like.values():
                v.zero_()
            seconds, _ = dev.wall_seconds(lambda: ckpt.restore(into=like))
            into_s.append(seconds)
            if i == 0:
                bad = bitwise_mismatches(torch, state, like, dev.device)
                report.check(
                    "restore: Checkpointer.restore(into=) bit for bit", not bad, str(bad[:5])
                )
    log(f"Checkpointer.restore(into=): best {min(into_s):.3f} s")
    like.clear()
    dev.free()
    return into_s


def peer_load_seconds(
    torch: ModuleType,
    dev: Device,
    state: dict[str, Any],
    res: dict[str, Any],
    report: Report,
    budget: Budget,
    peer: tuple[str, str, str],
    save: Callable[[], object],
    load: Callable[[], object],
) -> float:
    """A peer's save (page cache), then two loads to the device (the first checked bit for
    bit); ``peer``: (key in the results, its name, the save's row). Returns the best load."""
    key, name, save_row = peer
    nbytes = state_bytes(state)
    budget.need(30, f"restore: {name}")
    seconds, _ = dev.wall_seconds(save)
    res[f"{key}_save_s"] = seconds
    report.row(save_row, seconds, nbytes)
    loads = []
    for i in range(2):
        budget.need(15, f"restore: {name} load")
        seconds, got = dev.wall_seconds(load)
        loads.append(seconds)
        if i == 0:
            bad = bitwise_mismatches(torch, state, got, dev.device)
            report.check(f"restore: {name} bit for bit (peer)", not bad, str(bad[:5]))
        del got
        dev.free()
    res[f"{key}_load_s"] = loads
    return min(loads)


def peer_loads(
    torch: ModuleType,
    dev: Device,
    state: dict[str, Any],
    root: Path,
    res: dict[str, Any],
    report: Report,
    budget: Budget,
) -> dict[str, float]:
    """``torch.load(map_location=)`` of a ``torch.save`` file and safetensors
    ``load_file(device=)``: the best load of each that ran, by row name."""
    peers: dict[str, float] = {}
    path = root / "state.pt"
    try:
        peers["torch.load(map_location)"] = peer_load_seconds(
            torch, dev, state, res, report, budget,
            ("torch", "torch.load", "  torch.save (page cache, no fsync)"),
            lambda: torch.save(state, path),
            lambda: torch.load(path, map_location=dev.device, weights_only=True),
        )  # fmt: skip
    except Skipped:
        raise
    except Exception as exc:
        res["torch_error"] = report.error("restore/torch", exc)
        log(f"torch peer failed: {res['torch_error']}")
    finally:
        path.unlink(missing_ok=True)
    path = root / "state.safetensors"
    try:
        from safetensors.torch import load_file, save_file

        peers["safetensors load_file(device)"] = peer_load_seconds(
            torch, dev, state, res, report, budget,
            ("safetensors", "safetensors", "  safetensors save_file (page cache)"),
            lambda: save_file(state, str(path)),
            lambda: load_file(str(path), device=str(dev.device)),
        )  # fmt: skip
    except ImportError as exc:
        res["safetensors_error"] = f"not installed: {exc}"
    except Skipped:
        raise
    except Exception as exc:
        res["safetensors_error"] = report.error("restore/safetensors", exc)
        log(f"safetensors peer failed: {res['safetensors_error']}")
    finally:
        path.unlink(missing_ok=True)
    for name, seconds in peers.items():
        log(f"{name}: best {seconds:.3f} s")
    return peers


def part_restore(
    torch: ModuleType,
    cryosnap: ModuleType,
    dev: Device,
    state: dict[str, Any],
    run_dir: Path,
    root: Path,
    res: dict[str, Any],
    report: Report,
    budget: Budget,
) -> None:
    nbytes = state_bytes(state)
    if not run_dir.exists():
        budget.need(30, "restore: a fresh save first")
        log("restore: no earlier run to load; saving one first (untimed)")
        cryosnap.save(run_dir, state, step=0)
    base, label = cryosnap_loads(torch, cryosnap, dev, state, run_dir, res, report, budget)
    into_s = restore_into_seconds(torch, cryosnap, dev, state, run_dir, report, budget)
    res["restore_into_s"] = into_s
    peers = peer_loads(torch, dev, state, root, res, report, budget)
    ref_name = "torch.load(map_location)"
    ref = peers.get(ref_name)
    vs = ref_name if ref else ""
    report.row(label, base, nbytes, ratio(base, ref), vs)
    report.row("Checkpointer.restore(into=)", min(into_s), nbytes, ratio(min(into_s), ref), vs)
    for name, seconds in peers.items():
        report.row(name, seconds, nbytes, ratio(seconds, ref), ref_name)


# ------------------------------------------------------------------------------------ main


def environment(
    torch: ModuleType | None, cryosnap: ModuleType | None, device: str
) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "cwd": os.getcwd(),
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "requested_device": device,
    }
    if torch is not None:
        env["torch"] = torch.__version__
        env["torch_cuda"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            with contextlib.suppress(Exception):
                env["device_name"] = torch.cuda.get_device_name(0)
                props = torch.cuda.get_device_properties(0)
                env["device_memory_bytes"] = int(props.total_memory)
        else:
            env["device_name"] = platform.processor() or platform.machine()
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:
        env["triton"] = f"unavailable: {type(exc).__name__}: {exc}"
    if cryosnap is not None:
        env["cryosnap"] = str(Path(cryosnap.__file__ or "?").parent)
    with contextlib.suppress(Exception):
        here = Path(__file__).resolve().parent.parent
        env["git_head"] = (
            subprocess.run(
                ["git", "-C", str(here), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            ).stdout.strip()
            or None
        )
    return env


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("gpu-results"),
        help="results directory (gpu.json); default ./gpu-results",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument(
        "--gib",
        type=float,
        nargs="+",
        default=[4.0],
        help="state sizes in GiB, run in order (default 4)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the run directories go (default: the temp dir, /tmp)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=140.0,
        help="seconds this script may take; parts that do not fit are skipped (default 140)",
    )
    parser.add_argument(
        "--parts",
        default="fingerprint,eager,sparse,restore",
        help="comma-separated subset of fingerprint,eager,sparse,restore",
    )
    args = parser.parse_args(argv)
    if any(g <= 0 for g in args.gib):
        parser.error("--gib sizes must be positive")
    return args


def run_part(name: str, res: dict[str, Any], report: Report, fn: Callable[[], None]) -> bool:
    log(f"== {name} ==")
    t0 = time.perf_counter()
    ok = False
    try:
        fn()
        ok = True
    except Skipped as exc:
        res["skipped"] = str(exc)
        log(f"{name} skipped: {exc}")
    except Exception as exc:
        res["error"] = report.error(name, exc)
        log(f"{name} FAILED: {res['error']}")
        traceback.print_exc()
        sys.stderr.flush()
    finally:
        res["part_seconds"] = round(time.perf_counter() - t0, 3)
        report.write()
    return ok


@contextlib.contextmanager
def terminate_on_sigterm(report: Report) -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        # Written here too: unwinding may block (a Checkpointer waiting for its writer).
        report.data["terminated"] = f"signal {signum}"
        report.write()
        raise Terminated(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_size(
    torch: ModuleType,
    cryosnap: ModuleType,
    dev: Device,
    gib: float,
    root: Path,
    parts: set[str],
    report: Report,
    budget: Budget,
    several: bool,
) -> None:
    """Every part on one state of ``gib`` GiB; the run directories are removed at the end."""
    res = report.size(gib)
    log(f"===== state {gib:g} GiB on {dev.device} =====")
    try:
        budget.need(10, f"state {gib:g} GiB")
        state = make_state(torch, dev, gib)
    except Exception as exc:
        res["error"] = report.error(f"state {gib:g}", exc)
        log(f"state {gib:g} GiB: {res['error']}")
        return
    nbytes = state_bytes(state)
    res["state"] = {
        "bytes": nbytes,
        "tensors": len(state),
        "large_shape": list(big_tensors(state)[0].shape),
    }
    log(f"state: {len(state)} tensors, {nbytes / _GIB:.3f} GiB")
    if several:
        report.rows.append([f"--- {gib:g} GiB ---", "", "", "", "", ""])
    fingerprint: dict[str, Any] = res.setdefault("fingerprint", {})
    eager: dict[str, Any] = res.setdefault("eager", {})
    sparse: dict[str, Any] = res.setdefault("sparse", {})
    restore: dict[str, Any] = res.setdefault("restore", {})
    eager_dir = root / f"eager-{gib:g}"
    sparse_dir = root / f"sparse-{gib:g}"
    fresh_dir = root / f"restore-{gib:g}"

    def do_eager() -> None:
        budget.need(20, "eager")
        part_eager(torch, cryosnap, dev, state, eager_dir, eager, report, budget)

    def do_sparse() -> None:
        budget.need(25, "sparse")
        pinned = eager.get("pinned_copy_best_s")
        part_sparse(torch, cryosnap, dev, state, sparse_dir, sparse, report, budget, pinned)

    def do_restore() -> None:
        budget.need(25, "restore")
        # The sparse run's newest version is the live state unless that part failed midway.
        reuse = bool(sparse.get("saves")) and "error" not in sparse
        restore["source"] = "sparse run" if reuse else "a fresh cryosnap.save"
        run_dir = sparse_dir if reuse else fresh_dir
        part_restore(torch, cryosnap, dev, state, run_dir, root, restore, report, budget)

    try:
        if "fingerprint" in parts:
            run_part(
                "fingerprint",
                fingerprint,
                report,
                lambda: part_fingerprint(torch, dev, state, fingerprint, report),
            )
            dev.free()
        if "eager" in parts:
            run_part("eager stall", eager, report, do_eager)
            shutil.rmtree(eager_dir, ignore_errors=True)
            dev.free()
        if "sparse" in parts:
            run_part("sparse update", sparse, report, do_sparse)
            dev.free()
        if "restore" in parts:
            run_part("restore", restore, report, do_restore)
    finally:
        for path in (eager_dir, sparse_dir, fresh_dir):
            shutil.rmtree(path, ignore_errors=True)
        state.clear()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget)
    # A hang (in a CUDA call or a cryosnap thread) still leaves every thread's stack in the log.
    faulthandler.dump_traceback_later(max(10.0, args.budget + 5), exit=False)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    log(f"bench_gpu: {' '.join(sys.argv)}")
    torch: ModuleType | None = None
    cryosnap: ModuleType | None = None
    import_error = None
    try:
        import torch as _torch

        torch = _torch
        import cryosnap as _cryosnap

        cryosnap = _cryosnap
    except Exception as exc:
        import_error = f"{type(exc).__name__}: {exc}"
    env = environment(torch, cryosnap, args.device)
    report = Report(args.out, env)
    report.data["args"] = {k: str(v) for k, v in vars(args).items()}
    log("environment: " + json.dumps(env))
    if torch is None or cryosnap is None:
        report.data["errors"].append({"part": "import", "error": import_error})
        report.check("imports", False, str(import_error))
        report.write()
        log(f"cannot run: {import_error}")
        return 1
    root = Path(tempfile.mkdtemp(prefix="cryosnap-bench-gpu-", dir=args.dir))
    log(f"run directories under {root}")
    try:
        with terminate_on_sigterm(report):
            dev = Device(torch, args.device)
            if dev.cuda and not torch.cuda.is_available():
                raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
            for gib in args.gib:
                run_size(torch, cryosnap, dev, gib, root, parts, report, budget, len(args.gib) > 1)
                dev.free()
    except Terminated as exc:
        report.data["terminated"] = str(exc)
        log(f"TERMINATED ({exc}): writing what was measured")
    except Exception as exc:
        line = report.error("main", exc)
        log(f"FAILED: {line}")
        traceback.print_exc()
    finally:
        faulthandler.cancel_dump_traceback_later()
        shutil.rmtree(root, ignore_errors=True)
        report.write()
    import _harness as h  # bench/'s helpers; they import cryosnap, which imported above

    headers = ["name", "seconds", "GB/s", "ratio", "vs", "note"]
    print("\n" + h.format_table(headers, report.rows, left=(0, -2, -1)), flush=True)
    print(
        "ratio: seconds / the seconds of 'vs' (below 1: faster than it). GB/s: state bytes / "
        "seconds (fingerprints: the large tensors' bytes).",
        flush=True,
    )
    failed = report.failed_checks()
    errors = [e["part"] for e in report.data["errors"]]
    skipped = [
        f"{size}/{name}: {part['skipped']}"
        for size, parts_of in report.data["sizes"].items()
        for name, part in parts_of.items()
        if isinstance(part, dict) and "skipped" in part
    ]
    for line in skipped:
        log(f"skipped {line}")
    log(
        f"{len(report.data['checks'])} checks, {len(failed)} failed{': ' if failed else ''}"
        f"{', '.join(failed)}; parts with errors: {errors or 'none'}; "
        f"results in {args.out / 'gpu.json'}"
    )
    if report.data["terminated"]:
        return 124
    if failed:
        return 1
    return 2 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
