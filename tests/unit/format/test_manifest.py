"""cryosnap._format.manifest: Manifest JSON round trips, its text and its validation (its blob
entries: test_blobs.py; the skeleton's text: test_skeleton_text.py)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cryosnap._format.limits import MAX_STEP
from cryosnap._format.manifest import FORMAT_VERSION, Manifest, with_codec
from cryosnap.errors import CheckpointFormatError

from .documents import (
    MISSING,
    WHERE,
    created,
    data_files,
    ranks,
    saved_manifest,
    steps,
    with_field,
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


# ---------------------------------------------------------------------------------------------
# Manifest


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    return Manifest(
        step=draw(steps),
        rank=draw(ranks),
        chunk_bytes=draw(st.integers(4096, 64 << 20)),
        data_files=tuple(draw(data_files)),
        blobs=(),
        skeleton=draw(st.dictionaries(st.text(max_size=4), _json, max_size=4)),
        leaves=draw(st.integers(0, 2**63)),
        logical_bytes=draw(st.integers(0, 2**63)),
        created_unix=draw(created),
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


@given(
    sizes=st.lists(st.integers(0, 20000), max_size=5),
    chunk_bytes=st.sampled_from([4096, 1 << 20]),
    step=steps,
    created=created,
)
def test_manifest_with_blobs_round_trip(
    sizes: list[int], chunk_bytes: int, step: int, created: float
) -> None:
    state = {f"b{i}": bytes(n) for i, n in enumerate(sizes)}  # bytes: a blob each
    body = saved_manifest(state, chunk_bytes)
    manifest = Manifest.from_json(body, WHERE)
    assert [b.nbytes for b in manifest.blobs] == sizes
    changed = dataclasses.replace(manifest, step=step, created_unix=created)
    assert Manifest.from_json(changed.to_json(), WHERE) == changed


@pytest.fixture(scope="module")
def manifest_doc() -> dict[str, Any]:
    state = {"w": torch.zeros(3000), "b": b"x" * 5000, "n": 1}
    return dict(json.loads(saved_manifest(state, 4096)))


MANIFEST_CASES = [
    ("step", -1, "'step'"),
    ("step", MAX_STEP + 1, "'step'"),
    ("step", "1", "'step'"),
    ("step", True, "'step'"),
    ("step", MISSING, "'step'"),
    ("rank", 1.0, "'rank'"),
    ("rank", -1, "'rank'"),
    ("chunk_bytes", 4095, "'chunk_bytes'"),
    ("chunk_bytes", (64 << 20) + 1, "'chunk_bytes'"),
    ("chunk_bytes", MISSING, "'chunk_bytes'"),
    ("leaves", -1, "'leaves'"),
    ("logical_bytes", "big", "'logical_bytes'"),
    ("created_unix", "now", "'created_unix'"),
    ("created_unix", MISSING, "'created_unix'"),
    ("data_files", "data/x", "'data_files'"),
    ("data_files", MISSING, "'data_files'"),
    ("data_files", [1], "data file"),
    ("data_files", ["versions/000000000001/COMMIT.json"], "data file"),
    ("data_files", ["data/../../x"], "data file"),
    ("blobs", {}, "'blobs'"),
    ("blobs", MISSING, "'blobs'"),
    ("tree", [], "'tree'"),
    ("tree", MISSING, "'tree'"),
    ("kind", "cryosnap.commit", "not a cryosnap manifest"),
    ("hash", "sha256", "hash algorithm"),
    ("format_version", 9, "format_version"),
    ("format_version", True, "format_version"),
    ("format_version", MISSING, "format_version"),
]


@pytest.mark.parametrize(
    ("name", "value", "match"),
    MANIFEST_CASES,
    ids=[f"{n}={'missing' if v is MISSING else v!r}" for n, v, _ in MANIFEST_CASES],
)
def test_manifest_validation_names_the_field(
    manifest_doc: dict[str, Any], name: str, value: Any, match: str
) -> None:
    assert Manifest.from_json(json.dumps(manifest_doc).encode(), WHERE)  # the control is valid
    body = json.dumps(with_field(manifest_doc, name, value)).encode()
    with pytest.raises(CheckpointFormatError, match=match) as info:
        Manifest.from_json(body, WHERE)
    assert str(info.value).startswith(WHERE)


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
# Coded data files (format_version 8)


@given(manifests(), st.data())
def test_coded_files_round_trip_as_format_version_8(
    manifest: Manifest, data: st.DataObject
) -> None:
    coded = frozenset(
        data.draw(st.sets(st.sampled_from(manifest.data_files))) if manifest.data_files else ()
    )
    m, body = dataclasses.replace(manifest, coded=coded).encode()
    doc = json.loads(body)
    if coded:
        assert doc["format_version"] == 8 and doc["codec"] == "shuffle-zstd"
        assert sorted(manifest.data_files[i] for i in doc["coded"]) == sorted(coded)
    else:
        assert "coded" not in doc and doc["format_version"] == FORMAT_VERSION
    assert Manifest.from_json(body, WHERE).coded == coded == m.coded
    # with_codec, the flush's rewrite of a plain manifest's text, says the same
    plain = manifest.to_json()
    again = Manifest.from_json(with_codec(plain, coded, None, WHERE), WHERE)
    assert again.coded == coded and again.format_version == (8 if coded else FORMAT_VERSION)
    assert with_codec(plain, coded, None, WHERE) == with_codec(plain, coded, None, WHERE)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"codec": "shuffle-zstd", "coded": [0]}, "in a manifest of format_version 1"),
        ({"format_version": 8, "codec": "lz4", "coded": [0]}, "codec 'lz4'.*upgrade cryosnap"),
        ({"format_version": 8, "codec": "shuffle-zstd", "coded": [5]}, "malformed field 'coded'"),
        ({"format_version": 8, "codec": "shuffle-zstd", "coded": [0, 0]}, "malformed field"),
        ({"format_version": 8, "codec": "shuffle-zstd", "coded": "0"}, "malformed field"),
        ({"format_version": 8, "codec": "shuffle-zstd", "coded": [True]}, "malformed field"),
    ],
)
def test_coded_fields_are_checked(fields: dict[str, Any], match: str) -> None:
    manifest = Manifest(
        step=1,
        rank=0,
        chunk_bytes=4096,
        data_files=("data/000000000001-r00000-aa.dat",),
        blobs=(),
        skeleton={"t": "none"},
        leaves=0,
        logical_bytes=0,
        created_unix=1.0,
    )
    doc = {**json.loads(manifest.to_json()), **fields}
    with pytest.raises(CheckpointFormatError, match=match):
        Manifest.from_json(json.dumps(doc).encode(), WHERE)
