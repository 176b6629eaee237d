"""What the tests of the format's documents (manifests, blob entries, commit records) share:
strategies for their fields, a manifest as ``save`` writes it, and a field set or removed."""

from __future__ import annotations

import json
import uuid
from typing import Any

from hypothesis import strategies as st

import cryosnap
from cryosnap._format.keys import manifest_key
from cryosnap._format.limits import MAX_STEP
from cryosnap.storage import open_store

__all__ = [
    "MISSING",
    "WHERE",
    "created",
    "data_files",
    "ranks",
    "saved_manifest",
    "steps",
    "with_field",
]

WHERE = "memory://run: versions/000000000001/x.json"
# A field removed (for with_field).
MISSING = object()

steps = st.integers(0, MAX_STEP)
ranks = st.integers(0, 99_999)
_segment = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_-.", min_size=1, max_size=8)
data_files = st.lists(
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
created = st.floats(min_value=0, max_value=4e9, allow_nan=False)


def saved_manifest(state: Any, chunk_bytes: int) -> bytes:
    """The manifest ``save`` writes for ``state`` (in memory: no fsync, no files)."""
    store = open_store(f"memory://cryosnap-test-{uuid.uuid4().hex}")
    try:
        cryosnap.save(store, state, step=1, chunk_bytes=chunk_bytes)
        return store.read(manifest_key(1, 0))
    finally:
        for key in store.list():
            store.delete(key)


def with_field(doc: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    """A copy of ``doc`` with field ``name`` set to ``value`` (removed: :data:`MISSING`)."""
    doc = json.loads(json.dumps(doc))
    if value is MISSING:
        del doc[name]
    else:
        doc[name] = value
    return doc
