"""Which memory each blob's bytes go to in a restore (:class:`BlobClaims`): every blob
claimed once, by memory of exactly its size, and named by its first leaf for messages.

Pure; the caller's thread (one restore's allocation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cryosnap.errors import CheckpointFormatError

__all__ = ["MAX_ALIGN", "BlobClaims", "Place"]

# Where a blob's bytes already lie (the mapped data files of engine/fetch/_mapped.py): blob,
# alignment -> the memory, or None (see Restorer).
Place = Callable[[int, int], "memoryview | None"]
# The alignment asked of a storage that views of several dtypes share: the largest element.
MAX_ALIGN = 16


class BlobClaims:
    """The blobs of one restore, by index: ``sizes`` (as the manifest claims them, checked
    against their chunks before), the memory each is read into (``dest``: None until claimed),
    the path of the first leaf that names each (``paths``), and whether that memory is
    ``into=``'s own (``direct``) or a mapped file's (``placed``), found by ``place``."""

    __slots__ = ("dest", "direct", "paths", "place", "placed", "sizes")

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.dest: list[Any] = [None] * len(sizes)
        self.paths: list[str] = [""] * len(sizes)
        self.direct: list[bool] = [False] * len(sizes)
        self.placed: list[bool] = [False] * len(sizes)
        self.place: Place | None = None

    def blob(self, node: dict[str, Any], path: str) -> int:
        """The blob the leaf ``node`` at ``path`` names (a valid index), noted as named."""
        b = node.get("b")
        if type(b) is not int or not 0 <= b < len(self.sizes):
            raise CheckpointFormatError(f"leaf {path}: invalid blob reference {b!r}")
        if not self.paths[b]:
            self.paths[b] = path
        return b

    def name(self, b: int, path: str) -> None:
        """Note ``path`` as blob ``b``'s, unless a leaf named it before."""
        if not self.paths[b]:
            self.paths[b] = path

    def claim(self, b: int, view: memoryview, path: str) -> None:
        """Blob ``b``'s bytes go to ``view`` (claimed by the leaf at ``path``)."""
        if self.dest[b] is not None:
            raise CheckpointFormatError(f"leaf {path}: blob {b} is claimed twice")
        if view.nbytes != self.sizes[b]:
            raise CheckpointFormatError(
                f"leaf {path}: holds {view.nbytes} bytes but its blob has {self.sizes[b]}"
            )
        self.dest[b] = view

    def mapped(self, b: int, alignment: int) -> memoryview | None:
        """The memory ``place`` has for blob ``b`` at ``alignment`` (``placed[b]`` then set),
        or None: the leaf is allocated (always for an empty blob)."""
        if self.place is None or not self.sizes[b]:
            return None
        view = self.place(b, alignment)
        if view is not None:
            self.placed[b] = True
        return view

    def views(self) -> list[memoryview]:
        """Every blob's memory, once every leaf claimed its own."""
        views: list[memoryview] = []
        for i, dest in enumerate(self.dest):
            if dest is None:
                raise CheckpointFormatError(f"blob {i} is referenced by no leaf")
            views.append(dest)
        return views
