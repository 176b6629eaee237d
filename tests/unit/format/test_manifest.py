"""cryosnap._format.manifest: keys, Manifest / CommitRecord JSON round trips and validation."""

from __future__ import annotations

import base64
import dataclasses
import json
import uuid
import zlib
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cryosnap
from cryosnap._format.manifest import (
    FORMAT_VERSION,
    MAX_STEP,
    CommitRecord,
    Manifest,
    ManifestRef,
    commit_key,
    data_key,
    manifest_key,
    step_of_commit_key,
    version_prefix,
)
from cryosnap.errors import CheckpointFormatError
from cryosnap.storage import open_store, validate_key

from ..support import commit_checksum

WHERE = "memory://run: versions/000000000001/x.json"

_steps = st.integers(0, MAX_STEP)
_ranks = st.integers(0, 99_999)
_segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-.", min_size=1, max_size=8)
_data_files = st.lists(
    # Not the names stores reserve for writes in progress ("x.partial", ".x.tmp").
    _segment.filter(
        lambda s: (
            s not in (".", "..")
            and not s.endswith(".partial")
            and not (s.startswith(".") and s.endswith(".tmp"))
        )
    ).map(lambda s: f"data/{s}"),
    max_size=4,
    unique=True,
)
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=10,
)
_created = st.floats(min_value=0, max_value=4e9, allow_nan=False)


# ---------------------------------------------------------------------------------------------
# keys


@given(_steps, _ranks, st.text(alphabet="0123456789abcdef", min_size=1, max_size=8))
def test_keys_are_valid_and_commit_keys_invert(step: int, rank: int, token: str) -> None:
    for key in (commit_key(step), manifest_key(step, rank), data_key(step, rank, token)):
        assert validate_key(key) == key
    assert commit_key(step).startswith(version_prefix(step) + "/")
    assert manifest_key(step, rank).startswith(version_prefix(step) + "/")
    assert step_of_commit_key(commit_key(step)) == step
    assert step_of_commit_key(manifest_key(step, rank)) is None
    assert step_of_commit_key(data_key(step, rank, token)) is None


def test_keys_sort_by_step() -> None:
    steps = [0, 9, 10, 100, MAX_STEP]
    assert sorted(commit_key(s) for s in reversed(steps)) == [commit_key(s) for s in steps]


@pytest.mark.parametrize(
    "key",
    [
        "versions/12/COMMIT.json",
        "versions/00000000000a/COMMIT.json",
        "versions/000000000001/commit.json",
        "x/versions/000000000001/COMMIT.json",
        "versions/000000000001/COMMIT.json/x",
        "versions/+00000000001/COMMIT.json",
    ],
)
def test_step_of_commit_key_rejects_other_keys(key: str) -> None:
    assert step_of_commit_key(key) is None


# ---------------------------------------------------------------------------------------------
# Manifest


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    return Manifest(
        step=draw(_steps),
        rank=draw(_ranks),
        chunk_bytes=draw(st.integers(4096, 64 << 20)),
        data_files=tuple(draw(_data_files)),
        blobs=(),
        skeleton=draw(st.dictionaries(st.text(max_size=4), _json, max_size=4)),
        leaves=draw(st.integers(0, 2**63)),
        logical_bytes=draw(st.integers(0, 2**63)),
        created_unix=draw(_created),
    )


@given(manifests())
def test_manifest_round_trip(manifest: Manifest) -> None:
    body = manifest.to_json()
    doc = json.loads(body)
    assert doc["format_version"] == FORMAT_VERSION and doc["kind"] == "cryosnap.manifest"
    assert Manifest.from_json(body, WHERE) == manifest
    assert Manifest.from_json(body, WHERE).to_json() == body


@given(manifests(), manifests())
def test_a_manifest_is_the_text_of_one_json_dumps_whatever_skeleton_came_before(
    first: Manifest, second: Manifest
) -> None:
    """The tree's text is kept for the next manifest of the same skeleton object: the next one
    of another skeleton, or of the same skeleton again, reads as json.dumps writes it."""
    for manifest in (first, second, dataclasses.replace(second, step=first.step), first):
        body = manifest.to_json()
        doc = json.loads(body)
        assert list(doc)[-2:] == ["hashes", "tree"]
        assert body == json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        assert doc["tree"] == json.loads(json.dumps(manifest.skeleton))


_node_leaf = st.one_of(
    st.fixed_dictionaries({"t": st.just("int"), "v": st.integers()}),
    st.fixed_dictionaries({"t": st.just("str"), "v": st.text(max_size=3)}),
    st.fixed_dictionaries({"t": st.just("size"), "v": st.lists(st.integers(0, 9), max_size=3)}),
    st.fixed_dictionaries({"t": st.just("torch"), "shape": st.just([2]), "b": st.integers(0, 9)}),
)
_node_tree = st.recursive(
    _node_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda v: {"t": "list", "v": v}),
        st.lists(inner, max_size=4).map(
            lambda v: {"t": "dict", "k": [str(i) for i in range(len(v))], "v": v}
        ),
        inner.map(lambda v: {"t": "stateful", "type": "m.C", "v": v}),
    ),
    max_leaves=20,
)


def _replaced(node: Any, path: list[int], leaf: Any) -> Any:
    """A copy of ``node`` with ``leaf`` at ``path`` (indices into "v"), sharing the rest."""
    v = node.get("v")
    nested = isinstance(v, dict) or (isinstance(v, list) and all(isinstance(c, dict) for c in v))
    if not path or not nested:
        return leaf
    top = dict(node)
    if isinstance(node["v"], dict):
        top["v"] = _replaced(node["v"], path[1:], leaf)
    elif node["v"]:
        values = list(node["v"])
        i = path[0] % len(values)
        values[i] = _replaced(values[i], path[1:], leaf)
        top["v"] = values
    return top


@settings(max_examples=60, deadline=None)
@given(
    _node_tree,
    st.lists(st.tuples(st.lists(st.integers(0, 3), max_size=5), _node_leaf), max_size=6),
)
def test_the_tree_text_is_json_dumps_for_skeletons_that_share_nodes(
    tree: Any, changes: list[tuple[list[int], Any]]
) -> None:
    """Each skeleton a copy of the last one with one node replaced (as a reused flatten
    patches an inline leaf): the text is the whole tree's json.dumps every time."""
    from cryosnap._format.manifest import _tree_text

    dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
    for path, leaf in [([], None), *changes]:
        if path or leaf is not None:
            tree = _replaced(tree, path, leaf)
        assert _tree_text(tree) == (dumps(tree), False)
        assert _tree_text(tree) == (dumps(tree), False)  # the same object again


def _saved_manifest(state: Any, chunk_bytes: int) -> bytes:
    """The manifest ``save`` writes for ``state`` (in memory: no fsync, no files)."""
    store = open_store(f"memory://cryosnap-test-{uuid.uuid4().hex}")
    try:
        cryosnap.save(store, state, step=1, chunk_bytes=chunk_bytes)
        return store.read(manifest_key(1, 0))
    finally:
        for key in store.list():
            store.delete(key)


@given(
    sizes=st.lists(st.integers(0, 20000), max_size=5),
    chunk_bytes=st.sampled_from([4096, 1 << 20]),
    step=_steps,
    created=_created,
)
def test_manifest_with_blobs_round_trip(
    sizes: list[int], chunk_bytes: int, step: int, created: float
) -> None:
    state = {f"b{i}": bytes(n) for i, n in enumerate(sizes)}  # bytes: a blob each
    body = _saved_manifest(state, chunk_bytes)
    manifest = Manifest.from_json(body, WHERE)
    assert [b.nbytes for b in manifest.blobs] == sizes
    changed = dataclasses.replace(manifest, step=step, created_unix=created)
    assert Manifest.from_json(changed.to_json(), WHERE) == changed


@pytest.fixture(scope="module")
def manifest_doc() -> dict[str, Any]:
    state = {"w": torch.zeros(3000), "b": b"x" * 5000, "n": 1}
    return dict(json.loads(_saved_manifest(state, 4096)))


def _set(doc: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    if value is _MISSING:
        del doc[name]
    else:
        doc[name] = value
    return doc


_MISSING = object()

MANIFEST_CASES = [
    ("step", -1, "'step'"),
    ("step", MAX_STEP + 1, "'step'"),
    ("step", "1", "'step'"),
    ("step", True, "'step'"),
    ("step", _MISSING, "'step'"),
    ("rank", 1.0, "'rank'"),
    ("rank", -1, "'rank'"),
    ("chunk_bytes", 4095, "'chunk_bytes'"),
    ("chunk_bytes", (64 << 20) + 1, "'chunk_bytes'"),
    ("chunk_bytes", _MISSING, "'chunk_bytes'"),
    ("leaves", -1, "'leaves'"),
    ("logical_bytes", "big", "'logical_bytes'"),
    ("created_unix", "now", "'created_unix'"),
    ("created_unix", _MISSING, "'created_unix'"),
    ("data_files", "data/x", "'data_files'"),
    ("data_files", _MISSING, "'data_files'"),
    ("data_files", [1], "data file"),
    ("data_files", ["versions/000000000001/COMMIT.json"], "data file"),
    ("data_files", ["data/../../x"], "data file"),
    ("blobs", {}, "'blobs'"),
    ("blobs", _MISSING, "'blobs'"),
    ("tree", [], "'tree'"),
    ("tree", _MISSING, "'tree'"),
    ("kind", "cryosnap.commit", "not a cryosnap manifest"),
    ("hash", "sha256", "hash algorithm"),
    ("format_version", 6, "format_version"),
    ("format_version", True, "format_version"),
    ("format_version", _MISSING, "format_version"),
]


@pytest.mark.parametrize(
    ("name", "value", "match"),
    MANIFEST_CASES,
    ids=[f"{n}={'missing' if v is _MISSING else v!r}" for n, v, _ in MANIFEST_CASES],
)
def test_manifest_validation_names_the_field(
    manifest_doc: dict[str, Any], name: str, value: Any, match: str
) -> None:
    assert Manifest.from_json(json.dumps(manifest_doc).encode(), WHERE)  # the control is valid
    body = json.dumps(_set(manifest_doc, name, value)).encode()
    with pytest.raises(CheckpointFormatError, match=match) as info:
        Manifest.from_json(body, WHERE)
    assert str(info.value).startswith(WHERE)


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


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe{}", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (b'{"format_version": 1}', "not a cryosnap manifest"),
        (b"NaN", "not a JSON object"),
    ],
)
def test_manifest_garbage(body: bytes, match: str) -> None:
    with pytest.raises(CheckpointFormatError, match=match):
        Manifest.from_json(body, WHERE)


# ---------------------------------------------------------------------------------------------
# CommitRecord


@st.composite
def commit_records(draw: st.DrawFn) -> CommitRecord:
    world = draw(st.integers(1, 4))
    step = draw(_steps)
    refs = tuple(
        ManifestRef(
            rank=r,
            key=manifest_key(step, r),
            xxh3=draw(st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)),
            nbytes=draw(st.integers(0, 2**40)),
        )
        for r in range(world)
    )
    return CommitRecord(
        step=step,
        world_size=world,
        manifests=refs,
        data_files=tuple(draw(_data_files)),
        logical_bytes=draw(st.integers(0, 2**63)),
        written_bytes=draw(st.integers(0, 2**63)),
        leaves=draw(st.integers(0, 2**40)),
        chunk_bytes=draw(st.integers(4096, 64 << 20)),
        root=draw(st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)),
        created_unix=draw(_created),
    )


@given(commit_records())
def test_commit_record_round_trip(record: CommitRecord) -> None:
    body = record.to_json()
    doc = json.loads(body)
    assert doc["kind"] == "cryosnap.commit" and doc["format_version"] == FORMAT_VERSION
    checksum = doc.pop("checksum")
    assert checksum == commit_checksum(doc)  # the documented checksum
    assert CommitRecord.from_json(body, WHERE) == record


@given(commit_records(), st.randoms(use_true_random=False))
def test_commit_record_manifest_order_does_not_matter(record: CommitRecord, rnd: Any) -> None:
    doc = json.loads(record.to_json())
    doc.pop("checksum")
    rnd.shuffle(doc["manifests"])
    doc["checksum"] = commit_checksum(doc)
    assert CommitRecord.from_json(json.dumps(doc).encode(), WHERE) == record


@pytest.fixture(scope="module")
def commit_doc() -> dict[str, Any]:
    record = CommitRecord(
        step=1,
        world_size=2,
        manifests=(
            ManifestRef(0, manifest_key(1, 0), "0" * 32, 10),
            ManifestRef(1, manifest_key(1, 1), "1" * 32, 20),
        ),
        data_files=("data/a.dat", "data/b.dat"),
        logical_bytes=5,
        written_bytes=5,
        leaves=2,
        chunk_bytes=4096,
        root="ab" * 16,
        created_unix=1.5,
    )
    return dict(json.loads(record.to_json()))


def _resealed(doc: dict[str, Any], name: str, value: Any) -> bytes:
    doc = _set(doc, name, value)
    doc.pop("checksum", None)
    doc["checksum"] = commit_checksum(doc)
    return json.dumps(doc).encode()


_REF0 = {"rank": 0, "key": "versions/000000000001/rank-00000.json", "xxh3_128": "0" * 32}
COMMIT_CASES = [
    ("step", -1, "'step'"),
    ("step", _MISSING, "'step'"),
    ("world_size", 0, "'world_size'"),
    ("world_size", 3, "'manifests'"),
    ("manifests", None, "'manifests'"),
    ("manifests", [{**_REF0, "bytes": 1}, "x"], "manifest reference"),
    ("manifests", [{**_REF0, "bytes": -1}, {**_REF0, "rank": 1, "bytes": 1}], "'bytes'"),
    ("manifests", [{**_REF0, "bytes": 1, "rank": "0"}, {**_REF0, "bytes": 1}], "'rank'"),
    ("manifests", [{**_REF0, "bytes": 1, "xxh3_128": 5}, {**_REF0, "bytes": 1}], "reference"),
    ("manifests", [{**_REF0, "bytes": 1, "key": "data/x.json"}, {**_REF0, "bytes": 1}], "key"),
    ("manifests", [{**_REF0, "bytes": 1, "key": "/etc/x"}, {**_REF0, "bytes": 1}], "key"),
    ("data_files", {}, "'data_files'"),
    ("data_files", ["data/../x"], "data file"),
    ("logical_bytes", -5, "'logical_bytes'"),
    ("written_bytes", None, "'written_bytes'"),
    ("leaves", 1.5, "'leaves'"),
    ("chunk_bytes", 1, "'chunk_bytes'"),
    ("root", 5, "'root'"),
    ("created_unix", "x", "'created_unix'"),
    ("kind", "cryosnap.manifest", "not a cryosnap commit record"),
    ("format_version", 99, "format_version"),
]


@pytest.mark.parametrize(
    ("name", "value", "match"),
    COMMIT_CASES,
    ids=[f"{n}={'missing' if v is _MISSING else v!r}"[:40] for n, v, _ in COMMIT_CASES],
)
def test_commit_validation_names_the_field(
    commit_doc: dict[str, Any], name: str, value: Any, match: str
) -> None:
    assert CommitRecord.from_json(json.dumps(commit_doc).encode(), WHERE)  # the control is valid
    with pytest.raises(CheckpointFormatError, match=match) as info:
        CommitRecord.from_json(_resealed(commit_doc, name, value), WHERE)
    assert str(info.value).startswith(WHERE)


@pytest.mark.parametrize("field", ["step", "leaves", "root", "data_files"])
def test_commit_checksum_catches_any_edit(commit_doc: dict[str, Any], field: str) -> None:
    doc = json.loads(json.dumps(commit_doc))
    doc[field] = doc[field] + 1 if isinstance(doc[field], int) else doc[field][:-1]
    with pytest.raises(CheckpointFormatError, match="checksum"):
        CommitRecord.from_json(json.dumps(doc).encode(), WHERE)
    doc = json.loads(json.dumps(commit_doc))
    del doc["checksum"]
    with pytest.raises(CheckpointFormatError, match="checksum"):
        CommitRecord.from_json(json.dumps(doc).encode(), WHERE)


def test_commit_ranks_must_be_distinct(commit_doc: dict[str, Any]) -> None:
    refs = commit_doc["manifests"]
    with pytest.raises(CheckpointFormatError, match="rank"):
        CommitRecord.from_json(_resealed(commit_doc, "manifests", [refs[0], refs[0]]), WHERE)


def _big_table_manifest_doc() -> tuple[Manifest, dict[str, Any]]:
    from cryosnap._format.manifest import PACK_ROWS, BaseRef, BlobEntry

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
    doc: dict[str, Any] = json.loads(_saved_manifest(state, 4096))
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
    import cryosnap._format.manifest as module

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
    monkeypatch.setattr(module, "_parse_simple_blobs", lambda *args: None)
    slow = _outcome(body)
    assert fast == slow
    if isinstance(fast, Manifest):
        assert fast.tables().table.tolist() == module.BlobTables.of(fast.blobs).table.tolist()
        assert fast.tables().hashes == module.BlobTables.of(fast.blobs).hashes


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
