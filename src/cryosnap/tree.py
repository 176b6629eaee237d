"""Where the state trees lived before ``cryosnap._state``: its names, for old imports."""

from __future__ import annotations

from cryosnap._devcopy import copy_to_device
from cryosnap._state import (
    PACK_BYTES,
    PACK_LEAF_FRACTION,
    Blob,
    FlatState,
    Place,
    Restorer,
    apply_into,
    check_into,
    direct_targets,
    flatten,
    is_stateful,
)
from cryosnap._state.flatten import _Packer

__all__ = [
    "PACK_BYTES",
    "PACK_LEAF_FRACTION",
    "Blob",
    "FlatState",
    "Place",
    "Restorer",
    "_Packer",
    "apply_into",
    "check_into",
    "copy_to_device",
    "direct_targets",
    "flatten",
    "is_stateful",
]
