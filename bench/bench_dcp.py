"""torch.distributed.checkpoint with its file writer beside DCP with cryosnap's writer (#16).

Every rank (a process started by this script with torchrun's environment: ``MASTER_ADDR`` =
127.0.0.1, a free port, ``RANK``, ``WORLD_SIZE``, gloo on ``lo``, ``OMP_NUM_THREADS=1``) holds
its shard of a DTensor-sharded state: ``--mib`` MiB of fp32 in total, 8 tensors sharded by
rows (``Shard(0)`` on a CPU device mesh), as FSDP2 leaves a model. Per world size N, one launch
of N processes runs ``--repeat`` rounds of these peers, each in a fresh directory:

- **DCP file, sync**: ``dcp.save`` with ``FileSystemWriter(dir, sync_files=True)``;
- **DCP file, async**: ``dcp.async_save`` with the same writer (DCP's default stager copies
  the state; stall = until ``async_save`` returns, durable = its future's ``result()``);
- **cryosnap, sync**: ``dcp.save`` with ``cryosnap.dcp.StorageWriter(dir)`` (1 MiB chunks);
- **cryosnap, async**: ``dcp.async_save`` with ``cryosnap.dcp.StorageWriter(dir)`` (it stages
  into its own pool).

Each peer saves the state twice: a **full** version, then a **sparse** update after 1% of the
1 MiB chunks of every rank's shard changed (one element each), as the next ``save`` of the
same writer (for DCP's file writer: the same ``checkpoint_id`` directory's successor, a new
directory, since it has no versions). Stall and durable seconds are the maximum over the ranks
(the job waits for its slowest), the median over the rounds; bytes are what the save wrote, summed
over the ranks (DCP: its files; cryosnap: ``SaveInfo.written_bytes``). Each save starts after
``gc.collect()``, ``os.sync()`` (rank 0) and a barrier. Once per N the cryosnap sparse version is
loaded back through ``cryosnap.dcp.StorageReader`` and compared bit for bit (PASS / FAIL).

    python bench/bench_dcp.py --mib 256 --worlds 1,2 --repeat 1 --dir /tmp

``--dir``: where a temporary folder for the runs is made (default: the temp dir); that folder
is removed at the end, ``--dir`` itself is left as it was.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from _harness import (
    Check,
    format_bytes,
    format_table,
    free_port,
    load_average,
    median,
    print_load,
    rmtree,
    scratch_dir,
    torchrun_env,
)

PEERS = ["DCP file, sync", "DCP file, async", "cryosnap, sync", "cryosnap, async"]
TENSORS = 8
CHUNK = 1 << 20


# -- one rank -------------------------------------------------------------------------------------


def _state(mib: int, rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = (mib << 20) // 4 // TENSORS // 1024
    rows -= rows % world
    g = torch.Generator().manual_seed(rank)
    out = {}
    for i in range(TENSORS):
        local = torch.randn(rows // world, 1024, generator=g)
        out[f"layer{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return out


def _touch(state: dict[str, Any], round_: int) -> None:
    """One element in every 100th 1 MiB chunk of the rank's shards (1% of them), counted
    across its tensors."""
    per, seen = CHUNK // 4, 0
    for t in state.values():
        flat = t.to_local().reshape(-1)
        for start in range(0, flat.numel(), per):
            if seen % 100 == 0:
                flat[start] += 1.0 + round_
            seen += 1


def _barrier(rank: int) -> None:
    import torch.distributed as dist

    gc.collect()
    if rank == 0:
        os.sync()
    dist.barrier()


def _peer(name: str, state: dict[str, Any], root: Path, rank: int, round_: int) -> list[Any]:
    """[full stall, full durable, full bytes, sparse stall, sparse durable, sparse bytes]."""
    import torch.distributed.checkpoint as dcp

    import cryosnap.dcp

    figures: list[Any] = []
    writer: Any = None
    if name.startswith("cryosnap"):
        writer = cryosnap.dcp.StorageWriter(root / "run", chunk_bytes=CHUNK)
    for version in ("full", "sparse"):
        if version == "sparse":
            _touch(state, round_)
        target = root / version
        w = writer if writer is not None else dcp.FileSystemWriter(target, sync_files=True)
        _barrier(rank)
        t0 = time.perf_counter()
        if name.endswith("async"):
            future = dcp.async_save(state, storage_writer=w)
            stall = time.perf_counter() - t0
            future.result()
        else:
            dcp.save(state, storage_writer=w)
            stall = time.perf_counter() - t0
        durable = time.perf_counter() - t0
        if writer is not None:
            written = writer.last_info.written_bytes
        else:
            written = sum(p.stat().st_size for p in target.glob(f"__{rank}_*.distcp"))
            if rank == 0:
                written += (target / ".metadata").stat().st_size
        figures += [stall, durable, written]
    if writer is not None:
        writer.close()
    return figures


def _verify(state: dict[str, Any], root: Path) -> bool:
    import torch
    import torch.distributed.checkpoint as dcp

    import cryosnap.dcp

    like = {k: v.clone() for k, v in state.items()}
    for v in like.values():
        v.to_local().zero_()
    dcp.load(like, storage_reader=cryosnap.dcp.StorageReader(root / "run"))
    return all(torch.equal(like[k].to_local(), v.to_local()) for k, v in state.items())


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    base = Path(args.dir) / f"world-{world}"
    results: dict[str, Any] = {"rounds": []}
    for round_ in range(args.repeat):
        row = {}
        for shift in range(len(PEERS)):
            name = PEERS[(round_ + shift) % len(PEERS)]
            state = _state(args.mib, rank, world)
            root = base / f"r{round_}-{PEERS.index(name)}"
            row[name] = _peer(name, state, root, rank, round_)
            if name == "cryosnap, sync" and round_ == 0:
                results["verified"] = _verify(state, root)
            dist.barrier()
            if rank == 0:
                rmtree(root)
            dist.barrier()
        results["rounds"].append(row)
    (Path(args.out) / f"rank-{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


# -- the parent -----------------------------------------------------------------------------------


def _launch(args: argparse.Namespace, world: int, out: Path) -> list[dict[str, Any]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = torchrun_env(rank, world, port)
        cmd = [sys.executable, __file__, "--rank-main", "--out", str(out)]
        cmd += ["--mib", str(args.mib), "--repeat", str(args.repeat), "--dir", args.dir]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"a rank of world {world} exited {p.returncode}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def _table(world: int, ranks: list[dict[str, Any]]) -> str:
    rows = []
    for name in PEERS:
        per_round = []
        for i in range(len(ranks[0]["rounds"])):
            figs = [r["rounds"][i][name] for r in ranks]
            per_round.append(
                [max(f[k] for f in figs) for k in (0, 1, 3, 4)]
                + [sum(f[k] for f in figs) for k in (2, 5)]
            )
        m = [median([r[k] for r in per_round]) for k in range(6)]
        rows.append(
            [
                name,
                f"{m[0]:.3f}",
                f"{m[1]:.3f}",
                format_bytes(m[4]),
                f"{m[2]:.3f}",
                f"{m[3]:.3f}",
                format_bytes(m[5]),
            ]
        )
    headers = [
        f"{world} rank(s)",
        "full stall s",
        "full durable s",
        "full bytes",
        "sparse stall s",
        "sparse durable s",
        "sparse bytes",
    ]
    return format_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the state in all, MiB (256)")
    parser.add_argument("--worlds", default="1,2", help="world sizes, comma-separated (1,2)")
    parser.add_argument("--repeat", type=int, default=1, help="rounds per world size (1)")
    parser.add_argument("--dir", default=None, help="where the temporary folder goes")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    print(f"state: {args.mib} MiB fp32 in {TENSORS} DTensors (Shard(0)); 1% sparse update")
    load_before = load_average()
    with scratch_dir("bench-dcp-", args.dir) as work:
        args.dir = str(work)  # the ranks' runs go here, removed at the end (never --dir itself)
        for world in (int(w) for w in args.worlds.split(",")):
            with scratch_dir("bench-dcp-out-") as out:
                ranks = _launch(args, world, out)
            print()
            print(_table(world, ranks))
            ok = all(r.get("verified") for r in ranks)
            print(Check("cryosnap sparse version loads back bit for bit", ok, "").line())
    print_load(load_before)


if __name__ == "__main__":
    main()
