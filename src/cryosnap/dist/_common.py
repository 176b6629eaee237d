"""Defaults and argument checks shared by the coordinators (no imports of the implementations).

Pure functions: they run on the caller's thread, before a collective communicates anything.
"""

from __future__ import annotations

from collections.abc import Mapping

from cryosnap._validate import integer, wrong_type

__all__ = ["DEFAULT_TIMEOUT_SECONDS", "MAX_MESSAGE_BYTES", "outgoing", "to_bytes"]

# How long a collective waits for every participant by default: longer than any save step of
# a healthy run (a rank may be writing a large part), short enough that a dead rank surfaces.
DEFAULT_TIMEOUT_SECONDS = 600.0

# The largest payload of one exchange message: gloo's and MPI's element counts are C ints.
MAX_MESSAGE_BYTES = 2**31 - 1


def outgoing(
    sends: Mapping[int, bytes | bytearray | memoryview], world_size: int
) -> dict[int, memoryview]:
    """``sends`` of :meth:`Coordinator.exchange`, checked, as flat byte views by destination.

    Checked before any communication so that a caller's mistake is a ``TypeError`` or
    ``ValueError`` on its own rank (the others then time out in the collective it skipped). A
    view shares the payload's memory; only a non-contiguous or structured buffer is copied.
    """
    if not isinstance(sends, Mapping):
        wrong_type(sends, "sends", "a mapping of destination rank to bytes")
    out: dict[int, memoryview] = {}
    for dst, payload in sends.items():
        integer(dst, "destination rank", minimum=0, maximum=world_size - 1)
        try:
            view = memoryview(payload)
        except TypeError:
            wrong_type(payload, f"sends[{dst}]", "bytes, bytearray or memoryview")
        flat = _flat(view)
        if flat.nbytes > MAX_MESSAGE_BYTES:
            raise ValueError(
                f"sends[{dst}] holds {flat.nbytes} bytes: allowed is at most "
                f"{MAX_MESSAGE_BYTES} per message (send larger data in windows)"
            )
        out[dst] = flat
    return out


def _flat(view: memoryview) -> memoryview:
    if view.c_contiguous:
        try:
            return view.cast("B")
        except (TypeError, ValueError):  # a struct format cast() refuses: copied below
            pass
    return memoryview(view.tobytes())


def to_bytes(view: memoryview) -> bytes:
    """The payload behind ``view`` as bytes: the caller's own object when it is a whole
    ``bytes`` (immutable, so sharing it is safe), else a copy."""
    whole = view.obj
    # A C-contiguous view of len(whole) bytes inside a len(whole)-byte buffer is all of it.
    if type(whole) is bytes and view.nbytes == len(whole):
        return whole
    return view.tobytes()
