"""The newest peer: Meta's ``torch_checkpointing`` (``CheckpointManager.save/load``: shared-memory
staging, then a background writer process). Optional: measured where it imports, else skipped
with a note. Runs on the caller's thread (its stager's threads and writer process are its own).

Configured as its troubleshooting guide says for a CPU-only torch (no pinned memory, no
non-blocking copy), with ``LocalFileSystemStorageConfig(use_direct_io=False)``: its default
``O_DIRECT`` writer fails with EINVAL on unaligned writes on an ext4 disk. Its writer does not
fsync; the bench does, after its write future, so that "durable" means on disk for every peer.
Its loads run with ``use_mmap=False``: the default mmap reads nothing until the tensors are used.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryosnap.bench._peers import FinishFn, Peer
from cryosnap.bench._probes import fsync_path, iter_files

if TYPE_CHECKING:
    import torch

    StateDict = dict[str, torch.Tensor]

KEY = "torch_checkpointing"
_START_SECONDS = 600
VERSION = "0.1.1"  # the version the bench was written and measured against
NOTE = (
    "CheckpointManager with an async saver staged without pinned memory "
    "(its troubleshooting guide's CPU-only configuration) and "
    "LocalFileSystemStorageConfig(use_direct_io=False) (its default O_DIRECT writer fails with "
    "EINVAL on unaligned writes here); stall: save() until staged (manager.lock()); its writer "
    "process does not fsync: durable adds the bench's fsync of its files and folder after the "
    "write future; loads with use_mmap=False (the default mmap reads nothing until used); "
    "its writer process is started by an untimed first save (allowed 600 s, not its default "
    "30: a loaded machine's spawn and torch import took longer), and its CPU time is not in CPU "
    "s/GB (this process's only)"
)


def unavailable() -> str | None:
    """Why the peer cannot be measured here (None: it can)."""
    try:
        importlib.import_module("torch_checkpointing")
    except ImportError as exc:
        if exc.name == "torch_checkpointing":
            return f"not installed; pip install --no-deps torch_checkpointing=={VERSION}"
        return f"does not import: {exc}"
    except Exception as exc:  # a torch it does not support fails in its own way
        return f"does not import: {type(exc).__name__}: {exc}"
    return None  # measured: machine_info records its version


def manager() -> Any:
    """A ``CheckpointManager`` in the CPU-only configuration (see the module's docstring)."""
    import torch
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.config import (
        AsyncCheckpointSaverConfig,
        CheckpointLoaderConfig,
    )
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    cuda = torch.cuda.is_available()
    return CheckpointManager(
        CheckpointManager.Config(
            save=AsyncCheckpointSaverConfig(
                staging_config=CheckpointStagerConfig(
                    use_pinned_memory=cuda, use_non_blocking_copy=cuda
                ),
                # Its default, 30 s for the writer process to start (spawn, import torch), is
                # too short on a loaded machine; the start is untimed.
                process_config=CheckpointProcessConfig(subprocess_init_timeout_secs=_START_SECONDS),
            ),
            load=CheckpointLoaderConfig(use_mmap=False),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder from the deepest up to ``root``."""
    folders = {root}
    for path in iter_files(root):
        fsync_path(path)
        folders.update(p for p in path.parents if p.is_relative_to(root))
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        fsync_path(folder)


def save(mgr: Any, path: Path, payload: dict[str, Any]) -> Any:
    """Start an async save of ``payload``; return when it is staged (the state may change
    again), with the write future."""
    future = mgr.save(str(path), payload)
    with mgr.lock():  # blocks while its staging copy is in progress
        pass
    return future


class TorchCheckpointingPeer(Peer):
    """``CheckpointManager.save`` (async) and ``load``, fresh and into; one manager for the
    run (its writer process is started once, as a job starts it once)."""

    key = KEY
    label = "torch_checkpointing save / load"
    restores = True
    restores_into = True
    note = NOTE
    _dir = "tc"

    def __init__(self) -> None:
        self._manager: Any = None

    def setup(self, root: Path, state: StateDict) -> None:
        self._manager = manager()
        first = root / f"{self.key}-setup"
        save(self._manager, first, {"state": state}).result()
        shutil.rmtree(first, ignore_errors=True)

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        path = work / self._dir
        future = save(self._manager, path, {"state": state})

        def durable() -> None:
            future.result()
            fsync_tree(path)
            fsync_path(work)

        return durable

    def load(self, work: Path) -> object:
        loaded = self._manager.load(str(work / self._dir), into={"state": None})
        return loaded["state"]

    def load_into(self, work: Path, into: StateDict) -> object:
        self._manager.load(str(work / self._dir), into={"state": into})
        return into

    def close(self) -> None:
        mgr, self._manager = self._manager, None
        if mgr is not None:
            mgr.close()
