"""The write, resolve, read and retire pipelines of one version on one tier.

One private module per pipeline; imports point one way (each only to those above it):

- ``_records``: commit records and manifests: list, read, check against recorded hashes.
- ``_resolved``: resolve a manifest's chain of bases into per-chunk locations
  (:class:`ResolvedPart`); no data is read.
- ``items``: what a capture hands the writer (:class:`~.items.Piece`, ``Unchanged``,
  ``Hashed``, ``Batch``); pure values.
- ``write/``: :class:`PartWriter`, composing the differ (hash, diff against the base), the
  appenders (new chunks, one I/O thread per data file) and the share map of replicated blobs
  (:func:`assign_shares`; the others' shares placed after the ranks' exchange); the
  Checkpointer's background thread. ``_write`` re-exports it.
- ``_retire``: reference-counted retention (:func:`plan_retire`, :func:`retire`); the writer.
- ``read/``: the read plan of a part (pure), its executor on the read pool, the mapped data
  files: read the leaves in large runs and verify every chunk (``_fetch`` re-exports it).
- ``_read``: :func:`read_part` and :func:`verify_part` (check, allocate, resolve, fetch,
  build), :func:`newest_restorable`; the caller's thread.

Underscored names are shared between these modules but private to the package. Writes run on
the Checkpointer's background thread, reads on the caller's; no collectives here.
"""

from __future__ import annotations

from cryosnap.engine._read import (
    FlatPart,
    PartNotFoundError,
    caller_stacklevel,
    every_version_damaged,
    newest_restorable,
    read_blob,
    read_flat,
    read_part,
    resolve_part,
    verify_part,
)
from cryosnap.engine._read import _prefaulted as _prefaulted
from cryosnap.engine._records import (
    list_records,
    list_steps,
    list_versions,
    read_commit,
    read_manifest,
    step_exists,
)
from cryosnap.engine._resolved import (
    MAX_CHAIN,
    ResolvedBlob,
    ResolvedPart,
    chain_manifests,
    resolve,
    resolve_version,
)
from cryosnap.engine._resolved import _resolve_one as _resolve_one
from cryosnap.engine._retire import RetirePlan, apply_retire, ignore_files, plan_retire, retire
from cryosnap.engine._select import validate_keys
from cryosnap.engine.read import _FRAGMENTED_RUNS as _FRAGMENTED_RUNS
from cryosnap.engine.read import IO_BATCH_BYTES
from cryosnap.engine.write import PartResult, PartWriter, assign_shares
from cryosnap.engine.write import _split_pieces as _split_pieces

__all__ = [
    "IO_BATCH_BYTES",
    "MAX_CHAIN",
    "PartNotFoundError",
    "PartResult",
    "PartWriter",
    "ResolvedBlob",
    "ResolvedPart",
    "RetirePlan",
    "caller_stacklevel",
    "chain_manifests",
    "every_version_damaged",
    "ignore_files",
    "list_records",
    "list_steps",
    "list_versions",
    "newest_restorable",
    "read_blob",
    "read_commit",
    "read_flat",
    "resolve_part",
    "FlatPart",
    "read_manifest",
    "read_part",
    "resolve",
    "resolve_version",
    "apply_retire",
    "assign_shares",
    "plan_retire",
    "retire",
    "step_exists",
    "validate_keys",
    "verify_part",
]
