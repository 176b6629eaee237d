"""cryosnap._format.commit: CommitRecord JSON round trips, its checksum and validation."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cryosnap._format.commit import COMMIT_FORMAT_VERSION, CommitRecord, ManifestRef
from cryosnap._format.keys import manifest_key
from cryosnap.errors import CheckpointFormatError

from ..support import commit_checksum
from .documents import MISSING, WHERE, created, data_files, steps, with_field


@st.composite
def commit_records(draw: st.DrawFn) -> CommitRecord:
    world = draw(st.integers(1, 4))
    step = draw(steps)
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
        data_files=tuple(draw(data_files)),
        logical_bytes=draw(st.integers(0, 2**63)),
        written_bytes=draw(st.integers(0, 2**63)),
        leaves=draw(st.integers(0, 2**40)),
        chunk_bytes=draw(st.integers(4096, 64 << 20)),
        root=draw(st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)),
        created_unix=draw(created),
    )


@given(commit_records())
def test_commit_record_round_trip(record: CommitRecord) -> None:
    body = record.to_json()
    doc = json.loads(body)
    assert doc["kind"] == "cryosnap.commit" and doc["format_version"] == COMMIT_FORMAT_VERSION
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
    doc = with_field(doc, name, value)
    doc.pop("checksum", None)
    doc["checksum"] = commit_checksum(doc)
    return json.dumps(doc).encode()


_REF0 = {"rank": 0, "key": "versions/000000000001/rank-00000.json", "xxh3_128": "0" * 32}
COMMIT_CASES = [
    ("step", -1, "'step'"),
    ("step", MISSING, "'step'"),
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
    ids=[f"{n}={'missing' if v is MISSING else v!r}"[:40] for n, v, _ in COMMIT_CASES],
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
