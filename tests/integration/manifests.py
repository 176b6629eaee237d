"""Reading what each rank wrote from a version's manifests, for the tests that bound the bytes
per rank of a distributed save (test_transformers_ddp.py, test_lightning_strategy.py)."""

from __future__ import annotations

import base64
import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np


def segments(blob: list[Any]) -> list[list[int]]:
    """A blob's segments, whether JSON rows or packed (docs/FORMAT.md)."""
    rows = blob[2]
    if isinstance(rows, dict):  # {"rows": n, "zlib_i64": ...}: n rows of 4 int64
        flat = np.frombuffer(zlib.decompress(base64.b64decode(rows["zlib_i64"])), "<i8")
        return flat.reshape(rows["rows"], 4).tolist()
    return list(rows)


def written(run: Path, step: int, rank: int) -> int:
    """The bytes of chunks rank ``rank`` wrote for version ``step``: the stored segments of its
    manifest that lie in its own data file of that version (padding not counted)."""
    manifest = json.loads((run / f"versions/{step:012d}/rank-{rank:05d}.json").read_text())
    mine = {
        i
        for i, name in enumerate(manifest["data_files"])
        if Path(name).name.startswith(f"{step:012d}-r{rank:05d}-")
    }
    ranges = {
        (seg[2], seg[3])
        for blob in manifest["blobs"]
        for seg in segments(blob)
        if seg[0] == 0 and seg[1] in mine
    }
    return sum(nbytes for _, nbytes in ranges)
