"""Distributed saves of a replicated state at 1, 2 and 4 ranks: cryosnap beside DCP (issue #12).

Every rank (a process started by this script with torchrun's environment: ``MASTER_ADDR`` =
127.0.0.1, a free port, ``RANK``, ``WORLD_SIZE``, gloo on ``lo``, ``OMP_NUM_THREADS=1``) holds
the same replicated state, ``--mib`` MiB of fp32 in 8 tensors of mixed sizes built from one
seed (a model under data parallelism), plus a 64 KiB leaf of its own. Per world size N, in one
launch of N processes, ``--warmup`` untimed rounds (default 1: the first save of a process pays
for first-touch memory, lazy imports and thread start-up) and ``--repeat`` timed rounds run these
peers, the first peer rotating each round:

- **cryosnap**: ``with Checkpointer(dir, chunk_bytes=1 MiB) as ckpt`` in a fresh directory,
  ``ckpt.save(0, state, replicated=["model"])`` (a full version: stall = the ``save`` call,
  ``SaveInfo.stall_seconds``; durable = until ``result()`` returns; the first save of a
  Checkpointer also allocates its staging pool, as big as the state), then, in the same
  Checkpointer, ``save(1, ...)`` after every 1 MiB chunk of the replicated state changed (one
  element each: a full version's bytes, the pool reused, as in every later save of a run) and
  ``save(2, ...)`` after 1% of them changed (the same chunks on every rank): incremental.
- **DCP save**: ``torch.distributed.checkpoint.save`` of the same tensors with
  ``FileSystemWriter(dir, sync_files=True)`` on the gloo world group (stall = durable = until
  it returns). Its default planner de-duplicates tensors saved under the same key by every
  rank; bytes per rank are the sizes of the ``__{rank}_*.distcp`` files it wrote (rank 0 also
  writes ``.metadata``, counted apart).
- **DCP async_save**: the same through ``async_save`` (its staging copy is the stall, its
  Future's ``result()`` is durable).

Each timed save starts after ``gc.collect()``, ``os.sync()`` (rank 0; it syncs the machine) and a
barrier, and each directory is deleted right after its round. Figures per round are the maximum
over the ranks (the job waits for its slowest rank), then the median over the rounds. Once per N,
the last rank's part of cryosnap's 1% version is loaded (``cryosnap.load(dir, rank=N-1)``)
and compared bit for bit with the state, and at N > 1 rank 0 also restores the replicated keys at
another world size (a Checkpointer with a ``LocalCoordinator``, ``restore(replicated_only=True)``).

With ``--scratch`` a fourth peer runs: ``Checkpointer(dir, scratch=..., chunk_bytes=1 MiB)``, a
full version on each rank's node-local scratch (its whole part) and then, per rank, on the
persistent level (the replicated state split again); "durable" is until it is on the persistent
level, "on scratch" until durable there, "written" the rank's data on the persistent level.

For cryosnap the table also shows the bytes each save copied out of the program's memory
(``SaveInfo.captured_bytes``, the most of any rank): a rank copies its own share of the
replicated state and hashes the rest in place.

Per-rank figures travel through JSON files in a temporary folder; the parent prints a table and
writes every sample with ``--json FILE``. Nothing is asserted: the byte split (each rank's share
of a full version within +-10% of 1/N of the state) is printed as PASS / FAIL.

Run: ``.venv/bin/python bench/bench_dist.py --ranks 1 2 4 --mib 512 --repeat 2 --json out.json``
(``--mib 16`` for a smoke run of a minute). Each rank holds the state, cryosnap's staging copy and
DCP's, so 4 ranks of 512 MiB need ~6-8 GiB of memory. As with the other scripts, benchmark a
frozen copy of ``src/`` when others are editing it (``PYTHONPATH=/tmp/snap``; the ranks inherit
the environment, and the JSON names the cryosnap used).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _harness as h

HERE = Path(__file__).resolve()
PEERS = ("cryosnap", "dcp_save", "dcp_async")
LABELS = {
    "cryosnap": "cryosnap full",
    "cryosnap_all": "cryosnap 100% changed",
    "cryosnap_incr": "cryosnap 1% changed",
    "dcp_save": "DCP save",
    "dcp_async": "DCP async_save",
    "cryosnap_scratch": "cryosnap scratch -> persistent",
}
CHUNK_BYTES = 1 << 20
# The saves after the full one, in the same Checkpointer: every chunk changed (a full version's
# bytes with the staging pool already allocated, as for every save after a run's first), then 1%.
CHANGED = {"cryosnap_all": 1.0, "cryosnap_incr": 0.01}
OWN_BYTES = 64 << 10  # each rank's own leaf, not replicated
SEED = 20240612
# Relative sizes of the 8 replicated [rows x 1024] matrices: mixed, as a model's are (the cut of
# the replicated bytes among the ranks then falls inside tensors, not between them).
TENSOR_WEIGHTS = (8, 8, 4, 4, 2, 2, 1, 1)
COLS = 1024
LAUNCH_TIMEOUT_S = 3600.0
GLOO_TIMEOUT_S = 1800.0


# -- the ranks' side -----------------------------------------------------------------------------


def build_state(mib: int, rank: int) -> dict[str, Any]:
    """The replicated model (identical on every rank: one seed) and this rank's own leaf."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    total_rows = mib * (1 << 20) // (4 * COLS)
    weight_sum = sum(TENSOR_WEIGHTS)
    rows = [max(1, total_rows * w // weight_sum) for w in TENSOR_WEIGHTS]
    rows[0] += total_rows - sum(rows)  # the state is exactly --mib MiB
    model = {f"layers.{i}.weight": torch.randn(r, COLS, generator=gen) for i, r in enumerate(rows)}
    return {"model": model, "own": own_leaf(rank)}


def own_leaf(rank: int) -> Any:
    import torch

    return torch.randn(OWN_BYTES // 4, generator=torch.Generator().manual_seed(SEED + 1 + rank))


def change_chunks(model: dict[str, Any], fraction: float, round_no: int) -> int:
    """Add 1 to one element in ``fraction`` of the 1 MiB chunks (the same chunks on every rank:
    one seed); the number of chunks changed."""
    import numpy as np

    chunks = [
        (name, c)
        for name, t in model.items()
        for c in range(-(-t.numel() * t.element_size() // CHUNK_BYTES))
    ]
    count = max(1, round(fraction * len(chunks)))
    rng = np.random.default_rng(SEED + round_no)
    for i in rng.choice(len(chunks), size=count, replace=False):
        name, c = chunks[int(i)]
        model[name].view(-1)[c * CHUNK_BYTES // 4] += 1.0
    return count


def dcp_state(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """The same tensors for DCP; the own leaf under a key of this rank's (DCP treats a key that
    several ranks save as one replicated tensor and writes it once)."""
    return {"model": state["model"], "own": {f"rank{rank}": state["own"]}}


class Rank:
    """One rank's side of a launch: the process group, timed saves, the figures it reports."""

    def __init__(self, config: dict[str, Any]) -> None:
        import torch.distributed as dist

        self.dist = dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.config = config
        self.root = Path(config["work"])
        self.state = build_state(config["mib"], self.rank)
        self.samples: list[dict[str, Any]] = []
        self.checks: dict[str, Any] = {}

    def settle(self) -> None:
        """Start a timed save together, on a synced disk, without another save's garbage."""
        gc.collect()
        if self.rank == 0:
            h.settle_disk()
        self.dist.barrier()

    def done_with(self, path: Path) -> None:
        """Every rank finished with ``path``: rank 0 removes it."""
        self.dist.barrier()
        if self.rank == 0:
            h.rmtree(path)
        self.dist.barrier()

    def record(self, peer: str, round_no: int, **figures: Any) -> None:
        if round_no < self.config["warmup"]:
            return  # a warm-up round: first-touch of memory, lazy imports, thread start-up
        timed_round = round_no - self.config["warmup"]
        self.samples.append({"peer": peer, "round": timed_round, "rank": self.rank, **figures})

    def run(self) -> None:
        savers: dict[str, Callable[[int], None]] = {
            "cryosnap": self.cryosnap,
            "dcp_save": self.dcp_save,
            "dcp_async": self.dcp_async,
            "cryosnap_scratch": self.cryosnap_scratch,
        }
        peers = (*PEERS, "cryosnap_scratch") if self.config.get("scratch") else PEERS
        for round_no in range(self.config["warmup"] + self.config["repeat"]):
            shift = round_no % len(peers)
            for peer in peers[shift:] + peers[:shift]:
                savers[peer](round_no)
        out = Path(self.config["out"]) / f"rank-{self.rank}.json"
        out.write_text(json.dumps({"samples": self.samples, "checks": self.checks}))
        self.dist.barrier()
        self.dist.destroy_process_group()

    # cryosnap ------------------------------------------------------------------------------------
    def cryosnap(self, round_no: int) -> None:
        import cryosnap

        run = self.root / f"cryosnap-{round_no}"
        with cryosnap.Checkpointer(run, chunk_bytes=CHUNK_BYTES) as ckpt:
            self.settle()
            figures = self.timed_cryosnap(ckpt, 0)
            self.record("cryosnap", round_no, **figures, **self.cryosnap_files(run, 0))
            for step, (peer, fraction) in enumerate(CHANGED.items(), start=1):
                changed = change_chunks(self.state["model"], fraction, round_no)
                self.settle()
                figures = {**self.timed_cryosnap(ckpt, step), **self.cryosnap_files(run, step)}
                self.record(peer, round_no, chunks_changed=changed, **figures)
        if round_no == self.config["warmup"]:
            self.dist.barrier()  # every Checkpointer closed: the run's lock is free
            self.check_restore(run)
        self.done_with(run)

    def cryosnap_scratch(self, round_no: int) -> None:
        """A full version through node-local scratch (each rank's whole part) and the flush
        per rank into the persistent level (the replicated state split again)."""
        import cryosnap

        run, scratch = self.root / f"cryosnap-p-{round_no}", self.root / f"scratch-{round_no}"
        with cryosnap.Checkpointer(run, scratch=scratch, chunk_bytes=CHUNK_BYTES) as ckpt:
            self.settle()
            c0, t0 = time.process_time(), time.perf_counter()
            pending = ckpt.save(0, self.state, replicated=["model"])
            on_scratch = pending.result(tier="scratch")
            t1 = time.perf_counter()
            info = pending.result(tier="persistent")
            t2, cpu = time.perf_counter(), time.process_time() - c0
        persistent = run.glob(f"data/{0:012d}-r{self.rank:05d}-*.dat")
        self.record(
            "cryosnap_scratch",
            round_no,
            stall_s=info.stall_seconds,
            scratch_s=t1 - t0,
            durable_s=t2 - t0,
            cpu_s=cpu,
            # This rank's data on the persistent level (its share); on scratch, its whole part.
            written_bytes=sum(f.stat().st_size for f in persistent),
            scratch_bytes=on_scratch.written_bytes,
            captured_bytes=info.captured_bytes,
        )
        self.done_with(run)
        self.done_with(scratch)

    def timed_cryosnap(self, ckpt: Any, step: int) -> dict[str, Any]:
        c0, t0 = time.process_time(), time.perf_counter()
        pending = ckpt.save(step, self.state, replicated=["model"])
        t1 = time.perf_counter()
        info = pending.result()
        t2 = time.perf_counter()
        return {
            "cpu_s": time.process_time() - c0,
            "save_call_s": t1 - t0,
            "stall_s": info.stall_seconds,
            "durable_s": t2 - t0,
            "info_seconds": info.seconds,
            "written_bytes": info.written_bytes,
            "captured_bytes": info.captured_bytes,
            "logical_bytes": info.logical_bytes,
            "new_chunks": info.new_chunks,
            "incremental": info.incremental,
        }

    def cryosnap_files(self, run: Path, step: int) -> dict[str, int]:
        """What this rank's part of ``step`` put on disk: its data files and its manifest (a
        cross-check of ``SaveInfo.written_bytes``; docs/FORMAT.md names them)."""
        data = run.glob(f"data/{step:012d}-r{self.rank:05d}-*.dat")
        manifest = run / "versions" / f"{step:012d}" / f"rank-{self.rank:05d}.json"
        return {
            "file_bytes": sum(f.stat().st_size for f in data),
            "manifest_bytes": manifest.stat().st_size,
        }

    def check_restore(self, run: Path) -> None:
        """Bit for bit: the last rank's part read by rank 0 (any process reads any part), and at
        N > 1 the replicated keys restored on a world of one."""
        import torch

        import cryosnap
        from cryosnap.dist import LocalCoordinator

        if self.rank != 0:
            return
        last = self.world - 1
        part = cryosnap.load(run, step=len(CHANGED), rank=last)
        own = own_leaf(last)
        model = self.state["model"]
        same = part.keys() == {"model", "own"} and torch.equal(part["own"], own)
        same = same and part["model"].keys() == model.keys()
        same = same and all(torch.equal(part["model"][k], t) for k, t in model.items())
        self.checks["load_rank"] = {"rank": last, "bitwise_equal": bool(same)}
        if self.world > 1:
            with cryosnap.Checkpointer(run, comm=LocalCoordinator()) as ckpt:
                got = ckpt.restore(replicated_only=True)
            equal = got.keys() == {"model"} and all(
                torch.equal(got["model"][k], t) for k, t in model.items()
            )
            self.checks["replicated_only_world_1"] = {"bitwise_equal": bool(equal)}

    # DCP -----------------------------------------------------------------------------------------
    def dcp_save(self, round_no: int) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        path = self.root / f"dcp-{round_no}"
        state = dcp_state(self.state, self.rank)
        self.settle()
        c0, t0 = time.process_time(), time.perf_counter()
        save(state, storage_writer=FileSystemWriter(path, sync_files=True))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.dist.barrier()
        figures = {"stall_s": seconds, "durable_s": seconds, "cpu_s": cpu}
        self.record("dcp_save", round_no, **figures, **self.dcp_files(path))
        self.done_with(path)

    def dcp_async(self, round_no: int) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

        path = self.root / f"dcp-async-{round_no}"
        state = dcp_state(self.state, self.rank)
        self.settle()
        c0, t0 = time.process_time(), time.perf_counter()
        result = async_save(state, storage_writer=FileSystemWriter(path, sync_files=True))
        if isinstance(result, AsyncSaveResponse):
            result.staging_completion.result()  # the state may change only after staging
            upload = result.upload_completion
        else:
            upload = result
        stall = time.perf_counter() - t0
        upload.result()
        durable, cpu = time.perf_counter() - t0, time.process_time() - c0
        self.dist.barrier()
        figures = {"stall_s": stall, "durable_s": durable, "cpu_s": cpu}
        self.record("dcp_async", round_no, **figures, **self.dcp_files(path))
        self.done_with(path)

    def dcp_files(self, path: Path) -> dict[str, int]:
        """What DCP wrote for this rank: its ``__{rank}_*.distcp`` files (and ``.metadata``)."""
        written = sum(f.stat().st_size for f in path.glob(f"__{self.rank}_*.distcp"))
        meta = path / ".metadata"
        metadata = meta.stat().st_size if self.rank == 0 and meta.exists() else 0
        return {"written_bytes": written, "metadata_bytes": metadata}


def worker(config_path: str) -> None:
    import warnings

    # DCP warns about its planner's defaults and future changes on every call.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    Rank(json.loads(Path(config_path).read_text())).run()


# -- the parent: launches, table, JSON ----------------------------------------------------------


def launch(world: int, config: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    """Run every round at ``world`` ranks; what each rank reported, by rank."""
    out = tmp / f"world-{world}"
    work = tmp / f"work-{world}"
    out.mkdir()
    work.mkdir()
    config_path = out / "config.json"
    config_path.write_text(json.dumps({**config, "out": str(out), "work": str(work)}))
    port = h.free_port()
    procs, logs = [], []
    for rank in range(world):
        env = h.torchrun_env(rank, world, port)
        log = (out / f"rank-{rank}.log").open("w")
        logs.append(log)
        cmd = [sys.executable, str(HERE), "--worker", str(config_path)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        _wait_all(procs, out)
    finally:
        for log in logs:
            log.close()
        h.rmtree(work)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], out: Path) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    failed: list[int] = []
    for rank, p in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            p.wait()
        if p.returncode != 0:
            failed.append(rank)
            for q in procs:  # one rank failed: the others would wait at a barrier
                if q.poll() is None:
                    q.kill()
    if failed:
        for rank in failed:
            text = (out / f"rank-{rank}.log").read_text()
            print(f"--- rank {rank} exited {procs[rank].returncode}:\n{text[-4000:]}")
        raise SystemExit(f"ranks {failed} failed")


def per_round(samples: list[dict[str, Any]], peer: str, field: str) -> list[list[float]]:
    """``field`` of ``peer`` per round, one value per rank."""
    rounds: dict[int, list[float]] = {}
    for s in samples:
        if s["peer"] == peer:
            rounds.setdefault(s["round"], []).append(s[field])
    return [rounds[r] for r in sorted(rounds)]


def summarize(world: int, ranks: list[dict[str, Any]], state_bytes: int) -> list[dict[str, Any]]:
    samples = [s for r in ranks for s in r["samples"]]
    rows = []
    for peer in LABELS:
        stall = per_round(samples, peer, "stall_s")
        if not stall:
            continue
        durable = per_round(samples, peer, "durable_s")
        cpu = per_round(samples, peer, "cpu_s")
        written = per_round(samples, peer, "written_bytes")
        copied = [
            s["captured_bytes"] for s in samples if s["peer"] == peer and "captured_bytes" in s
        ]
        on_scratch = per_round(samples, peer, "scratch_s") if peer == "cryosnap_scratch" else []
        share = state_bytes / world
        rows.append(
            {
                "world": world,
                "peer": peer,
                "stall_s": h.median([max(r) for r in stall]),
                "durable_s": h.median([max(r) for r in durable]),
                "stall_s_rounds": [max(r) for r in stall],
                "durable_s_rounds": [max(r) for r in durable],
                "cpu_s": h.median([max(r) for r in cpu]),
                "cpu_s_all_ranks": h.median([sum(r) for r in cpu]),
                "written_min": min(min(r) for r in written),
                "written_max": max(max(r) for r in written),
                "share_min": min(min(r) for r in written) / share,
                "share_max": max(max(r) for r in written) / share,
                "written_total_over_state": h.median([sum(r) / state_bytes for r in written]),
                # Bytes the save copied out of the program's memory, the most of any rank.
                "copied_max": max(copied) if copied else None,
                # With scratch: until durable on it (durable_s: on the persistent level).
                "scratch_s": h.median([max(r) for r in on_scratch]) if on_scratch else None,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "N",
        "peer",
        "stall s",
        "durable s",
        "on scratch s",
        "CPU s/rank",
        "all ranks",
        "copied/rank max",
        "written/rank min",
        "max",
        "% of state/N",
        "written all / state",
    ]
    body = [
        [
            str(r["world"]),
            LABELS[r["peer"]],
            f"{r['stall_s']:.3f}",
            f"{r['durable_s']:.3f}",
            "-" if r.get("scratch_s") is None else f"{r['scratch_s']:.3f}",
            f"{r['cpu_s']:.2f}",
            f"{r['cpu_s_all_ranks']:.2f}",
            "-" if r.get("copied_max") is None else h.format_bytes(r["copied_max"]),
            h.format_bytes(r["written_min"]),
            h.format_bytes(r["written_max"]),
            f"{100 * r['share_min']:.1f}-{100 * r['share_max']:.1f}",
            f"{r['written_total_over_state']:.3f}",
        ]
        for r in rows
    ]
    return h.format_table(headers, body)


def split_check(rows: list[dict[str, Any]], own_share: dict[int, float]) -> h.Check:
    """Each rank's share of a cryosnap full version within +-10% of 1/N of the state (its own
    leaf set aside)."""
    full = [r for r in rows if r["peer"] == "cryosnap"]
    worst = max(
        abs(x - own_share[r["world"]] - 1) for r in full for x in (r["share_min"], r["share_max"])
    )
    detail = ", ".join(
        f"N={r['world']}: {100 * r['share_min']:.1f}-{100 * r['share_max']:.1f}%" for r in full
    )
    return h.Check("cryosnap bytes per rank = 1/N of the state +-10%", worst <= 0.10, detail)


def files_check(raw: dict[str, Any]) -> h.Check:
    """cryosnap's ``SaveInfo.written_bytes`` against the data files each rank's part created."""
    samples = [
        (world, s)
        for world, ranks in raw.items()
        for r in ranks
        for s in r["samples"]
        if "file_bytes" in s
    ]
    off = [(w, s) for w, s in samples if s["written_bytes"] != s["file_bytes"]]
    detail = f"{len(samples) - len(off)} of {len(samples)} saves equal" + "".join(
        f"; N={w} {s['peer']} round {s['round']} rank {s['rank']}: "
        f"{s['written_bytes']} vs {s['file_bytes']}"
        for w, s in off[:3]
    )
    return h.Check("written_bytes = bytes of the rank's data files", not off, detail)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes")
    p.add_argument("--mib", type=int, default=512, help="replicated state, MiB (default 512)")
    p.add_argument("--repeat", type=int, default=2, help="timed rounds per N (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    p.add_argument("--dir", type=Path, default=None, help="where the temporary folder goes")
    p.add_argument("--json", type=Path, default=None, help="write every sample to this file")
    p.add_argument(
        "--scratch",
        action="store_true",
        help="also a Checkpointer with node-local scratch per rank, flushed to the persistent "
        "level (durable = on persistent; written = the rank's persistent share)",
    )
    args = p.parse_args(argv)
    if args.mib < 1 or args.repeat < 1 or args.warmup < 0 or any(n < 1 for n in args.ranks):
        p.error("--mib, --repeat and --ranks take positive integers, --warmup 0 or more")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    state_bytes = args.mib << 20
    config = {"mib": args.mib, "repeat": args.repeat, "warmup": args.warmup}
    config["scratch"] = args.scratch
    info = h.environment()
    load_before = h.load_average()
    started = time.monotonic()
    print(
        f"bench_dist: {args.mib} MiB replicated (8 fp32 tensors) + {OWN_BYTES >> 10} KiB per rank, "
        f"ranks {args.ranks}, {args.warmup} untimed + {args.repeat} timed rounds; "
        f"{info['cpus']} CPUs, load {load_before:.2f}; cryosnap {info['cryosnap']}"
    )
    rows: list[dict[str, Any]] = []
    raw: dict[str, Any] = {}
    with h.scratch_dir("bench-dist-", args.dir) as tmp:
        for world in args.ranks:
            t0 = time.monotonic()
            ranks = launch(world, config, tmp)
            raw[str(world)] = ranks
            got = summarize(world, ranks, state_bytes)
            rows.extend(got)
            checks = ranks[0]["checks"]
            print(f"N={world}: {time.monotonic() - t0:.0f} s; checks {json.dumps(checks)}")
    print()
    print(table(rows))
    own_share = {n: OWN_BYTES / (state_bytes / n) for n in args.ranks}
    check = split_check(rows, own_share)
    restore_ok = all(
        c.get("bitwise_equal", False) for ranks in raw.values() for c in ranks[0]["checks"].values()
    )
    restore = h.Check("restores bit for bit", restore_ok, "load(rank=N-1); replicated_only at 1")
    honest = files_check(raw)
    print()
    for c in (check, restore, honest):
        print(c.line())
    load_after = h.load_average()
    print(
        "stall, durable, CPU s/rank: max over ranks (CPU: the process's, from the save call "
        f"until durable; all ranks: their sum), median of {args.repeat} rounds; written: per "
        f"rank, every round. {time.monotonic() - started:.0f} s in all"
    )
    h.print_load(load_before, load_after)
    doc = {
        "environment": info,
        "config": {**config, "ranks": args.ranks, "chunk_bytes": CHUNK_BYTES},
        "load_average": [load_before, load_after],
        "rows": rows,
        "checks": [c.line() for c in (check, restore, honest)],
        "ranks": raw,
    }
    h.write_json(args.json, doc)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        main()
