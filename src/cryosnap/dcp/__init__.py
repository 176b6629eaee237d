"""cryosnap as a ``torch.distributed.checkpoint`` (DCP) storage backend.

``dcp.save(state_dict, storage_writer=cryosnap.dcp.StorageWriter("/shared/run"))`` writes one
version; :class:`StorageReader` loads it. Importing this module imports torch.
docs/INTEGRATIONS.md says how to use it; docs/design/dcp.md has an example and the modules.
"""

from __future__ import annotations

from cryosnap.dcp._convert import ImportResult, full_state_dict, import_dcp
from cryosnap.dcp._reader import StorageReader, read_version_metadata
from cryosnap.dcp._schema import DcpError, DcpFormatError
from cryosnap.dcp._writer import StorageWriter

__all__ = [
    "DcpError",
    "DcpFormatError",
    "ImportResult",
    "StorageReader",
    "StorageWriter",
    "full_state_dict",
    "import_dcp",
    "read_version_metadata",
]
