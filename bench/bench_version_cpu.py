"""CPU seconds one Checkpointer version of the training state costs, without training.

The state of ``cryosnap bench --workload training`` (6 x Linear(W) + Adam, 288 MiB by
default), every tensor changed between versions (one in-place add, outside the timing), then
``save(step, state, lazy=...).result()``: the process's CPU seconds (``time.process_time``,
every thread; user and system from ``getrusage``), the time to durable and the stall, per
version (means; stall median), and where the CPU went by thread group (sampled, so a capture
thread's last 20 ms before it ends are missed). Set against a training step's CPU seconds, it
is the least a checkpoint at every step costs on a machine whose cores the training keeps
busy::

    PYTHONPATH=src:bench python bench/bench_version_cpu.py --versions 8 --mode lazy

Prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import tempfile
import threading
import time

import cryosnap
from bench_train_step import Sampler
from cryosnap.bench._training import _make_model, _train_step, mlp_width


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=8)
    ap.add_argument("--mode", choices=("lazy", "eager"), default="lazy")
    ap.add_argument("--mb", type=int, default=288, help="state size in MiB")
    args = ap.parse_args()
    lazy, n = args.mode == "lazy", args.versions
    model, opt = _make_model(mlp_width(args.mb << 20))
    x = torch.randn(64, model[0].in_features)
    _train_step(model, opt, x, x)  # Adam's moments
    state = {"model": model, "optim": opt}
    tensors = [*model.parameters()]
    tensors += [v for st in opt.state.values() for v in st.values() if v.dim()]
    root = tempfile.mkdtemp(prefix="version-cpu-")
    try:
        with cryosnap.Checkpointer(root + "/run") as ckpt:
            ckpt.save(0, state, lazy=lazy).result()  # staging allocated, imports warm
            cpu = wall = user = system = 0.0
            stalls = []
            with Sampler() as sampler:
                for k in range(1, n + 1):
                    with torch.no_grad():
                        for t in tensors:
                            t.add_(1e-7)  # every chunk changes
                    r0 = resource.getrusage(resource.RUSAGE_SELF)
                    c0, w0 = time.process_time(), time.perf_counter()
                    info = ckpt.save(k, state, lazy=lazy).result()
                    cpu += time.process_time() - c0
                    wall += time.perf_counter() - w0
                    r1 = resource.getrusage(resource.RUSAGE_SELF)
                    user += r1.ru_utime - r0.ru_utime
                    system += r1.ru_stime - r0.ru_stime
                    stalls.append(info.stall_seconds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    groups = sampler.by_group(threading.get_native_id(), sampler._thread.native_id)
    print(
        f"{args.mode}: per version {cpu / n:.3f} CPU-s (user {user / n:.3f}, system "
        f"{system / n:.3f}), durable {wall / n:.3f} s after save(), stall "
        f"{sorted(stalls)[n // 2] * 1e3:.1f} ms (median)"
    )
    print("CPU-s per version by thread group (sampled; the in-place adds included): ", end="")
    print(", ".join(f"{k} {v / n:.3f}" for k, v in sorted(groups.items())))


if __name__ == "__main__":
    main()
