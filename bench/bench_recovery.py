"""Recovery time (issue #58): a 2-rank training job is killed (SIGKILL) and restarted; how
long from the restart to the state restored, from each level.

Two gloo ranks on two simulated nodes (``$CRYOSNAP_NODE``) train a state of ``--size`` in all
(each rank's part half of it, random float32), saving with
``Checkpointer(run, scratch=<node dir>, partner=True, memory=...)``; each node's memory root
(``$CRYOSNAP_MEMORY_ROOT``) is a folder of its own in /dev/shm. Once the version is durable
on every level, both ranks SIGKILL themselves. Then the ranks are started again, restore,
and SIGKILL themselves again (leaving the memory level for the next restart), each time
with less left:

- ``memory``: nothing lost; each rank reads its own memory.
- ``partner-memory``: node 0's memory deleted; its open rebuilds it from node 1's copy (over
  gloo on loopback), then it reads it; rank 1 reads its own.
- ``scratch``: both nodes' memory deleted; scratch's files dropped from the page cache
  (``POSIX_FADV_DONTNEED`` per file, as the cold-read benches do).
- ``persistent``: memory and scratch deleted; the persistent level's files dropped from the
  page cache. Scratch and persistent are folders of one disk here.
- ``s3``: another run, its only level ``s3://`` on a moto server on loopback.
- ``torch.load``: each rank's part saved with ``torch.save`` beside, dropped from the page
  cache, read with ``torch.load``.

Each restart runs ``--repeat`` times (medians). Per restart: the seconds from the launch of
the processes to the last rank's state restored (interpreter, imports and gloo's
rendezvous included), and in each rank from before ``Checkpointer(...)`` (whose open
rebuilds) to after ``restore()``: the slowest rank's. The baseline ``memcpy`` is each rank
copying its part once into a fresh buffer
(``np.copy``: page faults included, as a restore into fresh buffers pays them) in the same
process, a moment after the restore; "vs memcpy" is the median over the restarts of the
slowest rank's open-to-restored over the slowest rank's memcpy (both are slowed alike when
the machine is busy). Every restored part is checked bit for bit against what was saved
(after timing).

Run: ``.venv/bin/python bench/bench_recovery.py --size 1GiB [--dir DIR] [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from _harness import (
    environment,
    format_table,
    free_port,
    import_cryosnap,
    print_load,
    scratch_dir,
    torchrun_env,
    write_json,
)

import_cryosnap()

from cryosnap.bench._config import parse_size  # noqa: E402
from cryosnap.bench._probes import drop_file_cache  # noqa: E402

WORLD = 2
STEPS = 2
HERE = Path(__file__).resolve()


# -- the ranks ------------------------------------------------------------------------------------


def _part(rank: int, step: int, nbytes: int) -> Any:
    import numpy as np

    w = np.random.default_rng(rank).standard_normal(nbytes // 4, dtype=np.float32)
    w[: 1 << 16] += step  # what a training step changed
    return w


def _checkpointer(args: argparse.Namespace, rank: int) -> Any:
    import cryosnap

    base = Path(args.base)
    os.environ["CRYOSNAP_NODE"] = f"node-{rank}"
    os.environ["CRYOSNAP_MEMORY_ROOT"] = str(Path(args.shm) / f"node-{rank}")
    Path(os.environ["CRYOSNAP_MEMORY_ROOT"]).mkdir(parents=True, exist_ok=True)
    if args.level == "s3":
        return cryosnap.Checkpointer(
            f"s3://bench/run-{args.tag}",
            storage_options=_s3_options(args.endpoint),
            chunk_bytes=4 << 20,
        )
    return cryosnap.Checkpointer(
        base / "run",
        scratch=base / f"node-{rank}",
        partner=True,
        memory=3 * args.part,
        chunk_bytes=4 << 20,
    )


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    if args.role == "train":
        ckpt = _checkpointer(args, rank)
        for step in range(1, STEPS + 1):
            state = {"w": _part(rank, step, args.part), "step": step}
            ckpt.save(step, state)
        ckpt.wait()
        if args.level != "s3":
            torch.save({"w": torch.from_numpy(state["w"]), "step": STEPS}, _torch_file(args, rank))
        (out / f"rank-{rank}.json").write_text(json.dumps({"saved": STEPS}))
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    got: dict[str, Any] = {}
    if args.level == "torch":
        t0 = time.perf_counter()
        state = torch.load(_torch_file(args, rank))
        got["restore_s"] = time.perf_counter() - t0
        w = state["w"].numpy()
        got["from"] = "torch.load"
    else:
        t0 = time.perf_counter()
        ckpt = _checkpointer(args, rank)
        t1 = time.perf_counter()
        state = ckpt.restore()
        t2 = time.perf_counter()
        got.update(open_s=t1 - t0, restore_s=t2 - t0, read_s=t2 - t1, src=ckpt.restored_from)
        w = state["w"]
    got["restored_unix"] = time.time()
    dist.barrier()  # every rank restored: the restart is over
    got["all_restored_unix"] = time.time()
    t0 = time.perf_counter()
    copy = np.copy(w)
    got["memcpy_s"] = time.perf_counter() - t0
    got["same"] = bool(np.array_equal(w, _part(rank, STEPS, args.part))) and state["step"] == STEPS
    del copy
    (out / f"rank-{rank}.json").write_text(json.dumps(got))
    sys.stdout.flush()
    # Killed again: the memory level stays for the next restart (a close would remove it).
    os.kill(os.getpid(), signal.SIGKILL)


def _torch_file(args: argparse.Namespace, rank: int) -> Path:
    return Path(args.base) / f"torch-rank-{rank}.pt"


# -- moto -----------------------------------------------------------------------------------------

_SERVER = """
import os, sys, threading
from moto.server import main

def orphaned():
    sys.stdin.buffer.read()
    os._exit(0)

threading.Thread(target=orphaned, daemon=True).start()
main(["-H", "127.0.0.1", "-p", sys.argv[1]])
"""


def _s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """moto's server on a free loopback port, as tests/integration/conftest.py starts it
    (it exits when this process goes away: its stdin closes)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    endpoint = f"http://127.0.0.1:{port}"
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(port)],
            stdin=subprocess.PIPE,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with opener.open(endpoint + "/moto-api/", timeout=1):
                break
        except OSError:
            time.sleep(0.2)
    else:
        raise SystemExit("moto did not start: " + log.read_text()[-2000:])
    import s3fs

    # us-east-1 takes no LocationConstraint (which S3FileSystem.mkdir would send).
    s3fs.S3FileSystem(**_s3_options(endpoint)).call_s3("create_bucket", Bucket="bench")
    return proc, endpoint


# -- the driver -----------------------------------------------------------------------------------


def launch(args: argparse.Namespace, role: str, level: str, out: Path) -> list[dict[str, Any]]:
    """Start the ``WORLD`` ranks; every one must end by SIGKILL (its own). Their reports."""
    out.mkdir(parents=True)
    port = free_port()
    cmd = [
        sys.executable,
        str(HERE),
        "--rank-role",
        role,
        "--level",
        level,
        "--out",
        str(out),
        "--base",
        str(args.base),
        "--shm",
        str(args.shm),
        "--part",
        str(args.part),
        "--endpoint",
        args.endpoint or "",
        "--tag",
        args.tag,
    ]
    procs = [subprocess.Popen(cmd, env=torchrun_env(r, WORLD, port)) for r in range(WORLD)]
    for p in procs:
        code = p.wait(timeout=1800)
        if code != -signal.SIGKILL:
            for q in procs:
                q.kill()
            raise SystemExit(f"a rank of {role}/{level} exited {code}, not by its SIGKILL")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]


def restart(args: argparse.Namespace, level: str, out: Path, before: Any = None) -> dict[str, Any]:
    """``--repeat`` restarts from ``level`` (``before()`` first, each time: what is lost);
    the medians of each figure, and the restore to memcpy ratio of each restart (both taken
    in the same processes, a moment apart) as its median."""
    runs = []
    for i in range(args.repeat):
        if before is not None:
            before()
        t0 = time.time()
        got = launch(args, "restore", level, out / str(i))
        assert all(g["same"] for g in got), f"{level}: a restored part differs"
        runs.append(
            {
                "from": [g.get("src", g.get("from", "")) for g in got],
                "restart_to_restored_s": max(g["restored_unix"] for g in got) - t0,
                "open_to_restored_s": max(g["restore_s"] for g in got),
                "open_s": max(g.get("open_s", 0.0) for g in got),
                "memcpy_s": max(g["memcpy_s"] for g in got),
            }
        )
    row: dict[str, Any] = {"level": level, "from": runs[0]["from"], "runs": runs}
    for key in ("restart_to_restored_s", "open_to_restored_s", "open_s", "memcpy_s"):
        row[key] = statistics.median(r[key] for r in runs)
    row["vs_memcpy"] = statistics.median(r["open_to_restored_s"] / r["memcpy_s"] for r in runs)
    return row


def measure(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    base, shm = Path(args.base), Path(args.shm)
    launch(args, "train", "disk", work / "train")
    rows = [restart(args, "memory", work / "r-memory")]

    def lose_node_0() -> None:
        shutil.rmtree(shm / "node-0")

    rows.append(restart(args, "partner-memory", work / "r-partner", lose_node_0))

    def lose_memory() -> None:
        shutil.rmtree(shm, ignore_errors=True)
        for rank in range(WORLD):
            drop_file_cache(base / f"node-{rank}")

    rows.append(restart(args, "scratch", work / "r-scratch", lose_memory))

    def lose_scratch() -> None:
        shutil.rmtree(shm, ignore_errors=True)
        for rank in range(WORLD):
            shutil.rmtree(base / f"node-{rank}", ignore_errors=True)
        drop_file_cache(base / "run")

    rows.append(restart(args, "persistent", work / "r-persistent", lose_scratch))

    def cold_torch() -> None:
        for rank in range(WORLD):
            drop_file_cache(_torch_file(args, rank))

    rows.append(restart(args, "torch", work / "r-torch", cold_torch))
    if not args.no_s3:
        proc, args.endpoint = start_moto(work / "moto.log")
        try:
            launch(args, "train", "s3", work / "train-s3")
            rows.append(restart(args, "s3", work / "r-s3"))
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.kill()
            proc.wait()
    shutil.rmtree(shm, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1GiB", help="the state of both ranks together")
    parser.add_argument("--dir", default=None, help="where the run and scratch go (a disk)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 level (no moto)")
    parser.add_argument("--repeat", type=int, default=3, help="restarts per level (medians)")
    # The ranks' own arguments (set by the driver).
    parser.add_argument("--rank-role", dest="role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--level", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--base", default="", help=argparse.SUPPRESS)
    parser.add_argument("--shm", default="", help=argparse.SUPPRESS)
    parser.add_argument("--part", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        rank_main(args)
        return
    size = parse_size(args.size)
    args.part = size // WORLD // 4 * 4
    args.tag = str(os.getpid())
    before = os.getloadavg()[0]
    with scratch_dir("cryosnap-recovery-", args.dir) as work:
        args.base = str(work / "job")
        args.shm = f"/dev/shm/cryosnap-bench-recovery-{os.getpid()}"
        try:
            rows = measure(args, work)
        finally:
            shutil.rmtree(args.shm, ignore_errors=True)
    print_load(before, os.getloadavg()[0])
    table = [
        [
            r["level"],
            "/".join(r["from"]),
            f"{r['restart_to_restored_s']:.2f}",
            f"{r['open_to_restored_s']:.3f}",
            f"{r['open_s']:.3f}",
            f"{r['memcpy_s']:.3f}",
            f"{r['vs_memcpy']:.2f}x",
        ]
        for r in rows
    ]
    print(f"state {args.size} on {WORLD} ranks; medians of {args.repeat} restarts per level")
    print(
        format_table(
            [
                "restart from",
                "each rank's part from",
                "restart->restored s",
                "open->restored s",
                "of which open s",
                "memcpy s",
                "vs memcpy",
            ],
            table,
        )
    )
    write_json(args.json, {"environment": environment(size=args.size), "rows": rows})


if __name__ == "__main__":
    main()
