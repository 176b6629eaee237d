"""DDP jobs restarted without ``prepare_ddp_resume``, for test_ddp_auto_resume.py: every rank
runs this script.

    python ddp_auto_job.py check OUT WORKDIR

:func:`train` is the user's script, with no call to cryosnap's DDP helper: a DDP model with
dropout, AdamW, a scheduler, a ResumableLoader, a Checkpointer saving every 2 steps and
restoring the newest version when the run holds one. Each variant trains a reference run
uninterrupted, and another run that stops after ``STOP`` steps (its saves durable) and is
trained again from its checkpoint. A restart builds every object afresh: a new DDP holds a new
reducer with DDP's initial buckets, as in a new process, and the process group stays (a new
process would make one alike). Writes ``OUT/rank-R.json``: each run's losses and final weights'
digest, the forward pre-hooks left on the restarted model and cryosnap's warnings.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import cryosnap
from cryosnap._run import ddp as ddp_resume
from cryosnap.integrations.torch import ResumableLoader, ResumableSampler, RNGState
from tests.integration.ddp_job import dataset, model

EVERY, TOTAL, STOP = 2, 6, 3  # saves at 2 and 4: the restart resumes from step 2


def train(
    run: Path,
    *,
    stop: int | None = None,
    hold_ddp: bool = False,
    late: bool = False,
    static: bool = False,
    accumulate: bool = False,
    unarmed: bool = False,
) -> dict[str, Any]:
    """The user's script. ``hold_ddp``: the state holds the DDP model itself (keys
    ``module.*``) rather than its module; ``late``: the DDP is built after the restore;
    ``static``: DDP's ``static_graph``; ``accumulate``: each step accumulates the gradients
    of half a batch under ``no_sync`` first; ``unarmed``: the restore's hook is removed (the
    behaviour before it, to show that the runs tell the two apart)."""
    inner = model()
    torch.manual_seed(100 + dist.get_rank())  # each rank's own dropout masks
    ddp = None if late else DistributedDataParallel(inner, bucket_cap_mb=0.1, static_graph=static)
    opt = torch.optim.AdamW(inner.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    data = dataset()
    loader = ResumableLoader(data, batch_size=8, sampler=ResumableSampler(data, seed=0))
    state = {"model": ddp if hold_ddp else inner, "optim": opt, "sched": sched, "loader": loader}
    state["rng"] = RNGState()
    losses: list[float] = []
    with warnings.catch_warnings(record=True) as warned, cryosnap.Checkpointer(run) as ckpt:
        warnings.simplefilter("always")
        step = 0
        if ckpt.latest_step() is not None:
            ckpt.restore(into=state)
            step = ckpt.restored_step or 0
            if unarmed:
                ddp_resume.disarm(inner)
        if ddp is None:
            ddp = DistributedDataParallel(inner, bucket_cap_mb=0.1)
        while step < TOTAL and step != stop:
            for x, y in loader:
                if step == stop:
                    ckpt.wait()  # as a job killed now: the saves before are durable
                    break
                opt.zero_grad()
                if accumulate:
                    with ddp.no_sync():
                        torch.nn.functional.mse_loss(ddp(x[:4]), y[:4]).backward()
                    x, y = x[4:], y[4:]
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                opt.step()
                sched.step()
                step += 1
                losses.append(loss.item())
                if step % EVERY == 0:
                    ckpt.save(step, state, replicated=["model", "optim", "sched", "loader"])
                if step == TOTAL:
                    break
    weights = b"".join(p.detach().numpy().tobytes() for p in inner.parameters())
    return {
        "losses": losses,
        "weights": hashlib.sha256(weights).hexdigest(),
        "hooks": len(inner._forward_pre_hooks),
        "warned": [str(w.message) for w in warned if "cryosnap" in str(w.message)],
    }


def check(out: Path, work: Path) -> None:
    dist.init_process_group("gloo")
    report: dict[str, Any] = {}
    for name, kwargs in {
        "plain": {},
        "held": {"hold_ddp": True},
        "late": {"late": True},
        "unarmed": {"unarmed": True},
        "accumulate": {"accumulate": True},
        "static": {"static": True},
    }.items():
        if name in ("plain", "accumulate"):
            report[f"{name}-reference"] = train(work / f"{name}-reference", **kwargs)
        train(work / name, stop=STOP, **kwargs)
        report[name] = train(work / name, **kwargs)
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["check"])
    parser.add_argument("out", type=Path)
    parser.add_argument("work", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    check(args.out, args.work)


if __name__ == "__main__":
    main(sys.argv[1:])
