"""The items a capture hands the part writer: pieces of blob bytes, runs found unchanged on
the device, runs hashed in place because another rank writes them, and the batch that carries
them in blob order. Pure values, no I/O; made on the capture's thread, consumed on the writer
thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Batch", "Hashed", "Item", "Piece", "Unchanged"]


@dataclass(slots=True)
class Piece:
    """``view`` holds bytes ``[offset, offset + len(view))`` of blob ``blob``."""

    blob: int
    offset: int
    view: memoryview


@dataclass(slots=True)
class Unchanged:
    """Chunks ``first .. first + count - 1`` of blob ``blob`` are the same as in the version
    the capture compared with (never copied); ``nbytes`` of them."""

    blob: int
    first: int
    count: int
    nbytes: int


@dataclass(slots=True)
class Hashed:
    """Bytes ``[offset, offset + nbytes)`` of blob ``blob`` (whole chunks, the last may be
    short) that another rank writes: never copied, hashed in place; ``digests`` holds their
    16-byte chunk hashes back to back."""

    blob: int
    offset: int
    nbytes: int
    digests: bytes


Item = Piece | Unchanged | Hashed


@dataclass(slots=True)
class Batch:
    """Pieces to write back to back (and unchanged or hashed runs, in blob order); ``release``
    runs once they are on storage (or dropped)."""

    pieces: list[Item]
    release: Callable[[], None] = field(default=lambda: None)

    @property
    def nbytes(self) -> int:
        """The state's bytes this batch covers (unchanged and hashed runs included)."""
        return sum(p.view.nbytes if isinstance(p, Piece) else p.nbytes for p in self.pieces)
