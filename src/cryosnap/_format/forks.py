"""Fork records and holds (docs/FORMAT.md, "Forks"): a run forked from a version of another
run names that run's data files instead of copying them.

A fork's root holds ``FORK.json`` (:class:`ForkRecord`): its token, the version it was forked
from, and the *ancestors*, the runs whose data files its manifests name as
``ancestors/<i>/data/...``. Each ancestor holds ``forks/<token>.json`` (:class:`Hold`): the fork
that reads it and the data files it reads, which that run's retention keeps. Pure: keys, the
JSON texts and their validation; no I/O.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import xxhash

from cryosnap._format.document import ANCESTOR_KEY, fail, int_field, parse_json, unix_field
from cryosnap._format.keys import validate_key
from cryosnap._format.limits import MAX_STEP

__all__ = [
    "FORK_FORMAT_VERSION",
    "FORK_KEY",
    "HOLDS_PREFIX",
    "MAX_ANCESTORS",
    "ForkRecord",
    "Hold",
    "ancestor_key",
    "hold_key",
    "new_token",
    "split_ancestor_key",
    "token_of_hold_key",
]

FORK_FORMAT_VERSION = 1
FORK_KEY = "FORK.json"
HOLDS_PREFIX = "forks"
# Forks of forks of ...: each level adds at most one ancestor.
MAX_ANCESTORS = 1024
_TOKEN = re.compile(r"[0-9a-f]{32}")
_HOLD = re.compile(r"forks/([0-9a-f]{32})\.json")
# The longest URL a reference may name (a path, or an fsspec URL).
_MAX_URL = 4096


def new_token() -> str:
    return secrets.token_hex(16)


def hold_key(token: str) -> str:
    """Where an ancestor keeps the hold of the fork ``token``."""
    return f"{HOLDS_PREFIX}/{token}.json"


def token_of_hold_key(key: str) -> str | None:
    m = _HOLD.fullmatch(key)
    return None if m is None else m.group(1)


def ancestor_key(index: int, key: str) -> str:
    """How a fork names the data file ``key`` (``data/...``) of its ancestor ``index``."""
    return f"ancestors/{index}/{key}"


def split_ancestor_key(key: str) -> tuple[int, str] | None:
    """``(index, data key)`` of a key naming an ancestor's data file; None for any other key
    (a key that starts like one and is malformed is None too: the callers' checks refuse it)."""
    if ANCESTOR_KEY.fullmatch(key) is None:
        return None
    _, index, inner = key.split("/", 2)
    try:
        validate_key(inner)
    except ValueError:
        return None
    return int(index), inner


def _checksum(doc: dict[str, Any]) -> str:
    return xxhash.xxh3_128_hexdigest(
        json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    )


def _encode(doc: dict[str, Any]) -> bytes:
    doc = {**doc, "checksum": _checksum(doc)}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _decode(data: bytes, where: str, kind: str) -> dict[str, Any]:
    doc = parse_json(data, where, (FORK_FORMAT_VERSION,))
    if doc.get("kind") != kind:
        raise fail(where, f"not a {kind} document")
    checksum = doc.pop("checksum", None)
    if checksum != _checksum(doc):
        raise fail(where, "checksum mismatch: the record is damaged or was edited")
    token = doc.get("token")
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise fail(where, f"malformed token {token!r:.80}")
    return doc


def _url(raw: Any, where: str, field: str) -> str:
    if not isinstance(raw, str) or not raw or len(raw) > _MAX_URL or "\x00" in raw:
        raise fail(where, f"field {field!r} must be a location, got {raw!r:.80}")
    return raw


@dataclass(frozen=True, slots=True)
class ForkRecord:
    """``FORK.json`` of a fork: ``token`` names its holds; it was forked from version ``step``
    of the run at ``parent`` (whose commit record hashed to ``parent_commit``); its manifests'
    ``ancestors/<i>/`` keys name the data files of ``ancestors[i]``."""

    token: str
    parent: str
    step: int
    parent_commit: str
    ancestors: tuple[str, ...]
    created_unix: float

    def to_json(self) -> bytes:
        return _encode(
            {
                "format_version": FORK_FORMAT_VERSION,
                "kind": "cryosnap.fork",
                "token": self.token,
                "parent": self.parent,
                "step": self.step,
                "parent_commit": self.parent_commit,
                "ancestors": list(self.ancestors),
                "created_unix": self.created_unix,
            }
        )

    @classmethod
    def from_json(cls, data: bytes, where: str) -> ForkRecord:
        doc = _decode(data, where, "cryosnap.fork")
        raw = doc.get("ancestors")
        if not isinstance(raw, list) or len(raw) > MAX_ANCESTORS:
            raise fail(where, f"field 'ancestors' must be a list of at most {MAX_ANCESTORS}")
        commit = doc.get("parent_commit")
        if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{32}", commit):
            raise fail(where, f"malformed field 'parent_commit' {commit!r:.80}")
        return cls(
            token=doc["token"],
            parent=_url(doc.get("parent"), where, "parent"),
            step=int_field(doc, "step", where, hi=MAX_STEP),
            parent_commit=commit,
            ancestors=tuple(_url(a, where, "ancestors") for a in raw),
            created_unix=unix_field(doc, "created_unix", where),
        )


@dataclass(frozen=True, slots=True)
class Hold:
    """``forks/<token>.json`` in an ancestor: the fork at ``fork`` (token ``token``), forked
    from version ``step`` of ``parent`` (this run, or a fork of it in between), reads
    ``data_files`` of this run: its retention keeps them while the hold exists."""

    token: str
    fork: str
    parent: str
    step: int
    data_files: tuple[str, ...]
    created_unix: float

    @property
    def key(self) -> str:
        return hold_key(self.token)

    def to_json(self) -> bytes:
        return _encode(
            {
                "format_version": FORK_FORMAT_VERSION,
                "kind": "cryosnap.hold",
                "token": self.token,
                "fork": self.fork,
                "parent": self.parent,
                "step": self.step,
                "data_files": list(self.data_files),
                "created_unix": self.created_unix,
            }
        )

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Hold:
        doc = _decode(data, where, "cryosnap.hold")
        files = doc.get("data_files")
        if not isinstance(files, list):
            raise fail(where, "field 'data_files' must be a list")
        checked = []
        for f in files:
            if not isinstance(f, str) or not f.startswith("data/"):
                raise fail(where, f"data file {f!r:.80} is not under data/")
            try:
                checked.append(validate_key(f))
            except ValueError as exc:
                raise fail(where, f"unsafe data file name {f!r:.80}") from exc
        return cls(
            token=doc["token"],
            fork=_url(doc.get("fork"), where, "fork"),
            parent=_url(doc.get("parent"), where, "parent"),
            step=int_field(doc, "step", where, hi=MAX_STEP),
            data_files=tuple(checked),
            created_unix=unix_field(doc, "created_unix", where),
        )
