"""The write, resolve, read and retire pipelines of one version on one tier.

One private module per pipeline; imports point one way (each only to those above it).
Underscored names are shared between these modules but private to the package. Writes run on
the Checkpointer's background thread, reads on the caller's; no collectives here. What they
are cut by (sizes, shares, threads) is one value each, :class:`ReadLimits` and
:class:`WriteLimits`, set for a block by :func:`read_limits` and :func:`write_limits`.
docs/design/engine.md lists the modules.
"""

from __future__ import annotations

from cryosnap.engine._copy import copy_version
from cryosnap.engine._fork import (
    ForkPlan,
    create_fork,
    fork_record,
    held_files,
    holds,
    plan_fork,
    release_holds,
)
from cryosnap.engine._limits import (
    IO_BATCH_BYTES,
    ReadLimits,
    WriteLimits,
    read_limits,
    write_limits,
)
from cryosnap.engine._read import (
    FlatPart,
    PartNotFoundError,
    caller_stacklevel,
    read_blob,
    read_flat,
    read_part,
    read_selection,
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
    versions_among,
)
from cryosnap.engine._resolved import (
    MAX_CHAIN,
    ResolvedBlob,
    ResolvedPart,
    chain_keys,
    chain_manifests,
    resolve,
    resolve_version,
)
from cryosnap.engine._resolved import _resolve_one as _resolve_one
from cryosnap.engine._retire import (
    RetirePlan,
    VersionSpace,
    apply_retire,
    ignore_files,
    incomplete_files,
    plan_retire,
    retire,
    version_space,
)
from cryosnap.engine._select import (
    ROOT_PATH,
    closest_paths,
    cut_part,
    find_subtree,
    renumbered,
    validate_keys,
)
from cryosnap.engine.write import PartResult, PartWriter, assign_shares
from cryosnap.engine.write import _split_pieces as _split_pieces

__all__ = [
    "FlatPart",
    "ForkPlan",
    "IO_BATCH_BYTES",
    "MAX_CHAIN",
    "PartNotFoundError",
    "PartResult",
    "PartWriter",
    "ROOT_PATH",
    "ReadLimits",
    "ResolvedBlob",
    "ResolvedPart",
    "RetirePlan",
    "VersionSpace",
    "WriteLimits",
    "apply_retire",
    "assign_shares",
    "caller_stacklevel",
    "chain_keys",
    "chain_manifests",
    "closest_paths",
    "copy_version",
    "create_fork",
    "cut_part",
    "find_subtree",
    "fork_record",
    "held_files",
    "holds",
    "ignore_files",
    "incomplete_files",
    "list_records",
    "list_steps",
    "list_versions",
    "plan_fork",
    "plan_retire",
    "read_blob",
    "read_commit",
    "read_flat",
    "read_limits",
    "read_manifest",
    "read_part",
    "read_selection",
    "release_holds",
    "renumbered",
    "resolve",
    "resolve_part",
    "resolve_version",
    "retire",
    "step_exists",
    "validate_keys",
    "verify_part",
    "version_space",
    "versions_among",
    "write_limits",
]
