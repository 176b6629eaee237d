"""Training with a checkpoint at every step: none / cryosnap lazy / cryosnap eager, paired.

The workload of ``cryosnap bench --workload training`` (6 x Linear(W) + Adam, 288 MiB of
parameters and moments by default, a step tuned to ``--step-seconds``), in blocks of
``--steps`` timed steps per mode, the modes alternated round after round in one process (the
order rotated every round: the load of a shared machine drifts within minutes). Each block
opens a fresh run, saves and drains one untimed version, then times ``--steps`` steps each
followed by a save (``--every``), then drains (untimed) and removes the run.

Per mode: the median step (step + save call), the median save call, the process's CPU seconds
per step (``time.process_time``), and where that CPU went by thread (the main thread, torch's
intra-op threads, cryosnap's writer / io / capture / flush threads; sampled from
``/proc/self/task``), with the load average before and after. A mode's CPU-s/step less that
of ``none`` is what a version costs in CPU beside the training, the floor of the overhead of a
checkpoint at every step on cores the training keeps busy::

    PYTHONPATH=src python bench/bench_train_step.py --rounds 6 --steps 8
    PYTHONPATH=src python bench/bench_train_step.py --modes none,lazy@0,lazy   # capture's nice

Prints ratios, asserts nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _harness import (
    format_ms,
    format_table,
    load_average,
    median,
    print_load,
    scratch_dir,
    settle_disk,
)
from cryosnap.bench._training import _make_model, _train_step, _tune_batch, mlp_width

_TICK = os.sysconf("SC_CLK_TCK")


def _thread_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every thread of this process, by native id."""
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / _TICK
    return out


def _group(name: str) -> str:
    if name.startswith("cryosnap-capture"):
        return "capture"
    if name.startswith("cryosnap-"):
        return name.removeprefix("cryosnap-")
    return "other"


class Sampler:
    """CPU seconds per thread group while running (threads come and go: sampled every 20 ms)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._last: dict[int, float] = {}
        self._names: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for t in threading.enumerate():
            if t.native_id is not None and t.native_id not in self._names:
                self._names[t.native_id] = t.name
        self._last.update(_thread_cpu())

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._sample()

    def __enter__(self) -> Sampler:
        self._sample()
        self._first = dict(self._last)
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def by_group(self, main_tid: int, sampler_tid: int | None) -> dict[str, float]:
        groups: dict[str, float] = defaultdict(float)
        for tid, cpu in self._last.items():
            spent = cpu - self._first.get(tid, 0.0)
            if tid == main_tid:
                groups["main"] += spent
            elif tid == sampler_tid:
                groups["sampler"] += spent
            elif tid in self._names:
                groups[_group(self._names[tid])] += spent
            else:
                groups["torch/native"] += spent  # OpenMP intra-op threads and other C threads
        return dict(groups)


def _block(mode: str, model: Any, opt: Any, data: Any, root: Path, steps: int, every: int) -> Any:
    """One block of ``mode``: ``none``, ``lazy`` or ``eager``, optionally ``@N``: the lazy
    capture's thread at nice N above the program's instead of the default (to compare);
    ``lazy-copy``: a lazy capture that copies every blob (no write-through)."""
    import cryosnap._run.capture.capturer as capturer

    kind, _, nice = mode.partition("@")
    saved = capturer.CAPTURE_NICE, capturer.LAZY_THROUGH
    if nice:
        capturer.CAPTURE_NICE = int(nice)
    if kind == "lazy-copy":
        kind, capturer.LAZY_THROUGH = "lazy", False
    try:
        return _timed_block(kind, model, opt, data, root, steps, every)
    finally:
        capturer.CAPTURE_NICE, capturer.LAZY_THROUGH = saved


def _timed_block(
    mode: str, model: Any, opt: Any, data: Any, root: Path, steps: int, every: int
) -> Any:
    import cryosnap

    work = Path(tempfile.mkdtemp(dir=root))
    x, y = data
    ckpt = None
    state = {"model": model, "optim": opt}
    try:
        _train_step(model, opt, x, y)
        if mode != "none":
            ckpt = cryosnap.Checkpointer(work / "run")
            ckpt.save(0, state, lazy=mode == "lazy").result()
        gc.collect()
        settle_disk()
        step_s, call_s, pendings = [], [], []
        cpu0 = time.process_time()
        with Sampler() as sampler:
            for k in range(1, steps + 1):
                t0 = time.perf_counter()
                _train_step(model, opt, x, y)
                if ckpt is not None and (k - 1) % every == 0:
                    t1 = time.perf_counter()
                    pendings.append(ckpt.save(k, state, lazy=mode == "lazy"))
                    call_s.append(time.perf_counter() - t1)
                step_s.append(time.perf_counter() - t0)
            cpu = time.process_time() - cpu0
            if ckpt is not None:
                t0 = time.perf_counter()
                ckpt.wait()
                drain = time.perf_counter() - t0
            else:
                drain = 0.0
        groups = sampler.by_group(threading.get_native_id(), sampler._thread.native_id)
        infos = [p.result() for p in pendings]
        durable = [i.seconds for i in infos]
        stall = [i.stall_seconds for i in infos]  # the save call and the optimizer's waits
        return step_s, call_s, cpu / steps, drain, groups, durable, stall
    finally:
        if ckpt is not None:
            ckpt.close()
        shutil.rmtree(work, ignore_errors=True)
        settle_disk()


def _ms(samples: list[float]) -> str:
    return format_ms(median(samples)) if samples else "-"


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds of every mode (6)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per block (8)")
    ap.add_argument("--every", type=int, default=1, help="a save every N steps (1)")
    ap.add_argument("--mb", type=int, default=288, help="state size in MiB (288)")
    ap.add_argument("--step-seconds", type=float, default=1.0, help="the tuned step (1.0 s)")
    ap.add_argument("--batch", type=int, default=0, help="a fixed batch (0: tuned for the step)")
    ap.add_argument(
        "--modes",
        default="none,lazy,eager",
        help="comma-separated: none, lazy, eager, lazy-copy (no write-through); MODE@N: the "
        "lazy capture's thread at nice N instead of its default (none,lazy,eager)",
    )
    ap.add_argument("--dir", default=None, help="where the temporary folder goes")
    args = ap.parse_args()
    modes = args.modes.split(",")
    width = mlp_width(args.mb << 20)
    model, opt = _make_model(width)
    batch = args.batch or _tune_batch(model, opt, width, args.step_seconds)
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
    load0 = load_average()
    print(
        f"width {width}, batch {batch}, torch threads {torch.get_num_threads()}, "
        f"{args.rounds} rounds x {args.steps} steps, save every {args.every}; "
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, load {load0:.2f}",
        flush=True,
    )
    res: dict[str, dict[str, list[Any]]] = {m: defaultdict(list) for m in modes}
    with scratch_dir("train-step-", args.dir) as root:
        for r in range(args.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in order:
                step_s, call_s, cpu, drain, groups, durable, stall = _block(
                    mode, model, opt, data, root, args.steps, args.every
                )
                res[mode]["step"] += step_s
                res[mode]["call"] += call_s
                res[mode]["cpu"].append(cpu)
                res[mode]["drain"].append(drain)
                res[mode]["groups"].append(groups)
                res[mode]["durable"] += durable
                res[mode]["stall"] += stall
                print(
                    f"round {r + 1} {mode:5s}: step {median(step_s):.3f} s, cpu/step {cpu:.2f} s,"
                    f" load {load_average():.2f}",
                    flush=True,
                )
    base = median(res[modes[0]]["step"])
    rows = []
    names = sorted({k for m in modes for g in res[m]["groups"] for k in g})
    for mode in modes:
        step = median(res[mode]["step"])
        call = median(res[mode]["call"]) if res[mode]["call"] else 0.0
        mean_call = sum(res[mode]["call"]) / max(len(res[mode]["call"]), 1)
        per_group = {
            k: median([g.get(k, 0.0) for g in res[mode]["groups"]]) / args.steps for k in names
        }
        rows.append(
            [
                mode,
                f"{step:.3f} s",
                f"{(step / base - 1) * 100:+.1f}%",
                f"{call * 1e3:.1f} ms",
                f"{mean_call * 1e3:.1f} ms",
                _ms(res[mode]["stall"]),
                _ms(res[mode]["durable"]),
                f"{median(res[mode]['cpu']):.2f}",
                *(f"{per_group[k]:.2f}" for k in names),
            ]
        )
    headers = [
        "mode",
        "step (median)",
        "overhead",
        "save call (median)",
        "(mean)",
        "stall (median)",
        "durable (median)",
        "CPU-s/step",
        *(f"{k} CPU-s" for k in names),
    ]
    print(format_table(headers, rows))
    print_load(load0)


if __name__ == "__main__":
    main()
