"""What the format's JSON documents (manifests, commit records) share: parsing with the
``format_version`` checked, the field checks whose messages name the field and the key, the
keys a document may name, and the clock of ``created_unix``.

Pure: validation only, no I/O. Runs on whichever thread calls it.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from cryosnap._format.keys import validate_key
from cryosnap._format.limits import MAX_COUNT, MAX_UNIX
from cryosnap.errors import CheckpointFormatError

__all__ = [
    "ANCESTOR_KEY",
    "data_file",
    "fail",
    "int_field",
    "names_ancestor",
    "now_unix",
    "parse_json",
    "show",
    "unix_field",
    "version_file",
]


def fail(where: str, what: str) -> CheckpointFormatError:
    """The error of a malformed document: ``where`` (the store and key) first, then ``what``."""
    return CheckpointFormatError(f"{where}: {what}")


def show(v: Any) -> str:
    """A value for a message: short, and never str() of an int of thousands of digits (which
    Python refuses)."""
    if type(v) is int and v.bit_length() > 64:
        return f"an int of {v.bit_length()} bits"
    return f"{v!r:.60}"


def int_field(
    doc: dict[str, Any], name: str, where: str, *, lo: int = 0, hi: int = MAX_COUNT
) -> int:
    """``doc[name]``, an int (not a bool) in ``[lo, hi]``."""
    v = doc.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise fail(where, f"field {name!r} must be an int in [{lo}, {hi}], got {show(v)}")
    return v


def unix_field(doc: dict[str, Any], name: str, where: str) -> float:
    """``doc[name]``, a time in seconds since the epoch (int or float)."""
    v = doc.get(name)
    if not isinstance(v, (int, float)) or type(v) is bool or not 0 <= v <= MAX_UNIX:
        # NaN fails the comparison; 1e400 is inf; a huge int would overflow float().
        raise fail(where, f"field {name!r} must be a time in [0, {MAX_UNIX:.0f}], got {show(v)}")
    return float(v)


def data_file(key: Any, where: str) -> str:
    """``key``, a safe key under ``data/``, or ``ancestors/<i>/data/...`` (a fork's name for a
    data file of one of its ancestors, docs/FORMAT.md "Forks")."""
    if isinstance(key, str) and key.startswith("ancestors/"):
        if ANCESTOR_KEY.fullmatch(key) is None:
            raise fail(where, f"malformed ancestor data file {key!r:.80}")
    elif not isinstance(key, str) or not key.startswith("data/"):
        raise fail(where, f"data file {key!r:.80} is not under data/")
    try:
        return validate_key(key)
    except ValueError as exc:
        raise fail(where, f"unsafe data file name {key!r:.80}") from exc


# A fork's name for data file ``data/...`` of its ancestor ``i`` (_format/forks.py).
ANCESTOR_KEY = re.compile(r"ancestors/(?:0|[1-9][0-9]{0,3})/data/[^/]+\.dat")


def names_ancestor(files: Any) -> bool:
    """Whether any of the data file keys ``files`` names an ancestor's file (a document that
    does is written in the format version that says so)."""
    return any(f.startswith("ancestors/") for f in files)


def version_file(key: Any, where: str) -> str:
    """``key``, a safe key under ``versions/`` (a manifest)."""
    try:
        validate_key(key)
    except ValueError as exc:
        raise fail(where, f"unsafe key {key!r:.80}") from exc
    if not str(key).startswith("versions/"):
        raise fail(where, f"key {key!r:.80} is not under versions/")
    return str(key)


def parse_json(data: bytes, where: str, versions: tuple[int, ...]) -> dict[str, Any]:
    """The JSON object ``data``, its ``format_version`` one of ``versions``."""
    try:
        # NaN, Infinity and 1e400 (inf) parse; every number is range-checked where it is used.
        doc = json.loads(data)
    except RecursionError as exc:
        raise fail(where, "not valid JSON (nested too deeply)") from exc
    except ValueError as exc:  # also UnicodeDecodeError, and ints of over 4,300 digits
        raise fail(where, f"not valid JSON ({exc!s:.200})") from exc
    if not isinstance(doc, dict):
        raise fail(where, "not a JSON object")
    fv = doc.get("format_version")
    if type(fv) is not int or fv not in versions:
        reads = " and ".join(map(str, versions))
        raise fail(
            where,
            f"format_version {fv!r} is not supported by this cryosnap (reads {reads}); "
            "upgrade cryosnap to read it",
        )
    return doc


def now_unix() -> float:
    """The ``created_unix`` of a document written now."""
    return time.time()
