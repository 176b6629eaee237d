"""Make the golden runs of tests/golden (format_version 1): run once, check the output in.

    .venv/bin/python tests/golden/make_golden.py tests/golden

Writes, under the given folder (each must not exist yet):

- ``oneshot``: ``cryosnap.save`` of a mixed tree at step 5 (numpy arrays of several dtypes and
  orders, Python scalars, str / bytes / None, nested dict / list / tuple, int keys, torch
  bfloat16 and int32 tensors).
- ``chain``: three versions (steps 0, 1, 2) of a Checkpointer run, 2 and 3 incremental; the
  ``grid`` leaf has 70 chunks of 4 KiB whose segment tables (steps 1 and 2) are packed (more
  than 64 rows).
  Repeated chunk contents keep the data files to a few KiB (spatial de-duplication).
- ``damaged_flip``: ``oneshot`` with one byte of its data file flipped (inside ``table``).
- ``damaged_truncated``: ``chain`` with step 2's data file cut short by one byte.
- ``damaged_manifest``: ``chain`` with one byte of step 2's manifest changed, its recorded
  hash left as it was.
- ``damaged_missing``: ``chain`` with step 2's data file deleted.
- ``packs`` (added with packs of small tensors, by ``make_golden.py tests/golden packs``):
  ``cryosnap.save`` at step 3 of small torch tensors of several dtypes (packed several to a
  blob, with alignment gaps between them) and one larger tensor that is not packed.
- ``files`` (added with ``cryosnap.File`` leaves, by ``make_golden.py tests/golden files``):
  ``cryosnap.save`` at step 4 of a 10,000-byte file (three chunks), an empty file and an int;
  the files themselves are written in a temporary folder and left out.
- ``arrays`` (added with packed numpy arrays, by ``make_golden.py tests/golden arrays``):
  ``cryosnap.save`` at step 11 of small numpy arrays of several dtypes and byte orders
  (packed several to a blob of arrays, with alignment gaps), arrays that stay alone (Fortran
  order, empty, too large to pack) and a small torch tensor (packs hold one kind each).

tests/unit/test_golden.py holds the expected values written out by hand from the states below.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

import cryosnap

CHUNK = 4096


def oneshot_state() -> dict[str, Any]:
    return {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4) / 4,
        "i16_fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3) - 3),
        "u8": np.arange(5000, dtype=np.int64).astype(np.uint8),  # 2 chunks
        "flags": np.array([True, False, True]),
        "c64": np.array([1 + 2j, -0.5j], dtype=np.complex64),
        "table": np.arange(1500, dtype=np.float64) / 8,  # 12000 B: 3 chunks
        "bf16": torch.tensor([1.5, -2.0, 0.25, 3.0], dtype=torch.bfloat16),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "scalars": {"int": -7, "big": 2**70, "float": 0.1, "bool": True, "none": None},
        "text": "héllo",
        "raw": b"\x00\x01golden",
        "nested": {"list": [1, [2, (3, "four")]], "tuple": (None, 2.5)},
        3: {"int_key": 1, 10: "ten"},
        "np_scalar": np.float32(0.75),
    }


def chain_state(step: int) -> dict[str, Any]:
    grid = np.zeros(70 * CHUNK // 4, np.float32)  # 70 chunks
    rows = grid.reshape(70, CHUNK // 4)
    if step >= 1:
        rows[::2] = 1.0  # every other chunk changes: 35 stored + 35 inherited runs
    if step >= 2:
        rows[1::2] = 2.0  # and then the others
    return {"grid": grid, "small": np.arange(8, dtype=np.int64) * (step + 1), "step": step}


def packs_state() -> dict[str, Any]:
    return {
        "model": {
            "norm.weight": torch.tensor([1.0, 0.5, -2.0]),  # 12 B at 0
            "norm.bias": torch.tensor([0.25, -0.125, 3.0], dtype=torch.bfloat16),  # 6 B at 12
            "mask": torch.tensor([True, False, True, True, False]),  # 5 B at 18
            "proj": torch.nn.Parameter(torch.arange(12, dtype=torch.float16).reshape(3, 4) / 8),
            "count": torch.tensor(7, dtype=torch.int64),  # 0-d
            "big": torch.arange(2000, dtype=torch.float32),  # 8000 B: not packed
        },
        "optim": {"step": torch.tensor(3.0), "lr": 0.01},
    }


def columns_state() -> dict[str, Any]:
    """A state dict of 10 tensors (written in columns: format_version 4) and an int."""
    return {
        "model": {
            "embed.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3) / 4,  # 48 B
            "embed.scale": torch.tensor([0.5, -1.5], dtype=torch.bfloat16),
            "block.0.weight": torch.nn.Parameter(torch.tensor([[1.0, -1.0], [2.0, -2.0]])),
            "block.0.bias": torch.tensor([0.125, 0.25], dtype=torch.float16),
            "block.0.mask": torch.tensor([True, False, False, True]),
            "block.0.count": torch.tensor(11, dtype=torch.int64),  # 0-d
            "block.0.empty": torch.zeros(0, 3),  # 0 bytes: a blob of its own
            "block.1.table": torch.arange(1500, dtype=torch.int32),  # 6000 B: not packed
            "block.1.z": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
            "head.weight": torch.full((2, 2), -0.75, dtype=torch.float64),
        },
        "step": 9,
    }


def arrays_state() -> dict[str, Any]:
    """Small numpy arrays (packed: format_version 5), arrays that stay alone and a tensor."""
    record = np.dtype([("id", "<i4"), ("w", "<f8")])
    return {
        "fields": {
            "rho": np.arange(6, dtype=np.float32).reshape(2, 3) / 4,  # 24 B
            "flag": np.array([True, False, True]),  # 3 B
            "count": np.array(11, dtype=np.int64),  # 0-d
            "be": np.array([1, -2, 300], dtype=">i2"),  # big-endian
            "z": np.array([1 + 2j, -0.5j], dtype=np.complex128),  # 32 B
            "rec": np.array([(1, 0.5), (-2, 2.25)], dtype=record),
            "when": np.array(["2026-12-06", "1970-01-01"], dtype="datetime64[D]"),
            "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),  # alone
            "empty": np.zeros((0, 4), np.float32),  # alone: no bytes
            "big": np.arange(1500, dtype=np.float64) / 8,  # 12000 B: alone
        },
        "t": torch.tensor([0.5, -1.0]),  # a pack of tensors, apart from the arrays'
        "step": 11,
    }


def make_arrays(out: Path) -> None:
    _refuse_existing(out, ("arrays",))
    cryosnap.save(out / "arrays", arrays_state(), step=11, chunk_bytes=CHUNK)
    (out / "arrays" / "writer.lock").unlink()


def make_columns(out: Path) -> None:
    _refuse_existing(out, ("columns",))
    cryosnap.save(out / "columns", columns_state(), step=9, chunk_bytes=CHUNK)
    (out / "columns" / "writer.lock").unlink()


def _refuse_existing(out: Path, names: tuple[str, ...]) -> None:
    for name in names:
        if (out / name).exists():
            raise SystemExit(f"{out / name} exists: golden runs are made once, never rewritten")


def make_packs(out: Path) -> None:
    _refuse_existing(out, ("packs",))
    cryosnap.save(out / "packs", packs_state(), step=3, chunk_bytes=CHUNK)
    (out / "packs" / "writer.lock").unlink()


def file_bytes() -> bytes:
    """The content of the golden ``files`` run's ``grid.bin``: 10,000 bytes, 0..250 repeated."""
    return bytes(i % 251 for i in range(10_000))


def make_files(out: Path) -> None:
    _refuse_existing(out, ("files",))
    with tempfile.TemporaryDirectory() as d:
        grid, empty = Path(d) / "grid.bin", Path(d) / "empty.bin"
        grid.write_bytes(file_bytes())
        empty.write_bytes(b"")
        state = {"grid": cryosnap.File(grid), "empty": cryosnap.File(empty), "it": 4}
        cryosnap.save(out / "files", state, step=4, chunk_bytes=CHUNK)
    (out / "files" / "writer.lock").unlink()


def make(out: Path) -> None:
    _refuse_existing(out, ("oneshot", "chain", *(f"damaged_{d}" for d in DAMAGE)))
    cryosnap.save(out / "oneshot", oneshot_state(), step=5, chunk_bytes=CHUNK)
    with cryosnap.Checkpointer(out / "chain", chunk_bytes=CHUNK, full_every=16) as ckpt:
        for step in range(3):
            ckpt.save(step, chain_state(step)).result()
    (out / "chain" / "writer.lock").unlink()  # a reader needs no lock; keep the runs minimal
    for name, damage in DAMAGE.items():
        source = "oneshot" if name == "flip" else "chain"
        shutil.copytree(out / source, out / f"damaged_{name}")
        damage(out / f"damaged_{name}")


def _commit(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"versions/{step:012d}/COMMIT.json").read_bytes())  # type: ignore[no-any-return]


def _own_data_file(root: Path, step: int) -> Path:
    files = [f for f in _commit(root, step)["data_files"] if f.startswith(f"data/{step:012d}-")]
    assert len(files) == 1, files
    return root / files[0]


def _flip(root: Path) -> None:
    path = _own_data_file(root, 5)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside "table", the largest leaf
    path.write_bytes(bytes(data))


def _truncate(root: Path) -> None:
    path = _own_data_file(root, 2)
    path.write_bytes(path.read_bytes()[:-1])


def _manifest(root: Path) -> None:
    path = root / "versions/000000000002/rank-00000.json"
    data = path.read_bytes().replace(b'"rank":0', b'"rank":0 ', 1)  # same JSON, other bytes
    assert data != path.read_bytes()
    path.write_bytes(data)


def _missing(root: Path) -> None:
    _own_data_file(root, 2).unlink()


DAMAGE = {"flip": _flip, "truncated": _truncate, "manifest": _manifest, "missing": _missing}


if __name__ == "__main__":
    # make_golden.py DIR: the runs of format 1 as first made; make_golden.py DIR packs: the
    # run added with packs of small tensors.
    # make_golden.py DIR files: the run added with cryosnap.File leaves.
    # make_golden.py DIR columns: the run added with state dicts in columns.
    # make_golden.py DIR arrays: the run added with packed numpy arrays.
    if sys.argv[2:] == ["packs"]:
        make_packs(Path(sys.argv[1]))
    elif sys.argv[2:] == ["files"]:
        make_files(Path(sys.argv[1]))
    elif sys.argv[2:] == ["columns"]:
        make_columns(Path(sys.argv[1]))
    elif sys.argv[2:] == ["arrays"]:
        make_arrays(Path(sys.argv[1]))
    else:
        make(Path(sys.argv[1]))
