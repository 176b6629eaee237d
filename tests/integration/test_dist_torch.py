"""TorchCoordinator with real processes: torch.distributed over gloo on the loopback interface.

Each test starts 2 or 3 processes running this file as a script (``python test_dist_torch.py
SCENARIO OUT_DIR``) with the environment torchrun would give them (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``); each rank writes what it saw to ``OUT_DIR/rank-N.json``
and the test checks it. A scenario that raises makes its process exit non-zero.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import forkserver

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
TIMEOUT = 30.0  # collectives of the healthy scenarios (a hang guard, never reached)
SHORT = 1.0  # collectives that are meant to time out


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range: a port the kernel hands
    out (``bind(0)``) may be handed out again to any connection (gloo's among them, in the
    other tests' processes) before rank 0 listens on it (EADDRINUSE, seen in CI); one below
    that range is only taken by whoever asks for it by number."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()  # not the tests' seeded one: xdist workers must not pick alike
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every pick taken: what the kernel hands out
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    scenario: str,
    world: int,
    out: Path,
    *args: str,
    killed: frozenset[int] = frozenset(),
    script: Path = HERE,
    timeout: float = 180,
    elastic: bool = False,
) -> list[dict[str, Any]]:
    """Run ``script scenario out *args`` on ``world`` processes; what each rank reported, by
    rank (the ranks in ``killed`` SIGKILL themselves and report nothing). ``elastic``: the
    whole environment torchrun gives (``LOCAL_RANK``, ``TORCHELASTIC_RUN_ID``...), by which
    Lightning knows that the processes are launched for it."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            # The scripts import tests.integration's support modules, as the tests do.
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
        if elastic:
            env.update(
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world),
                GROUP_RANK="0",
                TORCHELASTIC_RUN_ID=f"cryosnap-{port}",
            )
        procs.append(
            forkserver.start(
                [str(script), scenario, str(out), *args], env, log=out / f"rank-{rank}"
            )
        )
    codes = forkserver.wait_all(procs, timeout)
    for rank, (p, code) in enumerate(zip(procs, codes, strict=True)):
        expected = -signal.SIGKILL if rank in killed else 0
        assert code == expected, f"rank {rank} exited {code}:\n{p.output()}"
    return [
        json.loads((out / f"rank-{r}.json").read_text()) if r not in killed else {}
        for r in range(world)
    ]


def state_of(rank: int, step: int) -> dict[str, Any]:
    rng = np.random.default_rng(rank)
    w = rng.standard_normal(16 << 10).astype(np.float32)
    w[: 1024 * (step % 4)] += step  # a sparse change per step: incremental versions
    return {"w": w, "rank": rank, "step": step}


# What each rank receives in the "exchange" scenario, by channel: (source, bytes) by receiver.
# Rank 0 sends 64 MiB + 3 bytes (callers window large files at 64 MiB); rank 2 sends to both
# others; on "bytes", one payload is empty and rank 1 sends to itself.
BIG = (64 << 20) + 3
EXCHANGED = {
    "main": [[(2, 5000)], [(0, BIG), (2, 7)], [(1, 1000)]],
    "bytes": [[(1, 10)], [(1, 3), (2, 20)], [(0, 0)]],
}


def payload(src: int, dst: int, nbytes: int) -> bytes:
    """A deterministic payload of its own for each (source, destination) pair."""
    return np.random.default_rng([src, dst]).bytes(nbytes)


def digest(data: bytes) -> list[Any]:
    return [len(data), hashlib.sha256(data).hexdigest()]


# -- the tests ----------------------------------------------------------------------------------


def test_collectives_of_three_processes(tmp_path: Path) -> None:
    results = launch("collectives", 3, tmp_path)
    for rank, got in enumerate(results):
        assert got["rank"] == rank and got["world"] == 3
        assert got["gathered"] == [{"rank": r, "pad": "x" * r} for r in range(3)]
        assert got["root"] == "from 1"
        # gather: everything on the root (unequal lengths, its own included), None elsewhere
        expected = [{"rank": r, "pad": "y" * (3 - r)} for r in range(3)] if rank == 2 else None
        assert got["gathered_to_2"] == expected
        assert got["agreed"] == 2 * 3
        assert got["side"] == [0, 10, 20] and got["cached"] is True
        # Two threads, each on its own channel, in opposite orders on different ranks.
        assert got["threads"] == {"a": [0, 1, 2], "b": [0, -1, -2]}
        assert "JSON-like" in got["not_json"]
    assert results[0]["subgroup"] == [0, 2, [0, 2], 2]
    assert results[2]["subgroup"] == [1, 2, [0, 2], 2]
    assert "not in group [0, 2]" in results[1]["subgroup"]


def test_exchange_of_three_processes(tmp_path: Path) -> None:
    results = launch("exchange", 3, tmp_path)
    for rank, got in enumerate(results):
        for channel in ("main", "bytes"):
            expected = {str(s): digest(payload(s, rank, n)) for s, n in EXCHANGED[channel][rank]}
            assert got[channel] == expected, (rank, channel)
        assert got["after"] == [0, 1, 2]


def test_a_rank_that_never_arrives_or_died_is_an_error_on_the_others(tmp_path: Path) -> None:
    survivor, _ = launch("dead", 2, tmp_path)
    assert survivor["absent"].startswith("CoordinationError: rank 0/2: barrier 1 on channel")
    assert "'main/late'" in survivor["absent"]
    assert survivor["dead"].startswith("CoordinationError: rank 0/2: all_gather 1 on channel")
    assert "'main/gone'" in survivor["dead"]
    assert survivor["dead_exchange"].startswith("CoordinationError: rank 0/2: exchange 1 on")
    assert "'main/gone-bytes'" in survivor["dead_exchange"]


def test_a_rank_killed_between_saves_fails_the_next_version_on_the_survivor(
    tmp_path: Path,
) -> None:
    from cryosnap import engine
    from cryosnap.storage import LocalStore

    survivor, _ = launch("killed", 2, tmp_path, killed=frozenset({1}))
    assert survivor["error"].startswith("CoordinationError: rank 0/2: gather")
    assert "'main/writer'" in survivor["error"]
    # Step 1 never became visible; step 0 is intact and loads.
    assert survivor["steps"] == [0] == engine.list_steps(LocalStore(tmp_path / "run"))


@pytest.mark.parametrize("comm", ["auto", "explicit"])
def test_a_checkpointer_on_every_rank(tmp_path: Path, comm: str) -> None:
    import cryosnap
    from cryosnap import engine
    from cryosnap._format.keys import manifest_key
    from cryosnap.storage import LocalStore

    results = launch(f"checkpointer-{comm}", 2, tmp_path)
    run = tmp_path / "run"
    store = LocalStore(run)
    assert engine.list_steps(store) == [3, 4, 5]
    record = engine.read_commit(store, 5)
    assert record.world_size == 2
    assert [m.key for m in record.manifests] == [manifest_key(5, r) for r in range(2)]
    for rank, got in enumerate(results):
        assert got["coordinator"] == "TorchCoordinator"
        assert got["due"] == [0, 2, 4, 5]  # rank 0's policy (every 2), rank 1 preempted at 5
        assert got["incremental"][-1] and not got["incremental"][0]
        assert got["restored"] == 5
        assert "already open for writing" in got["second_writer"]
        for step in (3, 4, 5):
            part = cryosnap.load(run, step=step, rank=rank)
            np.testing.assert_array_equal(part["w"], state_of(rank, step)["w"])
            assert part["rank"] == rank


def test_a_rewind_supersedes_in_the_global_commit_of_two_processes(tmp_path: Path) -> None:
    from cryosnap import engine
    from cryosnap._format.keys import Lineage
    from cryosnap.storage import LocalStore

    results = launch("rewind", 2, tmp_path)
    for rank, got in enumerate(results):
        assert got["restored_t"] == 0
        assert got["steps"] == [1, 2, 3]
        assert got["reopened"] == [3, 1, 3 + 100.0 + rank]
        assert got["final"] == [1, 2, 3, 4]
    store = LocalStore(tmp_path / "run")
    assert engine.list_steps(store) == [1, 2, 3, 4]
    record = engine.read_commit(store, 4)
    assert record.world_size == 2 and record.lineage == Lineage(1, 2)


def test_replicated_state_is_written_once_split_across_two_processes(tmp_path: Path) -> None:
    import torch

    import cryosnap
    from cryosnap import engine
    from cryosnap.storage import LocalStore

    results = launch("replicated", 2, tmp_path)
    run = tmp_path / "run"
    model, _opt = _replicated_model()
    replicated = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    replicated *= 3  # the weights, Adam's exp_avg and exp_avg_sq (its 0-d steps left aside)
    shares = [got["written"][0] - 8000 for got in results]  # less each rank's own leaf
    assert abs(shares[0] - shares[1]) <= 0.1 * max(shares), shares
    assert replicated <= sum(shares) <= replicated + 4 * len(model.state_dict())
    # The sparse change: one chunk, written by the one rank whose share holds it.
    assert sorted(got["written"][1] for got in results) == [0, 4096]
    for rank, got in enumerate(results):
        assert got["diverged"].startswith("ReplicaDivergenceError: step 2: replicated leaf model/")
        assert "ranks [0] vs ranks [1]" in got["diverged"]
        assert got["steps"] == [0, 1]
        part = cryosnap.load(run, step=1, rank=rank)
        assert part["own"] == rank
        assert part["model"]["0.weight"][0, 0] == model.state_dict()["0.weight"][0, 0] + 1
        torch.testing.assert_close(part["model"]["2.weight"], model.state_dict()["2.weight"])
        engine.verify_part(LocalStore(run), 1, rank=rank)


def test_another_world_size_is_refused_on_every_process(tmp_path: Path) -> None:
    import cryosnap

    launch("worldsize-save", 2, tmp_path / "saved")
    run = tmp_path / "saved" / "run"
    with cryosnap.Checkpointer(run) as ckpt:  # a world of one: saved rank 1 left unread
        with pytest.raises(cryosnap.WorldSizeError, match="saved by 2 rank"):
            ckpt.restore()
        assert list(ckpt.restore(replicated_only=True)) == ["model"]
    for got in launch("worldsize-restore", 3, tmp_path / "saved"):
        assert got["error"] == "WorldSizeError"
        assert "saved by 2 rank(s) and 3 participant(s)" in got["message"]
        assert "rank 2 would have no part of it" in got["message"]
        assert got["replicated"] == ["model"]


def test_node_local_scratch_with_partner_copies_survives_a_wiped_node(tmp_path: Path) -> None:
    """Two processes on two "nodes" ($CRYOSNAP_NODE), each with its node's scratch: every
    version is on the rank's scratch, on its partner's, and (replicated state split) on the
    persistent level. Node 0's scratch is wiped and the newest version is taken from the
    persistent level: the restarted ranks get it back from the partner copy."""
    import shutil

    import cryosnap
    from cryosnap import engine
    from cryosnap._format.keys import commit_key
    from cryosnap.storage import LocalStore

    saved = launch("partner-save", 2, tmp_path)
    run = tmp_path / "run"
    for rank, got in enumerate(saved):
        assert got["tiers"] == ["scratch", "persistent"]
        own = tmp_path / f"node-{rank}" / f"rank-{rank:05d}"
        copy = tmp_path / f"node-{1 - rank}" / "partner" / f"rank-{rank:05d}"
        for where in (own, copy):
            assert engine.list_steps(LocalStore(where)) == [1, 2]
            assert cryosnap.load(where, step=2)["own"] == rank
        assert cryosnap.load(run, step=2, rank=rank)["own"] == rank
    # The persistent level holds the model once: each rank's first version is about half.
    record = engine.read_commit(LocalStore(run), 0)
    sizes = [(run / k).stat().st_size for k in record.data_files]
    assert len(sizes) == 2 and abs(sizes[0] - sizes[1]) <= 0.1 * max(sizes), sizes
    shutil.rmtree(tmp_path / "node-0")
    (run / commit_key(2)).unlink()
    restored = launch("partner-restore", 2, tmp_path / "restart")
    for rank, got in enumerate(restored):
        assert got["step"] == 2 and got["own"] == rank and got["same"]
        assert got["scratch"] == [1, 2]


# -- the ranks' side ------------------------------------------------------------------------------


def _init() -> tuple[int, int]:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    return dist.get_rank(), dist.get_world_size()


def _collectives(out: Path) -> dict[str, Any]:
    from cryosnap.dist import TorchCoordinator, agree

    rank, _ = _init()
    c = TorchCoordinator(timeout=TIMEOUT)
    got: dict[str, Any] = {"rank": c.rank, "world": c.world_size}
    got["gathered"] = c.all_gather({"rank": rank, "pad": "x" * rank})  # unequal lengths
    got["root"] = c.broadcast(f"from {rank}", root=1)
    got["gathered_to_2"] = c.gather({"rank": rank, "pad": "y" * (3 - rank)}, root=2)
    got["agreed"] = agree(c, rank * 3, max)
    c.barrier()
    side = c.channel("side")
    got["side"] = side.all_gather(rank * 10)
    got["cached"] = c.channel("side") is side
    a, b = c.channel("a"), c.channel("b")
    threads: dict[str, Any] = {}

    def on_a() -> None:
        threads["a"] = a.all_gather(rank)

    # Rank 0 starts "b" first, the others "a": one shared group would pair them wrongly.
    t = threading.Thread(target=on_a)
    if rank != 0:
        t.start()
    threads["b"] = b.all_gather(-rank)
    if rank == 0:
        t.start()
    t.join()
    got["threads"] = threads
    try:
        c.all_gather(object())
    except TypeError as exc:
        got["not_json"] = str(exc)
    got["subgroup"] = _subgroup(rank)
    return got


def _subgroup(rank: int) -> Any:
    """A coordinator of ranks 0 and 2 only: its members create its groups, rank 1 takes no part."""
    import torch.distributed as dist

    from cryosnap.dist import TorchCoordinator

    pair = dist.new_group([0, 2])  # the program's own group: every process creates it
    try:
        sub = TorchCoordinator(pair, timeout=TIMEOUT)
    except ValueError as exc:
        return str(exc)
    return [
        sub.rank,
        sub.world_size,
        sub.all_gather(rank),
        sub.channel("x").broadcast(rank, root=1),
    ]


def _exchange(out: Path) -> dict[str, Any]:
    from cryosnap.dist import TorchCoordinator

    rank, _ = _init()
    c = TorchCoordinator(timeout=TIMEOUT)
    side = c.channel("bytes")
    got: dict[str, Any] = {}
    for channel, coord in (("main", c), ("bytes", side)):
        sends = {
            dst: payload(src, dst, n)
            for dst, senders in enumerate(EXCHANGED[channel])
            for src, n in senders
            if src == rank
        }
        if rank == 1:  # a writable buffer is sent without a copy
            sends = {dst: bytearray(data) for dst, data in sends.items()}
        received = coord.exchange(sends)
        got[channel] = {str(src): digest(data) for src, data in received.items()}
    got["after"] = c.all_gather(rank)  # the exchange was one collective on each channel
    return got


def _dead(out: Path) -> dict[str, Any]:
    from cryosnap.dist import TorchCoordinator
    from cryosnap.errors import CoordinationError

    rank, _ = _init()
    c = TorchCoordinator(timeout=TIMEOUT)
    late, gone, gone_bytes = c.channel("late"), c.channel("gone"), c.channel("gone-bytes")
    c.barrier()
    got: dict[str, Any] = {}
    if rank == 1:
        # Never enters the barrier on "late"; exits once rank 0 reported it, without a word.
        while not (out / "absent-seen").exists():
            time.sleep(0.05)
        (out / "rank-1.json").write_text("{}")
        os._exit(0)
    try:
        late.barrier(timeout=SHORT)
    except CoordinationError as exc:
        got["absent"] = f"CoordinationError: {exc}"
    (out / "absent-seen").write_text("")
    try:
        gone.all_gather(rank, timeout=TIMEOUT)  # rank 1 is gone: its sockets closed
    except CoordinationError as exc:
        got["dead"] = f"CoordinationError: {exc}"
    try:
        gone_bytes.exchange({1: b"for a rank that is gone"}, timeout=TIMEOUT)
    except CoordinationError as exc:
        got["dead_exchange"] = f"CoordinationError: {exc}"
    return got


def _killed(out: Path) -> dict[str, Any]:
    import cryosnap

    rank, _ = _init()
    got: dict[str, Any] = {}
    with cryosnap.Checkpointer(out / "run", chunk_bytes=4096) as ckpt:
        ckpt.save(0, state_of(rank, 0)).result(timeout=TIMEOUT)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            ckpt.save(1, state_of(rank, 1)).result(timeout=TIMEOUT)
        except cryosnap.CheckpointError as exc:
            got["error"] = f"{type(exc).__name__}: {exc}"
        got["steps"] = ckpt.steps()
        np.testing.assert_array_equal(ckpt.restore(0)["w"], state_of(rank, 0)["w"])
    return got


def _checkpointer(out: Path, comm: str) -> dict[str, Any]:
    import cryosnap
    from cryosnap.dist import TorchCoordinator
    from cryosnap.errors import CheckpointError
    from cryosnap.policy import EveryNSteps

    rank, _ = _init()
    run = out / "run"

    def coordinator() -> TorchCoordinator | None:
        return None if comm == "auto" else TorchCoordinator(timeout=TIMEOUT)

    got: dict[str, Any] = {"due": [], "incremental": []}
    policy = EveryNSteps(2 if rank == 0 else 100)
    with cryosnap.Checkpointer(
        run, comm=coordinator(), chunk_bytes=4096, keep=3, policy=policy
    ) as ckpt:
        got["coordinator"] = type(ckpt.coordinator).__name__
        for step in range(6):
            if rank == 1 and step == 5:
                ckpt.preempted = True
            if ckpt.should_save(step):
                got["due"].append(step)
            # Every rank saves every step (the agreement above is checked, not used).
            info = ckpt.save(step, state_of(rank, step)).result(timeout=TIMEOUT)
            got["incremental"].append(info.incremental)
        try:
            cryosnap.Checkpointer(run, comm=coordinator())
        except CheckpointError as exc:
            got["second_writer"] = str(exc)
    with cryosnap.Checkpointer(run, comm=coordinator()) as ckpt:
        restored = ckpt.restore()
        assert restored["rank"] == rank
        got["restored"] = int(restored["step"])
    return got


def _replicated_model() -> tuple[Any, Any]:
    """The same small model and Adam state in every process (seeded), after one step."""
    import torch

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, w = torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen)
    (model(x) * w).sum().backward()
    opt.step()
    return model, opt


def _replicated(out: Path) -> dict[str, Any]:
    import torch

    import cryosnap

    rank, _ = _init()
    model, opt = _replicated_model()

    def state() -> dict[str, Any]:
        own = np.random.default_rng(rank).standard_normal(1000)  # 8000 bytes, this rank's
        return {"model": model, "optim": opt, "rng": own, "own": rank}

    got: dict[str, Any] = {"written": []}
    keys = ["model", "optim"]
    with cryosnap.Checkpointer(out / "run", chunk_bytes=4096) as ckpt:
        got["written"].append(ckpt.save(0, state(), replicated=keys).result().written_bytes)
        with torch.no_grad():
            model[0].weight[0, :4] += 1.0
        got["written"].append(ckpt.save(1, state(), replicated=keys).result().written_bytes)
        if rank == 1:
            with torch.no_grad():
                model[2].bias[0] += 1.0
        try:
            ckpt.save(2, state(), replicated=keys).result(timeout=TIMEOUT)
        except cryosnap.CheckpointError as exc:
            got["diverged"] = f"{type(exc).__name__}: {exc}"
        got["steps"] = ckpt.steps()
    return got


def _partner_state(rank: int, step: int) -> dict[str, Any]:
    model, _opt = _replicated_model()
    with __import__("torch").no_grad():
        model[0].weight[0, : step + 1] += 1.0
    return {"model": model.state_dict(), "own": rank, "step": step}


def _partner(out: Path, restart: bool) -> dict[str, Any]:
    import torch

    import cryosnap

    rank, _ = _init()
    os.environ["CRYOSNAP_NODE"] = f"node-{rank}"  # two "nodes" on this machine
    root = out.parent if restart else out
    scratch = root / f"node-{rank}"
    got: dict[str, Any] = {}
    with cryosnap.Checkpointer(
        root / "run", scratch=scratch, partner=True, chunk_bytes=4096, keep_scratch=2
    ) as ckpt:
        if not restart:
            for step in range(3):
                info = ckpt.save(step, _partner_state(rank, step), replicated=["model"]).result()
            got["tiers"] = list(info.tiers)
            return got
        state = ckpt.restore()
        want = _partner_state(rank, state["step"])
        got["step"], got["own"] = state["step"], state["own"]
        got["same"] = all(torch.equal(state["model"][k], v) for k, v in want["model"].items())
        got["scratch"] = ckpt.status().steps["scratch"]
    return got


def _rewind(out: Path) -> dict[str, Any]:
    """Save 1-4, restore 2 on purpose, save 3 again: the first save after the rewind
    supersedes 3 and 4 in rank 0's global commit (issue 26)."""
    import cryosnap

    rank, _ = _init()

    def state(step: int, trajectory: int) -> dict[str, Any]:
        return {"w": np.full(5000, step + 100.0 * trajectory + rank), "t": trajectory}

    got: dict[str, Any] = {}
    with cryosnap.Checkpointer(out / "run", chunk_bytes=4096) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, state(step, 0)).result()
        got["restored_t"] = ckpt.restore(step=2)["t"]
        ckpt.save(3, state(3, 1)).result()
        got["steps"] = ckpt.steps()
    with cryosnap.Checkpointer(out / "run", chunk_bytes=4096) as ckpt:
        newest = ckpt.restore()
        got["reopened"] = [ckpt.restored_step, newest["t"], float(newest["w"][0])]
        ckpt.save(4, state(4, 1)).result()
        got["final"] = ckpt.steps()
    return got


def _world_size(out: Path, save: bool) -> dict[str, Any]:
    import cryosnap
    from cryosnap.dist import TorchCoordinator

    rank, _ = _init()
    run = out / "run"
    with cryosnap.Checkpointer(run, comm=TorchCoordinator(timeout=TIMEOUT)) as ckpt:
        if save:
            state = {"model": np.arange(1024.0), "own": np.full(8, rank)}
            ckpt.save(1, state, replicated=["model"]).result(timeout=TIMEOUT)
            return {}
        got: dict[str, Any] = {}
        try:
            ckpt.restore()
        except cryosnap.CheckpointError as exc:
            got.update(error=type(exc).__name__, message=str(exc))
        got["replicated"] = list(ckpt.restore(replicated_only=True))
    return got


def main(scenario: str, out: Path) -> None:
    import torch.distributed as dist

    if scenario == "collectives":
        got = _collectives(out)
    elif scenario == "dead":
        got = _dead(out)
    elif scenario == "killed":
        got = _killed(out)
    elif scenario == "replicated":
        got = _replicated(out)
    elif scenario == "exchange":
        got = _exchange(out)
    elif scenario == "rewind":
        got = _rewind(out)
    elif scenario.startswith("worldsize-"):
        got = _world_size(out, save=scenario == "worldsize-save")
    elif scenario.startswith("partner-"):
        got = _partner(out, restart=scenario == "partner-restore")
    else:
        got = _checkpointer(out, scenario.removeprefix("checkpointer-"))
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(got))
    if scenario in ("dead", "killed"):
        # A peer vanished: gloo's groups are broken, and torch may abort at interpreter exit
        # (a std::thread destroyed while joinable: "terminate called without an active
        # exception", seen in CI). What is tested is reported above; leave without teardown.
        sys.stdout.flush()
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
