"""Limits on what a manifest, a commit record or a skeleton may claim.

A run directory can come from anyone, so every number is checked before it sizes an
allocation, indexes an array or reaches a syscall; these bounds sit far above anything a real
run writes and far below where numpy's int64 arithmetic, preadv's off_t or Python's float
conversion would overflow. Pure constants.
"""

from __future__ import annotations

from cryosnap._validate import MAX_STEP

__all__ = [
    "MAX_BLOB_BYTES",
    "MAX_BLOB_CHUNKS",
    "MAX_COUNT",
    "MAX_DEPTH",
    "MAX_ELEMENTS",
    "MAX_FILE_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_NDIM",
    "MAX_RANK",
    "MAX_STEP",
    "MAX_UNIX",
]


# Ranks are C ints in MPI and torch.distributed.
MAX_RANK = 2**31 - 1
# Counters that are only reported (leaves, logical and written bytes, metrics): a uint64
# holds them.
MAX_COUNT = 2**64 - 1
# One blob: 128 TiB, more than any single machine's memory. Segment offsets and sizes stay
# below this, so offset + nbytes and chunk index * chunk_bytes never overflow int64.
MAX_BLOB_BYTES = 2**47
MAX_FILE_BYTES = 2**47
# Chunks of one blob. Each segment covers at least one chunk, so a blob has at most this many
# segments, and a sum of per-segment chunk counts stays below 2**62: no int64 sum can wrap.
MAX_BLOB_CHUNKS = 2**31
# Timestamps: 0 to the end of year 9999, what datetime (and the CLI) can render.
MAX_UNIX = 253402300799.0
# JSON nesting of a commit record (flat by design: 3 levels). The state tree of a manifest has
# its own limit, MAX_DEPTH.
MAX_JSON_DEPTH = 16

# Levels of nesting a restored tree may have. Restoring walks the skeleton recursively (at most
# two frames per level), so this keeps every walk well inside Python's default recursion limit
# of 1000 wherever the caller stands; saving itself fails at about 330 levels.
MAX_DEPTH = 200
# Dimensions of a tensor or array: numpy's own limit (torch's is the same).
MAX_NDIM = 64
# Elements of one leaf, zero-sized dimensions included: shapes and strides stay in int64.
MAX_ELEMENTS = 2**62
