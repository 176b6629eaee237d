"""Exact resume after SIGKILL: dropout, a shuffled loader and all RNGs, bit for bit.

A child process trains a small model with dropout on a shuffled :class:`ResumableLoader`, with
noise from numpy's and Python's generators, and checkpoints model, optimizer, ``RNGState`` and
loader every few steps. It is SIGKILLed two or three times (mid-epoch between checkpoints, and
right after the checkpoint that ends an epoch), restarted each time from the newest version,
and must end with the very parameters of a run that was never interrupted.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from tests import forkserver

_CHILD = textwrap.dedent(
    """
    import os, random, signal, sys
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset
    import cryosnap
    from cryosnap.integrations.torch import RNGState, ResumableLoader, ResumableSampler

    run, kill_at, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    EPOCHS, EVERY = 3, 3
    torch.set_num_threads(1)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(45, 8, generator=g), torch.randn(45, 1, generator=g))
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    # 45 samples in batches of 4: 12 batches per epoch, the last one of a single sample.
    loader = ResumableLoader(data, batch_size=4, sampler=ResumableSampler(data, seed=5))
    state = {"model": model, "optim": optim, "rng": RNGState(), "loader": loader, "step": 0}
    with cryosnap.Checkpointer(run) as ckpt:
        if ckpt.latest_step() is not None:
            ckpt.restore(into=state)
            print("resumed", state["step"], loader.epoch, loader.sampler.consumed, flush=True)
        step = state["step"]
        while loader.epoch < EPOCHS:
            for x, y in loader:
                noise = torch.from_numpy(np.random.standard_normal(x.shape).astype("float32"))
                scale = random.uniform(0.5, 1.5)
                loss = ((model(x + 0.01 * noise) - y) ** 2).mean() * scale
                optim.zero_grad()
                loss.backward()
                optim.step()
                step += 1
                if step % EVERY == 0:
                    state["step"] = step
                    ckpt.save(step, state).result()
                if step == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
    torch.save(model.state_dict(), out)
    print("finished", step, flush=True)
    """
)

# (kill at step, the step, epoch and consumed samples the next run resumes from)
_KILLS = [(7, (6, 0, 24)), (17, (15, 1, 12)), (24, (24, 1, 45))]
# make test kills the chain twice: mid-epoch (7) and right after the checkpoint that ends an
# epoch (24); make test-deep also mid-epoch in the next epoch (17), three kills in one chain.
_SLICE = [_KILLS[0], _KILLS[2]]


def _child(run: Path, kill_at: int, out: Path) -> forkserver.Rank:
    log = out.with_name(f"{out.stem}-{kill_at}")
    return forkserver.start(["-c", _CHILD, str(run), str(kill_at), str(out)], log=log)


@pytest.mark.parametrize(
    "kills",
    [
        pytest.param(_SLICE, id="mid-epoch-and-epoch-end"),
        pytest.param(_KILLS, id="three-kills", marks=pytest.mark.deep),
    ],
)
def test_resume_after_sigkill_is_bit_exact(
    tmp_path: Path, kills: list[tuple[int, tuple[int, int, int]]]
) -> None:
    # The uninterrupted reference runs alongside the interrupted chain.
    reference = _child(tmp_path / "reference", -1, tmp_path / "reference.pt")
    run, resumed_from = tmp_path / "run", []
    for kill_at, _expected in kills:
        proc = _child(run, kill_at, tmp_path / "unused.pt")
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == -9, stdout + stderr
        resumed_from += [line for line in stdout.splitlines() if line.startswith("resumed")]
    last = _child(run, -1, tmp_path / "resumed.pt")
    stdout, stderr = last.communicate(timeout=120)
    assert last.returncode == 0, stdout + stderr
    resumed_from += [line for line in stdout.splitlines() if line.startswith("resumed")]
    assert stdout.splitlines()[-1] == "finished 36"
    assert resumed_from == [f"resumed {s} {e} {c}" for _kill, (s, e, c) in kills]
    ref_out, ref_err = reference.communicate(timeout=120)
    assert reference.returncode == 0, ref_out + ref_err

    expected = torch.load(tmp_path / "reference.pt", weights_only=True)
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
