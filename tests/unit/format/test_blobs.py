"""cryosnap._format.blobs: blob entries through a manifest's JSON, every malformed row named by
its blob; packed segment tables; the one-row fast path agreeing with the blob-by-blob one."""

from __future__ import annotations

import base64
import dataclasses
import json
import zlib
from typing import Any

import numpy as np
import pytest
import torch

from cryosnap._format import blobs as blobs_module
from cryosnap._format.blobs import PACK_ROWS, BlobEntry, BlobTables
from cryosnap._format.manifest import BaseRef, Manifest
from cryosnap.errors import CheckpointFormatError

from .documents import WHERE, saved_manifest


@pytest.fixture(scope="module")
def manifest_doc() -> dict[str, Any]:
    state = {"w": torch.zeros(3000), "b": b"x" * 5000, "n": 1}
    return dict(json.loads(saved_manifest(state, 4096)))


def _blob_mutations() -> list[tuple[str, Any]]:
    def size_plus_one(b: list[Any]) -> list[Any]:
        return [b[0] + 1, *b[1:]]

    def size_minus_one(b: list[Any]) -> list[Any]:
        return [b[0] - 4096, *b[1:]]

    def negative_size(b: list[Any]) -> list[Any]:
        return [-1, *b[1:]]

    def string_size(b: list[Any]) -> list[Any]:
        return [str(b[0]), *b[1:]]

    def short_root(b: list[Any]) -> list[Any]:
        return [b[0], b[1][:-2], *b[2:]]

    def bad_root(b: list[Any]) -> list[Any]:
        return [b[0], "zz" * 16, *b[2:]]

    def truncated(b: list[Any]) -> list[Any]:
        return b[:-1]

    def extended(b: list[Any]) -> list[Any]:
        return [*b, 0]

    # Segment rows of the wrong shape: the parser flattens the rows before converting them.
    def row_of_3(b: list[Any]) -> list[Any]:
        return [b[0], b[1], [r[:3] for r in b[2]]]

    def rows_of_3_and_5(b: list[Any]) -> list[Any]:
        rows = [[*r] for r in b[2]] + [[0, 0, 0, 4096]]
        rows[0] = rows[0][:3]
        rows[-1] = [*rows[-1], 1]
        return [b[0], b[1], rows]

    def nested_row(b: list[Any]) -> list[Any]:
        return [b[0], b[1], [[[v] for v in r] for r in b[2]]]

    def row_not_a_list(b: list[Any]) -> list[Any]:
        return [b[0], b[1], [7 for _ in b[2]]]

    def row_a_string(b: list[Any]) -> list[Any]:
        return [b[0], b[1], ["0123" for _ in b[2]]]

    def row_of_bools(b: list[Any]) -> list[Any]:
        return [b[0], b[1], [[True, False, False, True] for _ in b[2]]]

    return [
        ("row-of-3", row_of_3),
        ("rows-of-3-and-5", rows_of_3_and_5),
        ("nested-row", nested_row),
        ("row-not-a-list", row_not_a_list),
        ("row-a-string", row_a_string),
        ("row-of-bools", row_of_bools),
        ("not-a-list", "blob"),
        ("empty", []),
        ("size+1", size_plus_one),
        ("size-4096", size_minus_one),
        ("negative-size", negative_size),
        ("string-size", string_size),
        ("short-root", short_root),
        ("bad-root", bad_root),
        ("truncated", truncated),
        ("extended", extended),
    ]


@pytest.mark.parametrize(
    "mutation", [m for _, m in _blob_mutations()], ids=[n for n, _ in _blob_mutations()]
)
def test_manifest_blob_validation_names_the_blob(
    manifest_doc: dict[str, Any], mutation: Any
) -> None:
    doc = json.loads(json.dumps(manifest_doc))
    doc["blobs"][1] = mutation(doc["blobs"][1]) if callable(mutation) else mutation
    with pytest.raises(CheckpointFormatError, match=r"blob 1") as info:
        Manifest.from_json(json.dumps(doc).encode(), WHERE)
    assert str(info.value).startswith(WHERE)


def _last_int_to(value: Any, convert: Any) -> bool:
    """Replace the last int in the nested lists ``value`` (in place); whether one was found."""
    for i in range(len(value) - 1, -1, -1):
        if isinstance(value[i], list) and _last_int_to(value[i], convert):
            return True
        if type(value[i]) is int:
            value[i] = convert(value[i])
            return True
    return False


@pytest.mark.parametrize("convert", [str, float], ids=["str", "float"])
def test_manifest_blob_numbers_must_be_ints(manifest_doc: dict[str, Any], convert: Any) -> None:
    doc = json.loads(json.dumps(manifest_doc))
    # The last number of the blob's storage description (the size of its last run).
    assert _last_int_to(doc["blobs"][0][2:], convert)
    with pytest.raises(CheckpointFormatError, match="blob 0"):
        Manifest.from_json(json.dumps(doc).encode(), WHERE)


def _big_table_manifest_doc() -> tuple[Manifest, dict[str, Any]]:
    cb = 4096
    rows = []
    for i in range(PACK_ROWS + 10):
        rows.append([1, 0, 2 * i, 1])
        rows.append([0, 0, i * cb, cb])
    table = np.array(rows, dtype=np.int64)
    n = len(rows)
    hashes = bytes(range(16)) * (n // 2)
    blob = BlobEntry(n * cb, bytes(16), table, hashes, cb)
    m = Manifest(
        step=3,
        rank=0,
        chunk_bytes=cb,
        data_files=("data/000000000003-r00000-abcd.dat",),
        blobs=(blob,),
        skeleton={"t": "array"},
        leaves=1,
        logical_bytes=n * cb,
        created_unix=1.0,
        base=BaseRef(2, "versions/000000000002/rank-00000.json", "0" * 32),
    )
    return m, json.loads(m.to_json())


def test_large_segment_tables_are_packed_and_round_trip() -> None:
    m, doc = _big_table_manifest_doc()
    packed = doc["blobs"][0][2]
    assert set(packed) == {"rows", "zlib_i64"}
    back = Manifest.from_json(m.to_json(), "test")
    assert back.blobs[0] == m.blobs[0]


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.update(rows=p["rows"] + 1),
        lambda p: p.update(rows=-1),
        lambda p: p.update(zlib_i64="!!not base64!!"),
        lambda p: p.update(zlib_i64=base64.b64encode(b"not zlib").decode()),
        lambda p: p.update(extra=1),
        lambda p: p.update(
            zlib_i64=base64.b64encode(zlib.compress(b"\0" * (1 << 20))).decode()
        ),  # inflates far past what rows allows
    ],
)
def test_damaged_packed_tables_are_format_errors(damage: Any) -> None:
    _m, doc = _big_table_manifest_doc()
    damage(doc["blobs"][0][2])
    with pytest.raises(CheckpointFormatError, match="blob 0"):
        Manifest.from_json(json.dumps(doc).encode(), "test")


def _outcome(body: bytes) -> Any:
    try:
        return Manifest.from_json(body, WHERE)
    except CheckpointFormatError as exc:
        return str(exc)


@pytest.fixture(scope="module")
def many_blobs_doc() -> dict[str, Any]:
    """A manifest of many one-segment blobs, an empty one and a packed multi-segment one."""
    # bytes: small tensors and arrays would be packed several to a blob
    state: dict[str, Any] = {
        f"t{i}": np.full((i % 7 * 300 + 1,), float(i), np.float32).tobytes() for i in range(40)
    }
    state["empty"] = torch.zeros(0)
    state["big"] = torch.arange(200_000, dtype=torch.float32)
    doc: dict[str, Any] = json.loads(saved_manifest(state, 4096))
    return doc


def _doc_mutations() -> list[Any]:
    values = [-1, 0, 1, 2, True, 1.5, "7", None, 2**63, 2**47 + 1, [], [0, 0, 0, 1], "ab" * 16]
    out: list[Any] = []
    for v in values:
        out += [("size", v), ("root", v), ("segments", v), ("row", v)]
        out += [("kind", v), ("file", v), ("offset", v), ("nbytes", v)]
    return [*out, ("hashes-", None), ("hashes+", None), ("blob", 7), ("blob", [1, 2])]


@pytest.mark.parametrize("where", [0, 3, 39, -1])
@pytest.mark.parametrize("mutation", _doc_mutations(), ids=repr)
def test_one_segment_blobs_are_checked_as_blob_by_blob(
    many_blobs_doc: dict[str, Any], where: int, mutation: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blobs of one segment are checked all at once: the same manifests and the same errors
    (naming the same blob) as the blob-by-blob path gives."""
    doc = json.loads(json.dumps(many_blobs_doc))
    what, value = mutation
    blobs = doc["blobs"]
    blob = blobs[where]
    if what.startswith("hashes"):
        raw = base64.b64decode(doc["hashes"])
        raw = raw[:-16] if what == "hashes-" else raw + bytes(16)
        doc["hashes"] = base64.b64encode(raw).decode()
    elif what == "blob":
        blobs[where] = value
    elif what == "size":
        blob[0] = value
    elif what == "root":
        blob[1] = value
    elif what == "segments":
        blob[2] = value
    elif what == "row" and isinstance(blob[2], list) and blob[2]:
        blob[2][0] = value
    elif isinstance(blob[2], list) and blob[2]:
        row = blob[2][0]
        row[["kind", "file", "offset", "nbytes"].index(what)] = value
    body = json.dumps(doc).encode()
    fast = _outcome(body)
    monkeypatch.setattr(blobs_module, "_parse_simple_blobs", lambda *args: None)
    slow = _outcome(body)
    assert fast == slow
    if isinstance(fast, Manifest):
        assert fast.tables().table.tolist() == BlobTables.of(fast.blobs).table.tolist()
        assert fast.tables().hashes == BlobTables.of(fast.blobs).hashes


def test_one_segment_blobs_round_trip(many_blobs_doc: dict[str, Any]) -> None:
    body = json.dumps(many_blobs_doc).encode()
    manifest = Manifest.from_json(body, WHERE)
    assert manifest._tables is not None  # checked all at once
    assert Manifest.from_json(manifest.to_json(), WHERE) == manifest
    tables = manifest.tables()
    again = dataclasses.replace(manifest, blobs=tuple(list(manifest.blobs)))
    assert again.tables() is not tables  # built again for the blobs it describes
    assert again.tables().rows.tolist() == tables.rows.tolist()
    assert again.tables().nbytes.tolist() == [b.nbytes for b in manifest.blobs]
