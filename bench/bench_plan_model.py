"""The time-to-durable model of ``cryosnap plan`` against measured saves at 1, 2, 4 and 8 ranks.

First the machine's rates, measured here the way a Checkpointer spends them: one thread's
memory copy (numpy ``copyto``, what the capture does), one thread's xxh3-128 rate over 1 MiB
chunks (the writer's hashing), an ``O_DIRECT`` write + fsync of 256 MiB into the run's folder
and its ``O_DIRECT`` read back (the scratch and persistent levels' disk; buffered where the
file system refuses O_DIRECT),
and the latency of one collective of an ``InProcessGroup`` (an all_gather of 2 ranks, the
median of 200), measured again before each world size (the machine's load moves). Then per
world size N, the ranks are threads of this process, each with its own
coordinator of one ``InProcessGroup`` and its own ``Checkpointer(persistent,
scratch=<scratch>/rank-r, keep=1, chunk_bytes=1 MiB)``: the state is ``--state-mib`` MiB of
float32 split evenly over the ranks (each rank's own, sharded) plus ``--replicated-mib`` MiB
replicated on every rank (one array, ``replicated=["model"]``), random numbers (no two chunks
alike: equal chunks are stored once). One untimed save, then
``--repeat`` full versions (one element of every 1 MiB chunk changed before each, so every
chunk is new), each started on every rank together and awaited on every rank before the next:
stall = the ``save`` call (``SaveInfo.stall_seconds``), scratch-durable =
``pending.seconds_to("scratch")`` (from the ``save`` call), persistent-durable = that plus
``pending.seconds_to("persistent")``, each the most of any rank, then the median over the
repeats. The model (:func:`cryosnap.plan.predict`, fed the rates measured before that world
size, both levels' bandwidth the disk's, ``cores_per_node`` the CPUs this process may use)
predicts the same three figures; the table prints both, the error (predicted / measured - 1)
and the load average before and after.

    .venv/bin/python bench/bench_plan_model.py                      # ~1-2 min, ~2 GiB
    .venv/bin/python bench/bench_plan_model.py --ranks 1 2 --repeat 2 --state-mib 64

The disk is shared with whatever else runs on the machine: the load average is printed beside
the figures. Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
from pathlib import Path
from typing import Any

import numpy as np

from _harness import environment, load_average, print_load, scratch_dir, write_json
from cryosnap import Checkpointer
from cryosnap.bench import measure_rates
from cryosnap.dist import InProcessGroup
from cryosnap.plan import JobShape, Machine, predict

MIB = 1 << 20
CHUNK_BYTES = 1 << 20


# ---------------------------------------------------------------------------------- the rates


def run_threads(ranks: int, body: Any) -> list[Any]:
    out: list[Any] = [None] * ranks
    errors: list[BaseException] = []

    def main(rank: int) -> None:
        try:
            out[rank] = body(rank)
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


# ------------------------------------------------------------------------------ the measured


def touch(array: np.ndarray) -> None:
    """Change one element of every 1 MiB chunk: the next version is a full one."""
    array[:: CHUNK_BYTES // array.itemsize] += 1.0


def measure(ranks: int, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    group = InProcessGroup(ranks, timeout=600.0)
    shard = (args.state_mib * MIB // ranks) // 4
    # Random bytes: no chunk equals another (equal chunks are stored once, not written again).
    rng = np.random.default_rng(ranks)
    model = rng.random(args.replicated_mib * MIB // 4, dtype=np.float32)
    shards = [rng.random(shard, dtype=np.float32) for _ in range(ranks)]
    ckpts: list[Checkpointer | None] = [None] * ranks
    persistent, scratch = folder / "persistent", folder / "scratch"

    def open_rank(rank: int) -> None:
        ckpts[rank] = Checkpointer(
            persistent,
            scratch=str(scratch),
            comm=group.coordinator(rank),
            keep=1,
            chunk_bytes=CHUNK_BYTES,
        )

    def save_rank(rank: int, step: int) -> tuple[float, float, float]:
        ckpt = ckpts[rank]
        assert ckpt is not None
        pending = ckpt.save(step, {"model": model, "shard": shards[rank]}, replicated=["model"])
        info = pending.result()
        scratch_s = pending.seconds_to("scratch")
        return info.stall_seconds, scratch_s, scratch_s + pending.seconds_to("persistent")

    run_threads(ranks, open_rank)
    samples: list[tuple[float, float, float]] = []
    try:
        for step in range(args.repeat + 1):
            touch(model)
            for s in shards:
                touch(s)
            os.sync()
            got = run_threads(ranks, lambda r, step=step: save_rank(r, step))
            if step:  # the first save allocates the staging pools and starts the threads
                stall = max(g[0] for g in got)
                samples.append((stall, max(g[1] for g in got), max(g[2] for g in got)))
    finally:
        run_threads(ranks, lambda r: close(ckpts[r]))
    return {
        "stall_seconds": statistics.median(s[0] for s in samples),
        "scratch_seconds": statistics.median(s[1] for s in samples),
        "persistent_seconds": statistics.median(s[2] for s in samples),
    }


def close(ckpt: Checkpointer | None) -> None:
    if ckpt is not None:
        ckpt.close()


def predicted(ranks: int, args: argparse.Namespace, machine: Machine) -> dict[str, float]:
    shape = JobShape(
        ranks,
        ranks,
        (args.state_mib * MIB // ranks) // 4 * 4,
        replicated_bytes=args.replicated_mib * MIB,
    )
    p = predict(shape, machine, scratch=True, retention=True)
    return {
        "stall_seconds": p.stall_seconds,
        "scratch_seconds": p.level("scratch").durable_seconds,
        "persistent_seconds": p.level("persistent").durable_seconds,
    }


def measure_machine(folder: Path, cores: int) -> Machine:
    rates = measure_rates(folder)
    return Machine(
        memcpy_bytes_per_second=rates.memcpy_bytes_per_second,
        hash_bytes_per_second=rates.hash_bytes_per_second,
        local_bytes_per_second=rates.write_bytes_per_second,
        pfs_bytes_per_second=rates.write_bytes_per_second,
        node_bytes_per_second=float("inf"),
        latency_seconds=rates.latency_seconds,
        cores_per_node=cores,
        local_read_bytes_per_second=rates.read_bytes_per_second,
    )


# ------------------------------------------------------------------- published machines

# Figures from the machines' published pages (docs/PERFORMANCE.md cites each one); the ones
# marked "assumed" are not published there and are this script's assumptions.
GBS = 1e9
FRONTIER = Machine(
    memcpy_bytes_per_second=36 * GBS,  # D2H per GCD (OLCF Frontier User Guide)
    hash_bytes_per_second=29 * GBS,  # one core's xxh3 rate, measured on this machine (assumed)
    local_bytes_per_second=4 * GBS,  # 2 NVMe drives per node (cited); their rate (assumed)
    pfs_bytes_per_second=4.6e12,  # Orion's capacity tier, write (insideHPC, OLCF specs)
    node_bytes_per_second=100 * GBS,  # 4 Slingshot-11 NICs of 200 Gb/s per node
    latency_seconds=50e-6,  # one stage of a collective between Python ranks (assumed)
    cores_per_node=64,  # one 64-core EPYC per node (OLCF Frontier User Guide)
)
FRONTIER_RANKS_PER_NODE = 8  # 8 GCDs per node, one rank each
PERLMUTTER = Machine(
    memcpy_bytes_per_second=25 * GBS,  # A100 D2H over PCIe 4.0 x16 (assumed)
    hash_bytes_per_second=29 * GBS,  # as above (assumed)
    local_bytes_per_second=1.0,  # unused: saved straight to the shared level (--no-scratch)
    pfs_bytes_per_second=5e12,  # Perlmutter Scratch, "aggregate bandwidth of >5 TB/sec"
    node_bytes_per_second=100 * GBS,  # 4 Slingshot-11 NICs per GPU node
    latency_seconds=50e-6,  # (assumed)
    cores_per_node=64,  # one 64-core EPYC 7763 per GPU node
)
PERLMUTTER_RANKS_PER_NODE = 4  # 4 A100 per node, one rank each
PUBLISHED_RANKS = (64, 256, 1024, 4096, 16384)


def published(state_bytes: int, replicated_bytes: int) -> None:
    """The model's predictions at 64 to 16,384 ranks on both machines, as a markdown table."""
    print(
        f"Per rank {state_bytes / 2**30:g} GiB of its own and {replicated_bytes / 2**30:g} GiB "
        "replicated.\n"
    )
    print(
        "| ranks | Frontier nodes | stall | scratch-durable | Orion-durable | Orion, no scratch "
        "| Orion bound by | Perlmutter nodes | stall | Lustre-durable | Lustre bound by |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for ranks in PUBLISHED_RANKS:
        f_shape = JobShape(ranks, FRONTIER_RANKS_PER_NODE, state_bytes, replicated_bytes)
        p_shape = JobShape(ranks, PERLMUTTER_RANKS_PER_NODE, state_bytes, replicated_bytes)
        f = predict(f_shape, FRONTIER)
        direct = predict(f_shape, FRONTIER, scratch=False)
        p = predict(p_shape, PERLMUTTER, scratch=False)
        print(
            f"| {ranks:,} | {f_shape.nodes:,} | {f.stall_seconds:.2f} s "
            f"| {f.level('scratch').durable_seconds:.1f} s "
            f"| {f.level('persistent').durable_seconds:.1f} s "
            f"| {direct.level('persistent').durable_seconds:.1f} s | {bound(f_shape, FRONTIER)} "
            f"| {p_shape.nodes:,} | {p.stall_seconds:.2f} s "
            f"| {p.level('persistent').durable_seconds:.1f} s | {bound(p_shape, PERLMUTTER)} |"
        )


def bound(shape: JobShape, machine: Machine) -> str:
    aggregate = machine.pfs_bytes_per_second / shape.ranks
    injection = machine.node_bytes_per_second / shape.ranks_per_node
    return "aggregate" if aggregate < injection else "injection"


def describe(machine: Machine, cores: int) -> str:
    return (
        f"rates: memcpy {machine.memcpy_bytes_per_second / 1e9:.2f} GB/s, hash "
        f"{machine.hash_bytes_per_second / 1e9:.2f} GB/s, disk O_DIRECT write+fsync "
        f"{machine.local_bytes_per_second / 1e9:.2f} GB/s, read "
        f"{machine.read_bytes_per_second / 1e9:.2f} GB/s, collective "
        f"{machine.latency_seconds * 1e6:.0f} us, {cores} cores"
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| ranks | load (1 min) | figure | measured | predicted | error |")
    print("|---:|---|---|---:|---:|---:|")
    for row in rows:
        load = "-".join(f"{x:.0f}" for x in row["load_average"])
        for key, label in (
            ("stall_seconds", "stall"),
            ("scratch_seconds", "scratch-durable"),
            ("persistent_seconds", "persistent-durable"),
        ):
            got, want = row["measured"][key], row["predicted"][key]
            print(
                f"| {row['ranks']} | {load} | {label} | {got:.3f} s | {want:.3f} s "
                f"| {want / got - 1:+.0%} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--state-mib", type=int, default=512, help="sharded, over all ranks")
    parser.add_argument("--replicated-mib", type=int, default=128, help="on every rank")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="the folder of the runs (default: temp)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--published",
        action="store_true",
        help="only print the predictions on Frontier's and Perlmutter's published figures",
    )
    args = parser.parse_args()
    if args.published:
        published(4 << 30, 2 << 30)
        return
    before = load_average()
    cores = len(os.sched_getaffinity(0))
    rows = []
    with scratch_dir("cryosnap-plan-model-", args.dir) as folder:
        for ranks in args.ranks:
            # The rates are measured again before each world size: the machine's load moves.
            loads = [load_average()]
            machine = measure_machine(folder, cores)
            print(describe(machine, cores), flush=True)
            with scratch_dir(f"n{ranks}-", folder) as run:
                got = measure(ranks, args, run)
            loads.append(load_average())
            rows.append(
                {
                    "ranks": ranks,
                    "rates": {
                        "memcpy_bytes_per_second": machine.memcpy_bytes_per_second,
                        "hash_bytes_per_second": machine.hash_bytes_per_second,
                        "local_bytes_per_second": machine.local_bytes_per_second,
                        "local_read_bytes_per_second": machine.read_bytes_per_second,
                        "latency_seconds": machine.latency_seconds,
                        "cores_per_node": cores,
                    },
                    "measured": got,
                    "predicted": predicted(ranks, args, machine),
                    "load_average": loads,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    print()
    print_table(rows)
    print_load(before)
    write_json(args.json, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()
