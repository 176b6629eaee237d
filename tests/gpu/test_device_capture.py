"""Capture of CUDA tensors: fingerprints on the device (Triton and torch agree, and agree with
xxh3), only changed chunks cross PCIe, the capture stream is ordered after the caller's, and a
lazy capture's optimizer guard orders the step after the copies. Needs a CUDA device (the
``gpu`` marker skips these elsewhere); bench/gpu.sh runs them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

torch = pytest.importorskip("torch")

import cryosnap  # noqa: E402
from cryosnap._run.capture.fingerprint import Fingerprinter  # noqa: E402

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def test_triton_and_torch_fingerprints_agree_and_match_xxh3_decisions() -> None:
    f = Fingerprinter(MIB, seed=11)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 64 * MIB + 12_345  # a partial last chunk, not a whole number of words
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)
    words_host = data.cpu().numpy().tobytes()
    fp = f.chunks(data)
    assert f._triton is not False, "the Triton kernel failed; torch took over"
    padded = torch.zeros(65 * MIB, dtype=torch.uint8, device="cuda")
    padded[:n] = data
    ref = Fingerprinter.chunks_torch(padded.view(torch.int32).view(65, -1), f._keys_on("cuda"))
    assert torch.equal(fp, ref)
    # Sparse edits: the chunks the fingerprints call changed are the ones xxh3 calls changed.
    new = data.clone()
    rng = np.random.default_rng(1)
    for i in rng.integers(0, n, 20):
        new[int(i)] ^= 1 << int(rng.integers(0, 8))
    changed = (f.chunks(new) != fp).any(1).cpu().tolist()
    after = new.cpu().numpy().tobytes()
    host = [
        xxhash.xxh3_128_digest(words_host[i : i + MIB])
        != xxhash.xxh3_128_digest(after[i : i + MIB])
        for i in range(0, n, MIB)
    ]
    assert changed == host


def cuda_state(seed: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return {f"w{i}": torch.randn(16 * MIB // 4, device="cuda", generator=gen) for i in range(4)} | {
        "small": torch.arange(10, device="cuda"),
        "step": 0,
    }


def test_only_changed_chunks_cross_pcie_and_versions_restore(tmp_path: Path) -> None:
    state = cuda_state(0)
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:  # device_diff on by default with CUDA
        first = ckpt.save(0, state).result()
        assert first.captured_bytes == first.logical_bytes
        for i in range(4):
            state[f"w{i}"][i * 1_000_003] += 1.0  # one chunk of each tensor
        state["step"] = 1
        info = ckpt.save(1, state).result()
        assert info.incremental
        assert info.captured_bytes <= 4 * MIB + 1024  # four changed chunks and the small leaf
        assert info.new_chunks == 4
    got = cryosnap.load(tmp_path / "run", step=1)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v.cpu()), k


def test_capture_waits_for_kernels_queued_before_save(tmp_path: Path) -> None:
    a = torch.randn(8192, 8192, device="cuda")
    target = torch.zeros(64 * MIB // 4, device="cuda")
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        for step in range(3):
            # A long kernel on the caller's stream produces the tensor; save() right after.
            target.copy_((a @ a).flatten()[: target.numel()] + step)
            pending = ckpt.save(step, {"t": target})
            expected = target.cpu()
            pending.result()
            assert torch.equal(cryosnap.load(tmp_path / "run", step=step)["t"], expected)


def test_lazy_capture_orders_the_optimizer_step_after_the_copies(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(64, 2048, device="cuda")
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        for step in range(4):
            model(x).square().mean().backward()
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            pending = ckpt.save(step, {"model": model, "opt": opt}, lazy=True)
            opt.step()  # must not change what step ``step`` saves
            opt.zero_grad()
            pending.result()
            got = cryosnap.load(tmp_path / "run", step=step)["model"]
            for k, v in before.items():
                assert torch.equal(got[k], v.cpu()), (step, k)


def test_a_first_eager_save_snapshots_on_the_device_and_keeps_the_state_at_save(
    tmp_path: Path,
) -> None:
    state = cuda_state(3)
    expect = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    with cryosnap.Checkpointer(tmp_path / "run") as ckpt:
        pending = ckpt.save(0, state)  # the staging is not allocated yet: a snapshot
        assert ckpt._capturer.snapshots == 1
        for i in range(4):
            state[f"w{i}"].mul_(-1.0)  # queued after the clones: not in version 0
        pending.result()
        ckpt.save(1, state).result()  # the staging is there now: copied as usual
        assert ckpt._capturer.snapshots == 1
    got = cryosnap.load(tmp_path / "run", step=0)
    for k, v in expect.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v.cpu()), k
