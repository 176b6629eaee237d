"""DTensor leaves through a Checkpointer, with real gloo processes on a 1-D CPU device mesh.

Two ranks hold DTensors (``distribute_tensor`` with ``Shard(0)`` and ``Replicate()``, and an
FSDP2 model's and Adam optimizer's ``get_state_dict``), save them with ``Checkpointer.save``,
change a few floats of rank 0's shard and save again (only that chunk is written), restore
into DTensors of the same layout made differently (bit-exact: sha256 of every local shard),
restore without ``into`` (each rank's local shard), restore into another placement or mesh (an
error naming the leaf and pointing at ``cryosnap.dcp``), and save lazily (the optimizer step
waits for the shards it mutates). Each launch runs this file as a script
on 2 processes (tests/integration/ranks.py); each rank writes what it saw to ``rank-N.json``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from tests.integration import ranks

HERE = Path(__file__).resolve()
TIMEOUT = 60.0
CHUNK = 4096


def test_dtensor_leaves_save_incrementally_and_restore_bit_exact(tmp_path: Path) -> None:
    results = ranks.launch(HERE, "dtensor", 2, tmp_path / "out", str(tmp_path / "run"))
    for rank, got in enumerate(results):
        assert got["restored"] == got["saved"], "restore(into=DTensors) is not bit-exact"
        assert got["before"] != got["saved"]  # the targets started out different
        assert got["plain"] == got["saved"], "restore() is not each rank's local shard"
        assert got["local_shape"] == [64 // 2, 96]  # Shard(0) of [64, 96] over 2 ranks
        assert "w" in got["mismatch"] and "cryosnap.dcp" in got["mismatch"]
        assert "placements saved ['S(0)'], into= has ['R']" in got["mismatch"]
        assert got["mismatch_type"] == "StateMismatchError"
        assert (
            "at w: a DTensor of another layout (mesh saved [2], into= has [1, 2]"
            in (got["mesh_mismatch"])
        )
        assert got["fsdp_restored"] == got["fsdp_saved"] != got["fsdp_before"]
        assert got["objects_restored"] == got["fsdp_saved"]  # FSDP2 module and its Adam
        assert got["lazy_restored"] == got["lazy_saved"] != got["lazy_after"]
        assert got["record"]["placements"] == ["S(0)"] and got["record"]["mesh"] == [2]
        assert got["record"]["coordinate"] == [rank] and got["record"]["shape"] == [64, 96]
    first = [got["written"][0] for got in results]
    assert min(first) > 4 * CHUNK
    # 4 floats of w's rows 0.. (rank 0's shard): one chunk there, nothing on rank 1.
    assert [got["written"][1] for got in results] == [CHUNK, 0]


# -- the ranks ----------------------------------------------------------------------------------


def digest(t: Any) -> str:
    import torch

    t = t.to_local() if hasattr(t, "to_local") else t
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode() + raw).hexdigest()[:16]


def digests(tree: Any, prefix: str = "") -> dict[str, str]:
    import torch

    out: dict[str, str] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(digests(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(digests(v, f"{prefix}/{i}"))
    elif isinstance(tree, torch.Tensor):
        out[prefix] = digest(tree)
    return out


def _state(mesh: Any, seed: int, w_placement: Any = None) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 96, generator=g)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    return {
        "w": distribute_tensor(w, mesh, [w_placement or Shard(0)]),
        "b": distribute_tensor(b, mesh, [Replicate()]),
        "plain": torch.arange(10, dtype=torch.int64) + seed,
        "step": 3,
    }


def _fsdp(mesh: Any, seed: int) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.001)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _fsdp_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _dtensor(out: Path, run: Path) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    import cryosnap
    from cryosnap import engine
    from cryosnap.storage import open_store

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = _state(mesh, 0)
    model, opt = _fsdp(mesh, 0)
    got: dict[str, Any] = {"written": []}
    with cryosnap.Checkpointer(run, chunk_bytes=CHUNK) as ckpt:
        objects = {"model": model, "optim": opt}  # stateful: their state dicts hold DTensors
        info = ckpt.save(0, {**state, "fsdp": _fsdp_state(model, opt), **objects}).result()
        got["written"].append(info.written_bytes)
        with torch.no_grad():
            if dist.get_rank() == 0:
                state["w"].to_local()[0, :4] += 1.0
        info = ckpt.save(1, {**state, "fsdp": _fsdp_state(model, opt), **objects}).result()
        got["written"].append(info.written_bytes)
        got["saved"] = digests(state)
        got["fsdp_saved"] = digests(_fsdp_state(model, opt))

        target = _state(mesh, 1)
        other, other_opt = _fsdp(mesh, 1)
        fsdp_target = _fsdp_state(other, other_opt)
        got["before"] = digests(target)
        got["fsdp_before"] = digests(fsdp_target)
        third, third_opt = _fsdp(mesh, 2)
        ckpt.restore(into={**target, "fsdp": fsdp_target, "model": third, "optim": third_opt})
        got["objects_restored"] = digests(_fsdp_state(third, third_opt))
        set_state_dict(
            other,
            other_opt,
            model_state_dict=fsdp_target["model"],
            optim_state_dict=fsdp_target["optim"],
        )
        got["restored"] = digests(target)
        got["fsdp_restored"] = digests(_fsdp_state(other, other_opt))

        plain = ckpt.restore(step=1)
        got["plain"] = digests({k: plain[k] for k in state})
        got["local_shape"] = list(plain["w"].shape)
        assert type(plain["w"]) is torch.Tensor

        wrong = _state(mesh, 1, w_placement=Replicate())
        try:
            into = {**wrong, "fsdp": _fsdp_state(other, other_opt), "model": third}
            ckpt.restore(step=1, into={**into, "optim": third_opt})
            got["mismatch"], got["mismatch_type"] = "", ""
        except cryosnap.CheckpointError as exc:
            got["mismatch"], got["mismatch_type"] = str(exc), type(exc).__name__
        # Another mesh: the same two ranks as a (1, 2) mesh, w sharded along its second dim.
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh2 = init_device_mesh("cpu", (1, dist.get_world_size()))
        other_mesh = {**_state(mesh, 1), "fsdp": _fsdp_state(other, other_opt)}
        other_mesh["w"] = distribute_tensor(torch.zeros(64, 96), mesh2, [Replicate(), Shard(0)])
        try:
            ckpt.restore(step=1, into={**other_mesh, "model": third, "optim": third_opt})
            got["mesh_mismatch"] = ""
        except cryosnap.StateMismatchError as exc:
            got["mesh_mismatch"] = str(exc)
        # Lazy capture: the next optimizer step waits for the DTensor shards it mutates.
        pending = ckpt.save(2, objects, lazy=True)
        got["lazy_saved"] = digests(_fsdp_state(model, opt))
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        pending.result()
        got["lazy_after"] = digests(_fsdp_state(model, opt))
        fourth, fourth_opt = _fsdp(mesh, 3)
        ckpt.restore(step=2, into={"model": fourth, "optim": fourth_opt})
        got["lazy_restored"] = digests(_fsdp_state(fourth, fourth_opt))
    store = open_store(run)
    manifest, _ref = engine.read_manifest(store, engine.read_commit(store, 1), dist.get_rank())
    top = manifest.skeleton
    got["record"] = top["v"][top["k"].index("w")]["dtensor"]
    return got


def main(scenario: str, out: Path, *args: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    got = _dtensor(out, Path(args[0]))
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
