"""cryosnap as a ``torch.distributed.checkpoint`` (DCP) storage backend.

FSDP / DTensor programs keep their DCP code and get cryosnap's versions underneath:
incremental (only changed chunks are written), scratch + persistent levels, every chunk
verified on read, one global commit per save, no pickle in the metadata::

    import torch.distributed.checkpoint as dcp
    import cryosnap.dcp

    writer = cryosnap.dcp.StorageWriter("/shared/run", scratch="/local/nvme", keep=3)
    dcp.save(state_dict, storage_writer=writer)                 # one version, all ranks
    dcp.async_save(state_dict, storage_writer=writer).result()  # staged in the writer's pool
    dcp.load(state_dict, storage_reader=cryosnap.dcp.StorageReader("/shared/run"))
    writer.close()

- :class:`StorageWriter` (and DCP's ``AsyncStager``): ``_writer.py``, ``_staging.py``.
- :class:`StorageReader`: ``_reader.py``.
- DCP's ``Metadata`` as JSON in the version (schema ``cryosnap.dcp/1``): ``_schema.py``.
- How items lie in each rank's part: ``_parts.py``.
- :func:`full_state_dict` (``cryosnap export``) and :func:`import_dcp` (``cryosnap
  import-dcp``): ``_convert.py``.

docs/INTEGRATIONS.md ("torch.distributed.checkpoint") says how to use it, docs/FORMAT.md
("DCP metadata") what is stored. Importing this module imports torch.
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
