"""Hostile runs: every number, size and shape a manifest or commit record claims is checked.

A run directory can come from anyone. Real small runs are built (a one-shot save and an
incremental chain whose blobs have packed segment tables), then their manifests and commit
records are rewritten in hundreds of ways: every numeric field set to absurd values (negative,
huge, 2**63-1, thousands of digits, floats, 1e400, NaN, wrong types), keys dropped or
duplicated, documents that are not objects, nesting 100,000 deep, zlib bombs in packed tables,
offsets past the data files' ends. Every rewrite re-signs what the format hashes (the
manifest's xxh3 in the commit record, the successor's base reference, the commit record's
checksum), so the parser reaches the field instead of stopping at a checksum.

For each rewrite: ``load(step=)`` and ``engine.verify_part`` either refuse with
``IntegrityError`` / ``CheckpointFormatError`` (what ``load()`` falls back past) or return the
saved state exactly; ``load()`` without a step returns an intact version. The campaign runs in
a child process whose address space is capped (``RLIMIT_AS``), so a claim that allocates before
it is checked fails the test instead of the machine.
"""

from __future__ import annotations

import base64
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import tracemalloc
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap import engine
from cryosnap._format.chunks import merkle_root
from cryosnap._format.keys import commit_key, manifest_key
from cryosnap._format.limits import MAX_BLOB_CHUNKS
from cryosnap._format.skeleton import MAX_DEPTH
from cryosnap.errors import CheckpointFormatError, IntegrityError
from cryosnap.storage import LocalStore

CHUNK = 4096
REPO = Path(__file__).resolve().parents[2]
# What load() falls back past: hostile input must land in one of these.
FALLBACK = (IntegrityError, CheckpointFormatError)
# Address space the campaign may grow by, over what its imports take: a restore of these runs
# needs a few MiB; a claim allocated before it is checked needs far more.
HEADROOM_BYTES = 1536 << 20


# ---------------------------------------------------------------------------------------------
# runs


def full_state(step: int) -> dict[str, Any]:
    rng = np.random.default_rng(step)
    return {
        "w": rng.standard_normal((40, 50)).astype(np.float32),  # 8000 B: 2 chunks
        "f": np.asfortranarray(rng.integers(0, 9, (30, 20)).astype(np.int16)),
        "zeros": np.zeros(6 * CHUNK, np.uint8),  # spatial dedup: one chunk referenced 6 times
        "raw": rng.bytes(5000),
        "meta": {"name": "run", 3: [1.5, None, True], "t": (step, "x")},
        "s": np.float64(step / 3),
    }


def chain_state(step: int) -> dict[str, Any]:
    big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: 256 chunks
    # Sparse updates: every 4th chunk changes, so each incremental blob has about 128 segments
    # (a packed table).
    for s in range(1, step + 1):
        big[s :: 4 * CHUNK // 4] += s
    return {"big": big, "small": np.full(10, step, np.int64), "step": step}


def torch_state(step: int) -> dict[str, Any]:
    """Torch tensors down every route of a restore: a state dict in columns (packed leaves and
    one of a blob of its own, a Parameter), a dict of tensors leaf by leaf (packed), views of
    one storage, and a dict of small numpy arrays (packed)."""
    import torch

    g = torch.Generator().manual_seed(step)
    model: dict[str, Any] = {f"l{i}.weight": torch.randn(4, 6, generator=g) for i in range(8)}
    model["embed"] = torch.randn(40, 50, generator=g)  # 8000 B: a blob of its own
    model["scale"] = torch.nn.Parameter(torch.randn(5, generator=g))
    model["ids"] = torch.arange(step, step + 6, dtype=torch.int64)
    base = torch.arange(24, dtype=torch.float32) + step
    return {
        "model": model,
        "opt": {
            "step": torch.tensor(float(step)),
            "exp_avg": torch.randn(2, 3, generator=g),
            "half": torch.randn(3, generator=g).to(torch.bfloat16),
            "lr": 0.1,
        },
        "views": [base, base[4:10], base.view(4, 6)],
        "arrays": {f"a{i}": np.arange(i, i + 6 + step, dtype=np.float32) for i in range(4)},
    }


def build_full(path: Path) -> None:
    cryosnap.save(path, full_state(1), step=1, chunk_bytes=CHUNK)
    cryosnap.save(path, full_state(2), step=2, chunk_bytes=CHUNK)


def build_torch(path: Path) -> None:
    cryosnap.save(path, torch_state(1), step=1, chunk_bytes=CHUNK)
    cryosnap.save(path, torch_state(2), step=2, chunk_bytes=CHUNK)


def build_chain(path: Path) -> None:
    with cryosnap.Checkpointer(path, chunk_bytes=CHUNK, full_every=16) as ckpt:
        for step in range(4):
            ckpt.save(step, chain_state(step)).result()


RUNS: dict[str, tuple[Callable[[Path], None], Callable[[int], Any], int]] = {
    # name: (builder, state of a step, the step that is attacked)
    "full": (build_full, full_state, 2),
    "chain": (build_chain, chain_state, 3),
    "torch": (build_torch, torch_state, 2),
}


# ---------------------------------------------------------------------------------------------
# rewriting a run, hashes kept consistent


def _checksum(doc: dict[str, Any]) -> str:
    # As docs/FORMAT.md defines it, written out independently of cryosnap._format.manifest.
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return xxhash.xxh3_128_hexdigest(body)


def _steps(root: Path) -> list[int]:
    return sorted(
        int(p.name) for p in (root / "versions").iterdir() if (p / "COMMIT.json").exists()
    )


def resign(root: Path, mutated: int, *, commit_raw: bool = False) -> None:
    """Make every hash that covers the manifest of step ``mutated`` agree with it again: the
    commit record of that step and of every later step whose chain passes through it (their
    manifests' base references, then their commit records)."""
    changed = {mutated}
    for step in _steps(root):
        if step < mutated:
            continue
        mkey = root / manifest_key(step, 0)
        if step != mutated:
            doc = json.loads(mkey.read_bytes())
            base = doc.get("base")
            if base is None or base["step"] not in changed:
                continue
            base["xxh3_128"] = xxhash.xxh3_128_hexdigest((root / base["key"]).read_bytes())
            mkey.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
            changed.add(step)
        if step == mutated and commit_raw:
            continue
        ckey = root / commit_key(step)
        cdoc = json.loads(ckey.read_bytes())
        cdoc.pop("checksum", None)
        body = mkey.read_bytes()
        cdoc["manifests"][0].update(xxh3_128=xxhash.xxh3_128_hexdigest(body), bytes=len(body))
        cdoc["checksum"] = _checksum(cdoc)
        ckey.write_bytes(json.dumps(cdoc, separators=(",", ":")).encode())


# Values every numeric field is set to. Strings stand for JSON text that json.dumps cannot
# write from Python: they are substituted into the document's text.
HUGE_DIGITS = "9" * 5000  # over Python's 4,300-digit limit for int <-> str
BIG_DIGITS = "7" * 4000  # just under it: parses, and is an absurd number
RAW = {"@huge@": HUGE_DIGITS, "@big@": BIG_DIGITS, "@inf@": "1e400", "@nan@": "NaN"}
NUMBERS: list[Any] = [
    -1,
    0,
    1,
    2**31,
    2**47 + 1,
    2**63 - 1,
    2**63,
    2**64 + 1,
    "@big@",
    "@huge@",
    1.5,
    "@inf@",
    "@nan@",
    -(2**63),
    "7",
    None,
    True,
    [],
    {},
]


def dump(doc: Any) -> bytes:
    text = json.dumps(doc, separators=(",", ":"))
    for placeholder, raw in RAW.items():
        text = text.replace(json.dumps(placeholder), raw)
    return text.encode()


class Mutation:
    """One rewrite of one document (``target``: "manifest" or "commit" of ``step``)."""

    def __init__(
        self,
        name: str,
        target: str,
        step: int,
        edit: Callable[[Any], Any] | None,
        raw: bytes | None = None,
    ) -> None:
        self.name, self.target, self.step, self.edit, self.raw = name, target, step, edit, raw

    def apply(self, root: Path) -> None:
        key = root / (
            manifest_key(self.step, 0) if self.target == "manifest" else commit_key(self.step)
        )
        if self.raw is not None:
            body = self.raw
        else:
            assert self.edit is not None
            doc = json.loads(key.read_bytes())
            if self.target == "commit":
                doc.pop("checksum", None)
            doc = self.edit(doc)
            body = dump(doc)
            if self.target == "commit" and isinstance(doc, dict):
                body = _signed(body)
        key.write_bytes(body)
        if self.target == "manifest":
            resign(root, self.step)
        else:
            resign(root, self.step, commit_raw=True)


def _signed(body: bytes) -> bytes:
    """A commit record's text with the checksum of what a reader parses from it (NaN, 1e400
    and 4,000-digit ints included), so the reader gets past the checksum to the field."""
    try:
        checksum = _checksum(json.loads(body))
    except (ValueError, RecursionError):  # not parseable: the reader stops before the checksum
        checksum = "0"
    return body[:-1] + f',"checksum":"{checksum}"}}'.encode()


def _set(path: tuple[Any, ...], value: Any) -> Callable[[Any], Any]:
    def edit(doc: Any) -> Any:
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
        return doc

    return edit


def _drop(key: str) -> Callable[[Any], Any]:
    def edit(doc: Any) -> Any:
        doc.pop(key, None)
        return doc

    return edit


def numeric_paths(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths of the numbers in a document (segment rows and hash strings: a few of each)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from numeric_paths(v, (*path, k))
    elif isinstance(node, list):
        items = list(enumerate(node))
        if len(items) > 6:  # long lists (rows, children): the first two and the last
            items = [*items[:2], items[-1]]
        for i, v in items:
            yield from numeric_paths(v, (*path, i))
    elif type(node) in (int, float):
        yield path


def _packed(doc: dict[str, Any]) -> list[int]:
    return [i for i, b in enumerate(doc["blobs"]) if isinstance(b[2], dict)]


def _rows(doc: dict[str, Any], i: int) -> np.ndarray:
    packed = doc["blobs"][i][2]
    raw = zlib.decompress(base64.b64decode(packed["zlib_i64"]))
    return np.frombuffer(raw, "<i8").reshape(-1, 4).copy()


def _pack(rows: np.ndarray, claimed: int | None = None, raw: bytes | None = None) -> dict[str, Any]:
    data = raw if raw is not None else np.ascontiguousarray(rows, "<i8").tobytes()
    return {
        "rows": len(rows) if claimed is None else claimed,
        "zlib_i64": base64.b64encode(zlib.compress(data, 9)).decode(),
    }


BOMB_BYTES = 256 << 20
_bomb_cache: list[str] = []


def _bomb(rows: np.ndarray, claimed: int | None = None) -> dict[str, Any]:
    """A packed table that inflates to BOMB_BYTES of zeros (about 256 KiB packed), made
    without holding the zeros in memory."""
    if not _bomb_cache:
        z = zlib.compressobj(9)
        zero = bytes(1 << 20)
        packed = b"".join(z.compress(zero) for _ in range(BOMB_BYTES >> 20)) + z.flush()
        _bomb_cache.append(base64.b64encode(packed).decode())
    return {"rows": len(rows) if claimed is None else claimed, "zlib_i64": _bomb_cache[0]}


def _packed_edit(i: int, make: Callable[[np.ndarray], dict[str, Any]]) -> Callable[[Any], Any]:
    def edit(doc: Any) -> Any:
        doc["blobs"][i][2] = make(_rows(doc, i))
        return doc

    return edit


def _row_value(row: int, col: int, value: int) -> Callable[[np.ndarray], dict[str, Any]]:
    def make(rows: np.ndarray) -> dict[str, Any]:
        rows[row, col] = value
        return _pack(rows)

    return make


def _nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"t": "none"}
    for _ in range(depth):
        node = {"t": "list", "v": [node]}
    return node


def mutations(root: Path, step: int) -> Iterator[Mutation]:
    """Every rewrite of the manifest and commit record of ``step`` (and of a base manifest)."""
    mdoc = json.loads((root / manifest_key(step, 0)).read_bytes())
    cdoc = json.loads((root / commit_key(step)).read_bytes())
    cdoc.pop("checksum")
    for target, doc in (("manifest", mdoc), ("commit", cdoc)):
        for path in numeric_paths(doc):
            for v in NUMBERS:
                yield Mutation(f"{target}{list(path)}={v!r:.12}", target, step, _set(path, v))
        for key in doc:
            yield Mutation(f"{target} without {key}", target, step, _drop(key))
            for bad in ("x", [[[]]], {"a": 1}, None, "@huge@", "@inf@"):
                yield Mutation(f"{target}[{key}]={bad!r:.12}", target, step, _set((key,), bad))
            # A duplicate key, after the real one: JSON readers keep the last.
            body = json.dumps(doc, separators=(",", ":"))
            for dup in ("0", "-1", HUGE_DIGITS, "1e400", '"x"'):
                yield Mutation(
                    f"{target} duplicate {key}={dup:.8}",
                    target,
                    step,
                    None,
                    (body[:-1] + f',"{key}":{dup}' + "}").encode(),
                )
        for raw in (b"", b"{", b"\xff\xfe", b"[]", b"1", b'"x"', b"null", b"NaN", b"[" * 100_000):
            yield Mutation(f"{target} is {raw[:8]!r}", target, step, None, raw)
        deep = (
            json.dumps(doc, separators=(",", ":"))[:-1]
            + ',"deep":'
            + "[" * 100_000
            + "]" * 100_000
            + "}"
        )
        yield Mutation(
            f"{target} with a field nested 100,000 deep", target, step, None, deep.encode()
        )
    yield from manifest_mutations(mdoc, step)
    # Consistent claims of large states: 4 GiB of one present chunk (true, but more than the
    # campaign's address space: refused when allocation fails, never an escape), and runs
    # inherited from chunks the base does not have (1.4 KB that claimed 3.1 GiB in issue #10).
    names = _leaf_names(mdoc)
    if "zeros" in names:
        yield Mutation("zeros claim 4 GiB of one chunk", "manifest", step, dedup_claim(1 << 20))
    if "big" in names and mdoc.get("base") is not None:
        for chunks in (257, 1 << 20, MAX_BLOB_CHUNKS):
            yield Mutation(f"big inherits {chunks} chunks", "manifest", step, inherit_claim(chunks))


def _leaf_names(doc: dict[str, Any]) -> list[Any]:
    tree = doc["tree"]
    return list(tree.get("k", []))


def manifest_mutations(mdoc: dict[str, Any], step: int) -> Iterator[Mutation]:
    deep_tree = json.dumps({**mdoc, "tree": "@tree@"}, separators=(",", ":"))
    yield Mutation(
        "tree nested 100,000 deep",
        "manifest",
        step,
        None,
        deep_tree.replace('"@tree@"', '{"t":"list","v":[' * 100_000 + "]}" * 100_000).encode(),
    )
    yield Mutation(
        f"tree nested {MAX_DEPTH + 50} deep",
        "manifest",
        step,
        _set(("tree",), _nested(MAX_DEPTH + 50)),
    )
    # Segment tables in JSON rows: every field of the first and last rows.
    for i, blob in enumerate(mdoc["blobs"]):
        if not isinstance(blob[2], list) or not blob[2]:
            continue
        for row in (0, len(blob[2]) - 1):
            for col in range(4):
                for v in (-1, 0, 2**31, 2**47 - 1, 2**47 + 1, 2**63 - 1, 2**63, "@big@"):
                    yield Mutation(
                        f"blob {i} row {row}[{col}]={v!r:.10}",
                        "manifest",
                        step,
                        _set(("blobs", i, 2, row, col), v),
                    )
        # A stored segment past its data file's end (within the manifest's own bounds).
        yield Mutation(
            f"blob {i} offset past the file", "manifest", step, _set(("blobs", i, 2, 0, 2), 2**40)
        )
    # Packed tables: fields of rows, the row count, zlib bombs.
    for i in _packed(mdoc):
        rows = _rows(mdoc, i)
        for row in (0, len(rows) // 2, len(rows) - 1):
            for col in range(4):
                for v in (-1, 0, 2**31, 2**40, 2**47 + 1, 2**62, 2**63 - 1, -(2**63)):
                    yield Mutation(
                        f"packed blob {i} row {row}[{col}]={v}",
                        "manifest",
                        step,
                        _packed_edit(i, _row_value(row, col, v)),
                    )
        for claimed in (0, len(rows) - 1, len(rows) + 1, 10**7, 2**40, 2**63 - 1):
            yield Mutation(
                f"packed blob {i} claims {claimed} rows",
                "manifest",
                step,
                _packed_edit(i, lambda r, c=claimed: _pack(r, claimed=c)),
            )
        # A bomb: 256 MiB of zeros (about 256 KiB packed) behind an honest row count, and one
        # behind a row count that would take it.
        yield Mutation(
            f"packed blob {i}: zlib bomb",
            "manifest",
            step,
            _packed_edit(i, _bomb),
        )
        yield Mutation(
            f"packed blob {i}: zlib bomb with its row count",
            "manifest",
            step,
            _packed_edit(i, lambda r: _bomb(r, claimed=BOMB_BYTES // 32)),
        )
        yield Mutation(
            f"packed blob {i}: not zlib",
            "manifest",
            step,
            _set(
                ("blobs", i, 2),
                {"rows": len(rows), "zlib_i64": base64.b64encode(b"garbage").decode()},
            ),
        )
        yield Mutation(
            f"packed blob {i}: not base64",
            "manifest",
            step,
            _set(("blobs", i, 2), {"rows": len(rows), "zlib_i64": "!!"}),
        )
        # Every chunk inherited from one base chunk over and over: claims that inflate.
        yield Mutation(
            f"packed blob {i}: inherits chunk 0 everywhere",
            "manifest",
            step,
            _packed_edit(i, lambda r: _pack(np.tile(np.array([[1, 0, 0, 1]]), (len(r), 1)))),
        )
    yield from skeleton_mutations(mdoc, step)


def _leaf_node(doc: dict[str, Any], name: str) -> dict[str, Any]:
    tree = doc["tree"]
    return tree["v"][tree["k"].index(name)]  # type: ignore[no-any-return]


def dedup_claim(chunks: int) -> Callable[[Any], Any]:
    """Rewrite the ``zeros`` leaf to claim ``chunks`` chunks, every one a reference to the same
    present chunk (the first one stored): a claim that is true (spatial de-duplication does
    exactly this), however large."""

    def edit(doc: Any) -> Any:
        node = _leaf_node(doc, "zeros")
        b = node["b"]
        blobs = doc["blobs"]
        tables = [_table(blob) for blob in blobs]
        counts = [sum(-(-r[3] // CHUNK) for r in rows if r[0] == 0) for rows in tables]
        source = next(r for rows in tables for r in rows if r[0] == 0 and r[3] >= CHUNK)
        table = base64.b64decode(doc["hashes"])
        digest = table[:16]  # the hash of the first stored chunk: ``source``'s first
        lo, hi = sum(counts[:b]) * 16, sum(counts[: b + 1]) * 16
        doc["hashes"] = base64.b64encode(table[:lo] + digest * chunks + table[hi:]).decode()
        row = [0, source[1], source[2], CHUNK]
        blobs[b] = [
            chunks * CHUNK,
            merkle_root(digest * chunks).hex(),
            _pack(np.tile(np.array([row]), (chunks, 1))),
        ]
        node["shape"] = [chunks * CHUNK]
        return doc

    return edit


def _table(blob: list[Any]) -> list[list[int]]:
    if isinstance(blob[2], dict):
        raw = zlib.decompress(base64.b64decode(blob[2]["zlib_i64"]))
        return np.frombuffer(raw, "<i8").reshape(-1, 4).tolist()  # type: ignore[no-any-return]
    return blob[2]  # type: ignore[no-any-return]


def inherit_claim(chunks: int) -> Callable[[Any], Any]:
    """Rewrite the incremental ``big`` leaf to claim ``chunks`` chunks in one inherited run:
    a few bytes of manifest claiming more than its base has (the base has 256)."""

    def edit(doc: Any) -> Any:
        node = _leaf_node(doc, "big")
        b = node["b"]
        base_blob = next(r[1] for r in _table(doc["blobs"][b]) if r[0] == 1)
        stored = sum(-(-r[3] // CHUNK) for r in _table(doc["blobs"][b]) if r[0] == 0)
        table = base64.b64decode(doc["hashes"])
        before = sum(
            -(-r[3] // CHUNK) for blob in doc["blobs"][:b] for r in _table(blob) if r[0] == 0
        )
        doc["hashes"] = base64.b64encode(
            table[: before * 16] + table[(before + stored) * 16 :]
        ).decode()
        doc["blobs"][b] = [chunks * CHUNK, "00" * 16, [[1, base_blob, 0, chunks]]]
        node["shape"] = [chunks * CHUNK // 4]
        return doc

    return edit


def _leaves(node: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Every leaf node under ``node`` and its path in the document (a dict in columns is one
    node: :func:`column_mutations` rewrites its leaves)."""
    if not isinstance(node, dict):
        return
    t = node.get("t")
    if t in ("dict", "odict", "list", "tuple") and "cols" not in node:
        for i, v in enumerate(node["v"]):
            yield from _leaves(v, (*path, "v", i))
    elif t == "stateful":
        yield from _leaves(node["v"], (*path, "v"))
    else:
        yield path, node


# Where a leaf's pack offset moves to: off by one, by an element, into its neighbours.
NEAR_OFFSETS = (-8, -4, -1, 1, 2, 4, 8)


def _other_blobs(b: int, nblobs: int) -> list[int]:
    return sorted(x for x in {0, 1, nblobs - 1} - {b} if 0 <= x < nblobs)


def near_mutations(path: tuple[Any, ...], node: dict[str, Any], nblobs: int) -> Iterator[Any]:
    """Rewrites of a leaf's geometry that stay plausible, where the fast routes of a restore
    look (absurd values are numeric_paths'): its pack offset moved a few bytes, its blob
    swapped for another, a dimension one more or less: ``(name, edit)``."""
    at, b, shape = node.get("at"), node.get("b"), node.get("shape")
    if type(at) is int:
        for d in NEAR_OFFSETS:
            yield f"leaf {path[-1]}.at{d:+d}", _set((*path, "at"), at + d)
    if type(b) is int:
        for other in _other_blobs(b, nblobs):
            yield f"leaf {path[-1]}.b={other}", _set((*path, "b"), other)
    if isinstance(shape, list):
        for i, dim in enumerate(shape[:2]):
            for d in (-1, 1):
                yield f"leaf {path[-1]}.shape[{i}]{d:+d}", _set((*path, "shape", i), dim + d)


def column_mutations(path: tuple[Any, ...], cols: dict[str, Any], nblobs: int) -> Iterator[Any]:
    """:func:`near_mutations` of a dict in columns (its first, second and last leaves), and
    names no torch dtype or device has (its numbers are numeric_paths')."""
    n = len(cols["b"])
    for i in sorted({0, min(1, n - 1), n - 1}):
        if cols["at"][i] >= 0:
            for d in NEAR_OFFSETS:
                edit = _set((*path, "cols", "at", i), cols["at"][i] + d)
                yield f"cols at[{i}]{d:+d}", edit
        for other in _other_blobs(cols["b"][i], nblobs):
            yield f"cols b[{i}]={other}", _set((*path, "cols", "b", i), other)
    for j in sorted({0, len(cols["dims"]) - 1} - {-1}):
        for d in (-1, 1):
            yield f"cols dims[{j}]{d:+d}", _set((*path, "cols", "dims", j), cols["dims"][j] + d)
    for name in ("float99", "Tensor", "int64", "bool"):
        yield f"cols dtypes[0]={name}", _set((*path, "cols", "dtypes", 0), name)
    for name in ("cuda:0", "meta", "nowhere"):
        yield f"cols devices[0]={name}", _set((*path, "cols", "devices", 0), name)


def skeleton_mutations(mdoc: dict[str, Any], step: int) -> Iterator[Mutation]:
    values: dict[str, list[Any]] = {
        "shape": [[-1], [10**12], [2**62, 2**62], [0, 2**63], [1] * 65, ["@big@"], "x", [1.5]],
        "b": [-1, 10**6, "@big@", 1.5, None],
        "dtype": ["<f8", "|V99999999999", "<U1000000000", "|O", [["a", "<f4", [10**9]]], 7],
        "t": ["bogus", "numpy", "torch", "bytes", None, 3],
        "order": ["F", "Z"],
        "v": ["@inf@", "@big@", "0x1p99999", [], {"t": "none"}],
        "hex": ["zz", "0x" + "f" * 10, "@big@"],
        "bits": ["00", "zz"],
    }
    nblobs = len(mdoc["blobs"])
    for path, node in _leaves(mdoc["tree"], ("tree",)):
        if "cols" in node:
            edits = column_mutations(path, node["cols"], nblobs)
        else:
            edits = near_mutations(path, node, nblobs)
        for name, edit in edits:
            yield Mutation(name, "manifest", step, edit)
        for field, vals in values.items():
            for v in vals:
                yield Mutation(
                    f"leaf {list(path)[-1]}.{field}={v!r:.14}",
                    "manifest",
                    step,
                    _set((*path, field), v),
                )


# ---------------------------------------------------------------------------------------------
# the campaign (run in a child process under RLIMIT_AS)


def _is_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")  # only the torch run imports it
    return torch is not None and isinstance(x, torch.Tensor)


def same(a: Any, b: Any) -> bool:
    if _is_tensor(a) or _is_tensor(b):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.requires_grad == b.requires_grad
            and a.detach().contiguous().view(-1).view(sys.modules["torch"].uint8).tolist()
            == b.detach().contiguous().view(-1).view(sys.modules["torch"].uint8).tolist()
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and (a == b or (a != a and b != b))


def attempt(name: str, call: Callable[[], Any], report: dict[str, Any]) -> bool:
    """Run ``call``; True if it refused as load() falls back past. A rewrite that re-signs
    the manifest may describe other content that is just as valid (another inline scalar,
    another dict key): a value returned is counted as accepted, never as an escape."""
    try:
        call()
    except FALLBACK as exc:
        kind = type(exc).__name__
        report["refused"][kind] = report["refused"].get(kind, 0) + 1
        return True
    except Exception as exc:  # an escape: anything else, CheckpointError itself included
        report["escapes"].append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
        return False
    report["accepted"] += 1
    return False


def family(name: str) -> str:
    """The kind of a mutation: its name without the field path, the value and the numbers
    (``manifest['blobs', 0, 1]=-1`` and ``manifest['step']=2**63`` are one family)."""
    return re.sub(r"\d+", "N", re.sub(r"=.*", "=", re.sub(r"\[[^\]]*\]", "[]", name)))


def campaign(
    template: Path, work: Path, run: str, only: str | None = None, sample: int = 1
) -> dict[str, Any]:
    """Apply every mutation to a fresh copy of ``template`` and read it three ways.

    ``sample`` > 1 applies a slice: of each family of mutations (:func:`family`), its 1st,
    ``sample+1``-th, ... member, so every kind of rewrite is tried and values rotate over the
    fields."""
    _build, state_of, step = RUNS[run]
    report: dict[str, Any] = {
        "mutations": 0,
        "of": 0,
        "families": 0,
        "refused": {},
        "accepted": 0,
        "escapes": [],
        "fallback": 0,
    }
    targets = [step]
    if run == "chain":
        targets.append(1)  # a base manifest: every later version resolves through it
    seen: dict[str, int] = {}
    for target in targets:
        intact = state_of(0 if target != step else step - 1)
        for m in mutations(template, target):
            if (only is not None and only not in m.name) or (
                target != step and m.target != "manifest"
            ):
                continue
            report["of"] += 1
            kind = family(f"{target} {m.name}")
            nth = seen[kind] = seen.get(kind, -1) + 1
            if nth % sample:
                continue
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(template, work)
            m.apply(work)
            report["mutations"] += 1
            name = f"{run}/{target}: {m.name}"
            refused = attempt(name, lambda: cryosnap.load(work, step=step), report)
            attempt(name + " (verify)", lambda: engine.verify_part(LocalStore(work), step), report)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    got = cryosnap.load(work)
                except Exception as exc:
                    report["escapes"].append(f"{name} (no step): {type(exc).__name__}: {exc}")
                    continue
            if refused:
                if not same(got, intact):
                    report["escapes"].append(f"{name} (no step): did not fall back")
                report["fallback"] += 1
    report["families"] = len(seen)
    return report


def child_main(template: str, work: str, run: str, headroom: int, sample: int = 1) -> None:
    """Entry point of the child process: cap the address space, run, print the report."""
    # Everything the campaign imports is imported (and its thread pools started) before the
    # cap, so the cap measures what reading the run allocates.
    cryosnap.load(template)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = campaign(Path(template), Path(work), run, sample=sample)
    report["peak_rss_growth_bytes"] = (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    )
    report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report["address_space_cap_bytes"] = vm + headroom
    print("REPORT " + json.dumps(report))


# make test runs a slice of each campaign (every family, 1 in SAMPLE of its members); make
# test-deep runs all of it.
SAMPLE = 16


def run_campaign(tmp_path: Path, run: str, sample: int) -> dict[str, Any]:
    """The campaign of ``run`` in a child process under RLIMIT_AS; its report, no escapes."""
    template = tmp_path / "template"
    RUNS[run][0](template)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "from tests.unit.test_hostile import child_main; "
        "child_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            str(REPO),
            str(template),
            str(tmp_path / "work"),
            run,
            str(HEADROOM_BYTES),
            str(sample),
        ],
        capture_output=True,
        text=True,
        timeout=840,
        env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, (
        f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    )
    report: dict[str, Any] = json.loads(lines[-1][len("REPORT ") :])
    counts = {k: v for k, v in report.items() if k != "escapes"}
    print(f"\nhostile campaign {run} (1 in {sample}): {json.dumps(counts)}")
    assert report["escapes"] == [], "\n".join(report["escapes"][:40])
    # Most rewrites are refused (by load and by verify), and then load() fell back.
    assert sum(report["refused"].values()) > report["mutations"]
    assert report["fallback"] > report["mutations"] // 2
    return report


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", sorted(RUNS))
def test_hostile_campaign_slice(tmp_path: Path, run: str) -> None:
    """Every family of rewrites, 1 in SAMPLE of its members (values rotate over the fields)."""
    report = run_campaign(tmp_path, run, SAMPLE)
    assert report["of"] > 500 and report["families"] > 80
    assert report["mutations"] >= report["of"] // SAMPLE


@pytest.mark.deep
@pytest.mark.timeout(900)
@pytest.mark.parametrize("run", sorted(RUNS))
def test_hostile_campaign(tmp_path: Path, run: str) -> None:
    """Every rewrite of the campaign."""
    report = run_campaign(tmp_path, run, 1)
    assert report["mutations"] > 500 and report["mutations"] == report["of"]


# ---------------------------------------------------------------------------------------------
# named cases of issue #10, in process


@pytest.fixture(scope="module")
def full_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "full"
    build_full(root)
    return root


@pytest.fixture
def full_run(full_template: Path, tmp_path: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(full_template, root)
    return root


def _refused_and_falls_back(root: Path, step: int = 2) -> Exception:
    with pytest.raises(FALLBACK) as info:
        cryosnap.load(root, step=step)
    with pytest.raises(FALLBACK):
        engine.verify_part(LocalStore(root), step)
    with pytest.warns(RuntimeWarning, match="skipping damaged step"):
        assert same(cryosnap.load(root), full_state(step - 1))
    return info.value


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("target", "path", "value", "match"),
    [
        ("commit", ("created_unix",), "@inf@", "created_unix"),  # was OverflowError in the CLI
        ("commit", ("created_unix",), "@big@", "created_unix"),  # was OverflowError: float(int)
        ("manifest", ("created_unix",), "@nan@", "created_unix"),
        ("manifest", ("step",), "@huge@", "not valid JSON"),  # was ValueError: 4,300 digits
        ("commit", ("metrics",), {"loss": "@big@"}, "metrics"),
        ("manifest", ("blobs", 0, 2, 0, 2), 2**63 - 4096, "stored segment"),  # was EINVAL
        ("manifest", ("blobs", 0, 2, 0, 2), 2**46, "truncated"),  # past the file's end
        ("manifest", ("blobs", 0, 0), 2**62, "blob size"),
    ],
)
def test_issue_10_numbers_are_refused(
    full_run: Path, target: str, path: tuple[Any, ...], value: Any, match: str
) -> None:
    Mutation("case", target, 2, _set(path, value)).apply(full_run)
    assert match in str(_refused_and_falls_back(full_run))


@pytest.mark.timeout(120)
def test_deep_nesting_is_refused_not_a_recursion_error(full_run: Path) -> None:
    mdoc = json.loads((full_run / manifest_key(2, 0)).read_bytes())
    text = json.dumps({**mdoc, "tree": "@tree@"}, separators=(",", ":"))
    deep = '{"t":"list","v":[' * 100_000 + '{"t":"none"}' + "]}" * 100_000
    Mutation("deep", "manifest", 2, None, text.replace('"@tree@"', deep).encode()).apply(full_run)
    assert "nested too deeply" in str(_refused_and_falls_back(full_run))


@pytest.mark.timeout(120)
def test_state_nested_to_the_limit_round_trips_and_deeper_is_refused(tmp_path: Path) -> None:
    state: Any = np.arange(3)
    for _ in range(MAX_DEPTH):
        state = [state]
    cryosnap.save(tmp_path / "ok", state, chunk_bytes=CHUNK)
    assert same(cryosnap.load(tmp_path / "ok"), state)
    # What load() would refuse is refused by save(), naming the path.
    with pytest.raises(TypeError, match=f"deeper than {MAX_DEPTH} levels"):
        cryosnap.save(tmp_path / "deep", [state], chunk_bytes=CHUNK)
    # A run written by another tool that nests deeper is refused on load.
    manifest = tmp_path / "ok" / manifest_key(0, 0)
    doc = json.loads(manifest.read_bytes())
    doc["tree"] = {"t": "list", "v": [doc["tree"]]}
    Mutation("deeper", "manifest", 0, None, json.dumps(doc).encode()).apply(tmp_path / "ok")
    with pytest.raises(CheckpointFormatError, match=f"deeper than {MAX_DEPTH}"):
        cryosnap.load(tmp_path / "ok", step=0)


@pytest.mark.timeout(120)
def test_zlib_bomb_inflates_no_further_than_its_claimed_rows(tmp_path: Path) -> None:
    root = tmp_path / "chain"
    build_chain(root)
    mdoc = json.loads((root / manifest_key(3, 0)).read_bytes())
    i = _packed(mdoc)[0]
    tracemalloc.start()
    try:
        Mutation("bomb", "manifest", 3, _packed_edit(i, _bomb)).apply(root)
        tracemalloc.reset_peak()
        with pytest.raises(CheckpointFormatError, match="packed"):
            cryosnap.load(root, step=3)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # the bomb inflates to 256 MiB; its honest table is 4 KiB


@pytest.mark.timeout(120)
def test_inherited_claim_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    # The shape of the 1.4 KB manifest that took load() to 3.1 GiB: an incremental blob of
    # 4 GiB inherited from a base that has 1 MiB. Before the fix its leaves were allocated and
    # pre-faulted before the chain was resolved.
    root = tmp_path / "chain"
    build_chain(root)
    Mutation("inherit", "manifest", 3, inherit_claim(1 << 20)).apply(root)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointFormatError, match="inherits chunks its base"):
            cryosnap.load(root, step=3)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20
    with pytest.warns(RuntimeWarning):
        assert same(cryosnap.load(root), chain_state(2))


@pytest.mark.timeout(120)
def test_true_large_claim_of_present_chunks_loads(full_run: Path) -> None:
    # 64 MiB described by one present chunk referenced 16,384 times: spatial de-duplication
    # makes such manifests, so a large logical size is not refused when its chunks are there.
    chunks = 1 << 14
    Mutation("dedup", "manifest", 2, dedup_claim(chunks)).apply(full_run)
    got = cryosnap.load(full_run, step=2)
    first = full_state(2)["w"].reshape(-1).view(np.uint8)[:CHUNK]
    assert np.array_equal(got["zeros"], np.tile(first, chunks))
    engine.verify_part(LocalStore(full_run), 2)


@pytest.mark.timeout(120)
def test_claim_beyond_memory_is_refused_before_allocating(
    full_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Patched where the claim check looks it up (the resolve pipeline).
    monkeypatch.setattr(engine._resolved, "memory_limit_bytes", lambda: 16 << 20)
    Mutation("dedup", "manifest", 2, dedup_claim(1 << 14)).apply(full_run)
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointFormatError, match="more than this machine's memory"):
            cryosnap.load(full_run, step=2)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.timeout(300)
@settings(max_examples=60)
@given(data=st.data())
def test_any_number_anywhere_is_refused_or_read(full_template: Path, data: st.DataObject) -> None:
    mdoc = json.loads((full_template / manifest_key(2, 0)).read_bytes())
    cdoc = json.loads((full_template / commit_key(2)).read_bytes())
    cdoc.pop("checksum")
    target = data.draw(st.sampled_from(["manifest", "commit"]))
    path = data.draw(st.sampled_from(list(numeric_paths(mdoc if target == "manifest" else cdoc))))
    value = data.draw(
        st.one_of(
            st.integers(-(2**70), 2**70),
            st.floats(allow_nan=True, allow_infinity=False),
            st.sampled_from(NUMBERS),
        )
    )
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "run"
        shutil.copytree(full_template, root)
        Mutation("h", target, 2, _set(path, value)).apply(root)
        report: dict[str, Any] = {"refused": {}, "accepted": 0, "escapes": []}
        attempt("load", lambda: cryosnap.load(root, step=2), report)
        attempt("verify", lambda: engine.verify_part(LocalStore(root), 2), report)
        assert report["escapes"] == []


def test_a_node_type_that_is_not_a_string_is_malformed() -> None:
    """Found by Hypothesis under CPU load: ``{"t": []}`` reached a set lookup (TypeError)."""
    from cryosnap._format.skeleton import check_depth

    check_depth({"t": [], "v": [{"t": {}}]}, "here")  # nothing to refuse at this depth
    restorer = cryosnap._state.Restorer({"t": []}, [], allow_pickle=False)
    with pytest.raises(CheckpointFormatError):
        restorer.allocate()
        restorer.build()
