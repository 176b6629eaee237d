"""cryosnap as torch.distributed.checkpoint's storage, with real gloo processes.

A model with an Adam optimizer, sharded with FSDP2 (``fully_shard`` on a CPU device mesh: its
parameters and optimizer states are DTensors), is saved through ``cryosnap.dcp.StorageWriter``
with DCP's own ``get_state_dict`` / ``dcp.save`` / ``dcp.async_save`` at 1 and 2 ranks, loaded
back through ``cryosnap.dcp.StorageReader`` with ``dcp.load`` / ``set_state_dict`` into a model
initialized differently, and compared bit for bit (sha256 of dtype, shape and bytes of every
whole tensor). The 2-rank version is then loaded at 1 rank into a plain, unsharded model (DCP's
planner reshards), exported to one ``.pt``, and its sparse update is checked to write only the
changed chunk.

Each launch runs this file as a script on 1 or 2 processes (tests/integration/ranks.py); each
rank writes what it saw to ``OUT_DIR/rank-N.json``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.integration import ranks

HERE = Path(__file__).resolve()
TIMEOUT = 60.0
CHUNK = 4096


# -- the tests ----------------------------------------------------------------------------------


def test_two_ranks_save_sparse_update_async_and_load(tmp_path: Path) -> None:
    run = tmp_path / "run"
    results = ranks.launch(HERE, "save", 2, tmp_path / "two", str(run))
    for got in results:
        assert got["steps"] == [0, 1, 2]
        assert got["loaded"] == got["saved"], "dcp.load through the reader is not bit-exact"
        assert got["before"] != got["saved"]  # the loading model started out different
    # The whole state is spread over both ranks; the sparse update (4 floats of one weight,
    # all on rank 0's shard) is one chunk on rank 0 and nothing on rank 1.
    first = [got["written"][0] for got in results]
    assert min(first) > 10 * CHUNK
    assert [got["written"][1] for got in results] == [CHUNK, 0]
    assert [got["written"][2] for got in results] == [CHUNK, 0]  # the async one, too
    # Step 1 of the 2-rank run, loaded at 1 rank into a plain (unsharded) model.
    (one,) = ranks.launch(HERE, "load", 1, tmp_path / "one", str(run), "1")
    assert one["loaded"] == results[0]["at_step_1"]
    assert one["before"] != one["loaded"]


@pytest.mark.deep
def test_a_writer_per_save_at_two_ranks_and_across_a_restart(tmp_path: Path) -> None:
    """DCP's habit: a new StorageWriter per dcp.save / dcp.async_save, never closed; each
    save is the next version, incremental against the previous one, also after a restart
    (a new job going on from the run), and the run is free between saves."""
    run = tmp_path / "run"
    first = ranks.launch(HERE, "per_save", 2, tmp_path / "first", str(run))
    again = ranks.launch(HERE, "per_save", 2, tmp_path / "again", str(run))
    for got in first:
        assert got["steps"] == [0, 1, 2] and got["free"] == [[0], [0, 1], [0, 1, 2]]
        assert got["loaded"] == got["saved"]
        assert all(s > 0 for s in got["stalls"])
    for got in (*first, *again):  # durable no sooner than the save stopped blocking (#55)
        assert got["ordered"] == [True] * 3
    for got in again:
        assert got["steps"] == [3, 4, 5] and got["free"][-1] == [0, 1, 2, 3, 4, 5]
        assert got["resumed"] == first[0]["saved"] and got["loaded"] == got["saved"]
    assert min(got["written"][0] for got in first) > 10 * CHUNK
    # The sparse update is one chunk of rank 0's shard: every later save, the restart's first
    # included, writes that chunk on rank 0 and nothing on rank 1.
    assert [got["written"][1:] for got in first] == [[CHUNK, CHUNK], [0, 0]]
    assert [got["written"] for got in again] == [[CHUNK] * 3, [0] * 3]


def test_async_save_on_a_group_of_its_own_while_fsdp_trains(tmp_path: Path) -> None:
    """docs/DISTRIBUTED.md's form: dcp.async_save(..., process_group=<a new gloo group>) is
    written on DCP's thread while training steps run FSDP's collectives on the default group;
    the version is the state at the save, bit for bit, and training went on meanwhile."""
    run = tmp_path / "run"
    for got in ranks.launch(HERE, "async_group", 2, tmp_path / "out", str(run)):
        assert got["steps"] == [0, 1]
        assert got["in_flight"] == [True, True]  # training steps ran while each save was
        assert got["loaded"] == got["saved"] != got["after"]
        assert got["loaded_first"] == got["first"] != got["saved"]


def test_one_rank_save_and_load(tmp_path: Path) -> None:
    (got,) = ranks.launch(HERE, "save", 1, tmp_path / "one", str(tmp_path / "run"))
    assert got["steps"] == [0, 1, 2]
    assert got["loaded"] == got["saved"]
    assert got["written"][1] == CHUNK


def test_export_of_a_two_rank_version_is_the_whole_state(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from cryosnap.export import export

    run = tmp_path / "run"
    (saved, _) = ranks.launch(HERE, "save", 2, tmp_path / "two", str(run))
    result = export(run, tmp_path / "model.pt", step=1)
    assert result.step == 1
    tree = torch.load(tmp_path / "model.pt", weights_only=True)
    model = {f"model/{k}": v for k, v in tree["model"].items()}
    assert digests(model) == {k: v for k, v in saved["at_step_1"].items() if k.startswith("model/")}
    assert tree["optim"]["param_groups"][0]["lr"] == 0.001


# -- the ranks ----------------------------------------------------------------------------------


def digest(t: Any) -> str:
    import torch

    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode() + raw).hexdigest()[:16]


def digests(flat: dict[str, Any]) -> dict[str, str]:
    return {k: digest(v) for k, v in sorted(flat.items())}


def _state_digests(model: Any, opt: Any) -> dict[str, str]:
    """Every parameter and optimizer state of the model, whole, by fqn."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    flat = {f"model/{k}": v for k, v in msd.items()}
    for fqn, states in osd["state"].items():
        flat.update({f"optim/{fqn}/{k}": v for k, v in states.items()})
    return digests(flat)


def _model(seed: int, sharded: bool) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32))
    if sharded:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.001)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _sparse_update(model: Any) -> None:
    """4 floats of the first weight: on rank 0's shard (rows 0..63) at any world size."""
    import torch

    with torch.no_grad():
        weight = model[0].weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        if local.shape[0] == weight.shape[0] or _rank() == 0:
            local[0, :4] += 1.0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _save(out: Path, run: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import cryosnap.dcp

    model, opt = _model(0, sharded=True)
    got: dict[str, Any] = {"written": []}
    with cryosnap.dcp.StorageWriter(run, chunk_bytes=CHUNK) as writer:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
        got["written"].append(writer.last_info.written_bytes)  # type: ignore[union-attr]
        _sparse_update(model)
        got["at_step_1"] = _state_digests(model, opt)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer, checkpoint_id=1)
        got["written"].append(writer.last_info.written_bytes)  # type: ignore[union-attr]
        _sparse_update(model)
        msd, osd = get_state_dict(model, opt)
        dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer).result()
        got["written"].append(writer.last_info.written_bytes)  # type: ignore[union-attr]
        got["steps"] = writer.run.steps()
    got["saved"] = _state_digests(model, opt)
    other, other_opt = _model(1, sharded=True)
    got["before"] = _state_digests(other, other_opt)
    msd, osd = get_state_dict(other, other_opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=cryosnap.dcp.StorageReader(run))
    set_state_dict(other, other_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got["loaded"] = _state_digests(other, other_opt)
    return got


def _per_save(out: Path, run: Path) -> dict[str, Any]:
    """Three saves, each through a writer of its own (the last one async), never closed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import cryosnap.dcp

    model, opt = _model(0, sharded=True)
    resumed = run.exists()
    got: dict[str, Any] = {"written": [], "stalls": [], "ordered": [], "steps": [], "free": []}
    if resumed:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=cryosnap.dcp.StorageReader(run))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got["resumed"] = _state_digests(model, opt)
    for i in range(3):
        if resumed or i:
            _sparse_update(model)
        msd, osd = get_state_dict(model, opt)
        writer = cryosnap.dcp.StorageWriter(run, chunk_bytes=CHUNK)
        if i < 2:
            dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
        else:
            dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer).result()
        info = writer.last_info
        assert info is not None
        got["written"].append(info.written_bytes)
        got["stalls"].append(info.stall_seconds)
        got["ordered"].append(info.seconds >= info.stall_seconds)
        got["steps"].append(writer.last_step)
        dist.barrier()  # every rank's save returned: no lock is held now
        if _rank() == 0:  # the run opens for writing (and closes) between saves
            with cryosnap.Checkpointer(run, comm=cryosnap.dist.LocalCoordinator()) as ckpt:
                got["free"].append(ckpt.steps())
        else:
            got["free"].append(cryosnap.Run(run).steps())
        dist.barrier()
    got["saved"] = _state_digests(model, opt)
    other, other_opt = _model(1, sharded=True)
    msd, osd = get_state_dict(other, other_opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=cryosnap.dcp.StorageReader(run))
    set_state_dict(other, other_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got["loaded"] = _state_digests(other, other_opt)
    return got


def _train_step(model: Any, opt: Any) -> None:
    import torch

    model(torch.randn(4, 64)).sum().backward()  # FSDP: all_gather, reduce_scatter (default group)
    opt.step()
    opt.zero_grad()


def _async_group(out: Path, run: Path) -> dict[str, Any]:
    """Two async saves, each on a gloo group of its own, with training steps while each is in
    flight; then both versions loaded into a model made differently."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import cryosnap.dcp
    from cryosnap.dcp import _session

    model, opt = _model(0, sharded=True)
    group = dist.new_group(backend="gloo")  # once, on every rank: the saves' own group
    got: dict[str, Any] = {"in_flight": []}
    for name in ("first", "saved"):
        got[name] = _state_digests(model, opt)  # the state the save holds
        msd, osd = get_state_dict(model, opt)
        writer = cryosnap.dcp.StorageWriter(run, chunk_bytes=CHUNK)
        # The test holds the run's in-process save slot for two training steps: DCP's thread
        # (its planning collectives on `group`) cannot finish the save meanwhile.
        with _session.in_flight(_session.run_key(run), timeout_seconds=TIMEOUT):
            future = dcp.async_save({"model": msd, "optim": osd}, storage_writer=writer,
                                    process_group=group)  # fmt: skip
            for _ in range(2):
                _sparse_update(model)  # changes what the staged copy must not see
                _train_step(model, opt)
            got["in_flight"].append(not future.done())
        for _ in range(2):  # and two more while it writes and commits
            _train_step(model, opt)
        future.result()
    got["after"] = _state_digests(model, opt)
    got["steps"] = cryosnap.Run(run).steps()
    for name, step in (("loaded_first", 0), ("loaded", 1)):
        other, other_opt = _model(1, sharded=True)
        msd, osd = get_state_dict(other, other_opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=cryosnap.dcp.StorageReader(run, step))
        set_state_dict(other, other_opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got[name] = _state_digests(other, other_opt)
    return got


def _load(out: Path, run: Path, step: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import cryosnap.dcp

    model, opt = _model(1, sharded=False)
    got = {"before": _state_digests(model, opt)}
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=cryosnap.dcp.StorageReader(run, step))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got["loaded"] = _state_digests(model, opt)
    return got


def main(scenario: str, out: Path, *args: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")  # DCP warns about its experimental APIs
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
    if scenario == "save":
        got = _save(out, Path(args[0]))
    elif scenario == "per_save":
        got = _per_save(out, Path(args[0]))
    elif scenario == "async_group":
        got = _async_group(out, Path(args[0]))
    else:
        got = _load(out, Path(args[0]), int(args[1]))
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:])
