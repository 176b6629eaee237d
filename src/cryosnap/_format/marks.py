"""Mark records (docs/FORMAT.md, "Marks"): a label a user gave a committed version
(``Checkpointer.mark``), one small document per label beside the version's commit record,
bound to that record by its hash. Label rules, keys, and the JSON text, validated on load.

Pure: no I/O. Written by the caller's thread (``Checkpointer.mark``), read by ``Run.marks``
and a restore's choice of step.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from cryosnap._format.document import fail, int_field, parse_json, unix_field
from cryosnap._format.keys import version_prefix
from cryosnap._format.limits import MAX_STEP

__all__ = [
    "MARK_FORMAT_VERSION",
    "UNHEALTHY",
    "MarkRecord",
    "check_label",
    "mark_key",
    "parse_mark_key",
]

MARK_FORMAT_VERSION = 1
# The mark cryosnap gives (never stored: read from the statistics) a version holding NaN or
# Inf in a floating-point leaf.
UNHEALTHY = "unhealthy"
# A label: a letter or digit, then up to 63 of letters, digits and ._- (a file name on every
# store, never a path).
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KEY = re.compile(r"versions/([0-9]{12})/MARK-([A-Za-z0-9][A-Za-z0-9._-]{0,63})\.json")


def check_label(label: object) -> str:
    """``label`` as a user may give it (raises TypeError or ValueError naming it)."""
    if not isinstance(label, str):
        raise TypeError(f"label must be a str, got {type(label).__name__}")
    if not _LABEL.fullmatch(label):
        raise ValueError(
            f"label={label!r:.80} is invalid: allowed are a letter or digit, then up to 63 of "
            "A-Z a-z 0-9 . _ -"
        )
    if label == UNHEALTHY:
        raise ValueError(
            f"label={label!r} is cryosnap's own: a version holding NaN or Inf is marked so"
        )
    return label


def mark_key(step: int, label: str) -> str:
    return f"{version_prefix(step)}/MARK-{label}.json"


def parse_mark_key(key: str) -> tuple[int, str] | None:
    """The step and label of a mark record's key, or None for any other key."""
    m = _KEY.fullmatch(key)
    return None if m is None else (int(m.group(1)), m.group(2))


@dataclass(frozen=True, slots=True)
class MarkRecord:
    """Label ``label`` on version ``step``: the one whose commit record's bytes hash to
    ``commit_xxh3`` (a version saved again at the step, after a remove, does not carry it)."""

    step: int
    label: str
    commit_xxh3: str
    created_unix: float

    def to_json(self) -> bytes:
        doc = {
            "format_version": MARK_FORMAT_VERSION,
            "kind": "cryosnap.mark",
            "step": self.step,
            "label": self.label,
            "commit_xxh3_128": self.commit_xxh3,
            "created_unix": self.created_unix,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> MarkRecord:
        doc: dict[str, Any] = parse_json(data, where, (MARK_FORMAT_VERSION,))
        if doc.get("kind") != "cryosnap.mark":
            raise fail(where, "not a cryosnap mark record")
        label, digest = doc.get("label"), doc.get("commit_xxh3_128")
        if not isinstance(label, str) or not _LABEL.fullmatch(label):
            raise fail(where, f"malformed label {label!r:.80}")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{32}", digest):
            raise fail(where, f"malformed commit_xxh3_128 {digest!r:.80}")
        return cls(
            int_field(doc, "step", where, hi=MAX_STEP),
            label,
            digest,
            unix_field(doc, "created_unix", where),
        )
