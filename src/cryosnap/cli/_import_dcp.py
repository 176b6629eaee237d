"""``cryosnap import-dcp``: a torch.distributed.checkpoint directory saved as one version.

Runs on the caller's thread, over :func:`cryosnap.dcp.import_dcp` (a Checkpointer: it takes
the run's write lock). torch is imported only when the command runs.
"""

from __future__ import annotations

from cryosnap.cli._common import CliUsageError
from cryosnap.cli._render import plural, print_json, print_line
from cryosnap.progress import human_bytes


def cmd_import_dcp(directory: str, location: str, *, step: int | None, as_json: bool) -> None:
    """Import the DCP checkpoint ``directory`` as version ``step`` of the run at ``location``
    (needs torch)."""
    if not directory or not location:
        raise CliUsageError("DIR and PATH must not be empty")
    try:
        from cryosnap.dcp import import_dcp
    except ImportError as exc:
        raise CliUsageError(
            f"import-dcp needs torch: pip install 'cryosnap[torch]' ({exc})"
        ) from exc
    result = import_dcp(directory, location, step=step)
    if as_json:
        print_json(
            {
                "source": result.source,
                "path": result.path,
                "step": result.step,
                "tensor_chunks": result.tensor_chunks,
                "bytes_items": result.bytes_items,
                "written_bytes": result.info.written_bytes,
            }
        )
        return
    print_line(
        f"imported {result.source} as step {result.step} of {result.path} "
        f"({plural(result.tensor_chunks, 'tensor chunk')}, "
        f"{plural(result.bytes_items, 'bytes item')}, "
        f"{human_bytes(result.info.written_bytes)} written)"
    )
