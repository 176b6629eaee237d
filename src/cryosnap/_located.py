"""Errors located where a pipeline knows which version and store it works on: a raiser deep in
the read or write path names the leaf or the chunk, the entry of the pipeline adds the step
and the store's URL (:func:`located`). Pure; runs on any thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from cryosnap.errors import CheckpointError

__all__ = ["located"]


@contextmanager
def located(*, step: int | None = None, path: str | None = None) -> Iterator[None]:
    """The block works on version ``step`` of ``path`` (a run, level or store URL): a
    :class:`CheckpointError` raised inside that does not say its step or path yet gets these,
    where the raiser deep in a pipeline did not know them."""
    try:
        yield
    except CheckpointError as exc:
        if exc.step is None and step is not None:
            exc.step = step
        if exc.path is None and path is not None:
            exc.path = path
        raise
