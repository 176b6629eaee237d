"""LocalCoordinator: a world of one. Every collective returns at once; no threads, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cryosnap.dist._common import outgoing, to_bytes

__all__ = ["LocalCoordinator"]


class LocalCoordinator:
    """Rank 0 of a world of one: the coordinator of a single-process run."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def __repr__(self) -> str:
        return "LocalCoordinator()"

    def barrier(self, *, timeout: float | None = None) -> None:
        return None

    def all_gather(self, obj: Any, *, timeout: float | None = None) -> list[Any]:
        return [obj]

    def gather(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> list[Any] | None:
        if root != 0:
            raise ValueError(f"root={root} is invalid in a world of one: allowed is 0")
        return [obj]

    def broadcast(self, obj: Any, *, root: int = 0, timeout: float | None = None) -> Any:
        if root != 0:
            raise ValueError(f"root={root} is invalid in a world of one: allowed is 0")
        return obj

    def exchange(
        self, sends: Mapping[int, bytes | bytearray | memoryview], *, timeout: float | None = None
    ) -> dict[int, bytes]:
        views = outgoing(sends, 1)
        return {0: to_bytes(views[0])} if 0 in views else {}

    def channel(self, name: str) -> LocalCoordinator:
        return self
