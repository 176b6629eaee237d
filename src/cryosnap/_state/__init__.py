"""State trees <-> blobs: flatten a state into a skeleton and blobs, build it back, fill
``into=`` in place. Pure (a copy to a GPU and the files of ``cryosnap.File`` leaves aside);
runs on the caller's thread."""

from __future__ import annotations

from cryosnap._state.build import DeviceMove, Place, Restorer
from cryosnap._state.device import DeviceFeed
from cryosnap._state.files import File
from cryosnap._state.flatten import (
    PACK_BYTES,
    PACK_LEAF_FRACTION,
    Blob,
    FlatState,
    flatten,
    is_stateful,
)
from cryosnap._state.into import apply_into, check_into, direct_targets
from cryosnap._state.reuse import FlattenCache

__all__ = [
    "PACK_BYTES",
    "PACK_LEAF_FRACTION",
    "Blob",
    "DeviceFeed",
    "DeviceMove",
    "File",
    "FlatState",
    "FlattenCache",
    "Place",
    "Restorer",
    "apply_into",
    "check_into",
    "direct_targets",
    "flatten",
    "is_stateful",
]
