"""``cryosnap.File`` leaves in a run of two real processes over gloo: each rank its own file and
a replicated one (written once in total), an incremental version of a 100-byte change, and a
restore into other paths.

The test starts this file as a script on two processes (``launch`` of test_dist_torch.py);
each rank writes what it saw to ``OUT/rank-N.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve()
CHUNK = 4096


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_files_of_two_gloo_processes(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed", reason="torch is not installed")
    from tests.integration import test_dist_torch

    results = test_dist_torch.launch("files", 2, tmp_path, script=HERE)
    mesh = (tmp_path / "mesh.bin").read_bytes()
    for rank, got in enumerate(results):
        own = (tmp_path / f"own-{rank}.bin").read_bytes()
        assert got["restored"] == {"mesh": _digest(mesh), "own": _digest(own)}
        assert got["written"][1] == CHUNK  # the 100-byte change of this rank's own file
    # The replicated mesh (8 chunks) is written once in total, split between the ranks.
    assert sum(got["written"][0] for got in results) == 8 * CHUNK + 2 * 3 * CHUNK


def _files(out: Path) -> dict[str, Any]:
    import datetime

    import torch.distributed as dist

    import cryosnap

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    mesh, own = out / "mesh.bin", out / f"own-{rank}.bin"
    if rank == 0:
        mesh.write_bytes(np.random.default_rng(99).bytes(8 * CHUNK))
    data = bytearray(np.random.default_rng(rank).bytes(3 * CHUNK))
    own.write_bytes(bytes(data))
    dist.barrier()  # the mesh is there for both
    state = {"mesh": cryosnap.File(mesh), "own": cryosnap.File(own)}
    written = []
    with cryosnap.Checkpointer(out / "run", chunk_bytes=CHUNK) as ckpt:
        written.append(ckpt.save(1, state, replicated=["mesh"]).result().written_bytes)
        data[100:200] = bytes(100)
        own.write_bytes(bytes(data))
        written.append(ckpt.save(2, state, replicated=["mesh"]).result().written_bytes)
        back = out / f"back-{rank}"
        back.mkdir()
        into = {"mesh": cryosnap.File(back / "mesh"), "own": cryosnap.File(back / "own")}
        ckpt.restore(into=into)
    restored = {k: _digest((back / k).read_bytes()) for k in ("mesh", "own")}
    return {"written": written, "restored": restored}


if __name__ == "__main__":
    import torch.distributed as dist

    out_dir = Path(sys.argv[2])
    report = _files(out_dir)
    (out_dir / f"rank-{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
