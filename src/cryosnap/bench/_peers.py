"""The peers measured side by side: the memcpy and raw write+fsync limits, ``torch.save``,
safetensors, torch.distributed.checkpoint (``save`` and ``async_save``), torchsnapshot,
torch_checkpointing (optional: :mod:`cryosnap.bench._torch_checkpointing`), and cryosnap's
``save`` and ``Checkpointer`` eager and lazy. Runs on the caller's thread; a peer's threads
(cryosnap's writer, DCP's executor, torch_checkpointing's writer process) are drained before the
next peer runs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import mmap
import os
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryosnap.bench._config import CHUNK_BYTES
from cryosnap.bench._probes import fsync_path
from cryosnap.bench._workloads import build_state, byte_view, dense_shapes, state_nbytes

if TYPE_CHECKING:
    import torch

    StateDict = dict[str, torch.Tensor]


# ------------------------------------------------------------------------------------- peers


FinishFn = Callable[[], None]


class Peer:
    """One way to save and restore a state dict; the runner times its calls.

    A peer measures a subset of the figures: ``durable`` (its save makes the state durable),
    ``restores`` (a fresh load), ``restores_into`` (a load into preallocated tensors).
    """

    key = ""
    label = ""
    limit = False
    durable = True
    restores = False
    restores_into = False
    note = ""

    def setup(self, root: Path, state: StateDict) -> None:
        """Untimed, once before the first round (``root``: the run's temporary folder)."""

    def begin(self, work: Path, state: StateDict) -> None:
        """Untimed, before each timed save: ``work`` is a fresh, empty folder."""

    def folder(self, work: Path) -> Path:
        """Where the save writes: the folder whose new bytes count and whose files are warmed."""
        return work

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        """Start the save; return when the program may go on, with what waits for durability
        (None: durable already)."""
        raise NotImplementedError

    def load(self, work: Path) -> object:
        raise NotImplementedError

    def load_into(self, work: Path, into: StateDict) -> object:
        raise NotImplementedError

    def end(self) -> None:
        """Untimed, after each repetition's restores (and on the way out of a failure)."""

    def close(self) -> None:
        """Once, after the last round (also after a failure or Ctrl-C)."""
        self.end()

    def saved_state(self, state: StateDict) -> StateDict:
        """The state this peer saves (and its restores are checked against): the run's."""
        return state

    def into_for(self, into: StateDict) -> StateDict:
        """The tensors this peer restores into: the run's."""
        return into


class MemcpyLimit(Peer):
    key = "memcpy"
    label = "memcpy (limit)"
    limit = True
    durable = False

    def __init__(self, into: StateDict) -> None:
        self._into = into

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        for name, tensor in state.items():
            self._into[name].copy_(tensor)
        return None


class RawLimit(Peer):
    """Every tensor's bytes back to back in one file: no format, the limit of the disk.

    The file is sized first (``ftruncate``, as safetensors does), so no write extends it.
    """

    key = "raw"
    label = "raw write+fsync / readinto (limit)"
    limit = True
    restores_into = True
    _file = "raw.bin"

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        with open(work / self._file, "wb", buffering=0) as f:
            os.ftruncate(f.fileno(), state_nbytes(state))
            for tensor in state.values():
                view = byte_view(tensor)
                while view:  # a raw write may be short
                    view = view[f.write(view) :]
            os.fsync(f.fileno())
        fsync_path(work)
        return None

    def load_into(self, work: Path, into: StateDict) -> object:
        with open(work / self._file, "rb", buffering=0) as f:
            for tensor in into.values():
                view = byte_view(tensor)
                while view:
                    n = f.readinto(view)
                    if not n:
                        raise EOFError(f"{work / self._file} is shorter than the state")
                    view = view[n:]
        return into


class RawDirectLimit(Peer):
    """The same bytes with ``O_DIRECT``, from a page-aligned copy of the state made untimed
    before each save (direct I/O needs aligned memory): the disk's own limit, without the
    page cache. Its read goes to the disk every time (a direct read is cold whatever the
    cache), into that copy, then into the tensors."""

    key = "raw_direct"
    label = "raw O_DIRECT write+fsync / read (limit)"
    limit = True
    restores_into = True
    _file = "raw-direct.bin"
    _piece = 64 << 20

    def __init__(self) -> None:
        self._buffer: mmap.mmap | None = None
        self._nbytes = 0

    def setup(self, root: Path, state: StateDict) -> None:
        self._nbytes = state_nbytes(state)
        self._buffer = mmap.mmap(-1, -(-self._nbytes // 4096) * 4096 or 4096)

    def begin(self, work: Path, state: StateDict) -> None:
        assert self._buffer is not None  # the state as it is now: the workload may change it
        view, at = memoryview(self._buffer), 0
        for tensor in state.values():
            b = byte_view(tensor)
            view[at : at + b.nbytes] = b
            at += b.nbytes
        view.release()

    def _open(self, path: Path, flags: int) -> int:
        try:
            return os.open(path, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError as exc:
            raise OSError(exc.errno, f"{path.parent} refuses O_DIRECT: {exc.strerror}") from exc

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        assert self._buffer is not None
        fd = self._open(work / self._file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            view = memoryview(self._buffer)
            for at in range(0, len(view), self._piece):
                piece = view[at : at + self._piece]
                while piece:  # a raw write may be short
                    n = os.pwrite(fd, piece, at)
                    piece, at = piece[n:], at + n
            view.release()
            os.ftruncate(fd, self._nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(work)
        return None

    def load_into(self, work: Path, into: StateDict) -> object:
        assert self._buffer is not None
        fd = self._open(work / self._file, os.O_RDONLY)
        try:
            view = memoryview(self._buffer)
            at = 0
            while at < len(view):
                n = os.preadv(fd, [view[at : at + self._piece]], at)
                if not n:
                    break
                at += n
            at = 0
            for tensor in into.values():  # the copy out of the aligned buffer counts
                b = byte_view(tensor)
                b[:] = view[at : at + b.nbytes]
                at += b.nbytes
            view.release()
        finally:
            os.close(fd)
        return into

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


class TorchSavePeer(Peer):
    key = "torch"
    label = "torch.save / torch.load"
    restores = True
    _file = "state.pt"

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        import torch

        with open(work / self._file, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(work)
        return None

    def load(self, work: Path) -> object:
        import torch

        return torch.load(work / self._file, weights_only=True)


class SafetensorsPeer(Peer):
    key = "safetensors"
    label = "safetensors save_file / load_file"
    restores = True
    note = "safetensors loads with backend='pread' (the default mmap reads nothing until used)"
    _file = "state.safetensors"

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        from safetensors.torch import save_file

        save_file(state, work / self._file)
        fsync_path(work / self._file)
        fsync_path(work)
        return None

    def load(self, work: Path) -> object:
        from safetensors import torch as st

        try:
            return st.load_file(work / self._file, backend="pread")
        except TypeError:  # before the backend argument: read every byte now, as the others do
            return st.load((work / self._file).read_bytes())


def quiet_dcp() -> None:
    # DCP warns on every call that it runs without a process group, which is what we mean.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")


class DcpPeer(Peer):
    key = "dcp"
    label = "DCP save / load"
    restores_into = True

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        path = work / "dcp"
        # Explicit about what the default writer already does: fsync data files and metadata.
        save(state, checkpoint_id=path, storage_writer=FileSystemWriter(path, sync_files=True))
        return None

    def load_into(self, work: Path, into: StateDict) -> object:
        from torch.distributed.checkpoint.state_dict_loader import load

        load(into, checkpoint_id=work / "dcp")
        return into


def dcp_async_save(state: Mapping[str, Any], path: Path) -> tuple[Future[Any], Future[Any] | None]:
    """``torch.distributed.checkpoint.async_save``: (upload future, staging future or None)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

    result = async_save(dict(state), checkpoint_id=path)
    if isinstance(result, AsyncSaveResponse):
        return result.upload_completion, result.staging_completion
    return result, None


class DcpAsyncPeer(Peer):
    key = "dcp_async"
    label = "DCP async_save"
    note = "DCP async_save writes DCP's format: its restore is DCP load's"

    def __init__(self) -> None:
        self._upload: Future[Any] | None = None

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        upload, staging = dcp_async_save(state, work / "dcp")
        self._upload = upload
        if staging is not None:
            staging.result()  # the state may not change before its staging copy is done
        return self._wait

    def _wait(self) -> None:
        upload, self._upload = self._upload, None
        if upload is not None:
            upload.result()

    def end(self) -> None:
        with contextlib.suppress(Exception):
            self._wait()


class TorchsnapshotPeer(Peer):
    key = "torchsnapshot"
    label = "torchsnapshot take / restore"
    restores_into = True

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        import torchsnapshot

        torchsnapshot.Snapshot.take(
            str(work / "snap"), app_state={"state": torchsnapshot.StateDict(**state)}
        )
        return None

    def load_into(self, work: Path, into: StateDict) -> object:
        import torchsnapshot

        target = torchsnapshot.StateDict(**into)
        torchsnapshot.Snapshot(str(work / "snap")).restore(app_state={"state": target})
        return dict(target)


class CryosnapPeer(Peer):
    key = "cryosnap"
    label = "cryosnap save / load"
    restores = True
    restores_into = True

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        import cryosnap

        cryosnap.save(work / "run", state, step=0, chunk_bytes=CHUNK_BYTES)
        return None

    def load(self, work: Path) -> object:
        import cryosnap

        loaded: object = cryosnap.load(work / "run")
        return loaded

    def load_into(self, work: Path, into: StateDict) -> object:
        import cryosnap

        cryosnap.load(work / "run", into=into)
        return into


class CheckpointerPeer(Peer):
    """A ``cryosnap.Checkpointer``, eager or lazy; restore is ``ckpt.restore``.

    Full versions (``incremental=False``, dense and many-small): one Checkpointer for the whole
    run, as a job holds one; its untimed first version, before the first round, allocates the
    staging pool, and each repetition times one more version (``keep=1``: the previous one is
    retired, as a bounded run does). Incremental (sparse): a new Checkpointer per repetition,
    an untimed full first version, then the timed incremental one against it.
    """

    def __init__(self, *, lazy: bool, incremental: bool, direct_io: bool | None = None) -> None:
        self.lazy = lazy
        self.incremental = incremental
        self.direct_io = direct_io
        self.key = "cryosnap_lazy" if lazy else "cryosnap_eager"
        self.label = f"cryosnap Checkpointer {'lazy' if lazy else 'eager'}"
        if direct_io is False:
            self.key += "_buffered"
            self.label += " (direct_io=False)"
        self.restores = self.restores_into = not lazy
        if lazy:
            self.note = "the lazy Checkpointer writes the eager one's files: its restore is theirs"
        elif incremental:
            self.note = (
                "a new Checkpointer per repetition: an untimed full version, then the timed "
                "incremental one"
            )
        else:
            self.note = (
                "one Checkpointer for the run (incremental=False, keep=1): an untimed first "
                "version before the first round allocates the staging pool, then one timed "
                "version per repetition"
            )
        self._ckpt: Any = None
        self._run: Path | None = None
        self._step = 0

    def _open(self, run: Path, state: StateDict) -> None:
        import cryosnap

        self._run = run
        self._ckpt = cryosnap.Checkpointer(
            run,
            incremental=self.incremental,
            chunk_bytes=CHUNK_BYTES,
            staging_bytes=None,
            keep=None if self.incremental else 1,
            direct_io=self.direct_io,
        )
        self._step = 0
        self._ckpt.save(self._step, state).result()

    def setup(self, root: Path, state: StateDict) -> None:
        if not self.incremental:
            self._open(root / f"{self.key}-run", state)

    def begin(self, work: Path, state: StateDict) -> None:
        if self.incremental:
            self._open(work / "run", state)

    def folder(self, work: Path) -> Path:
        return work if self._run is None else self._run

    def save(self, work: Path, state: StateDict) -> FinishFn | None:
        self._step += 1
        pending = self._ckpt.save(self._step, state, lazy=self.lazy)

        def durable() -> None:
            pending.result()

        return durable

    def load(self, work: Path) -> object:
        restored: object = self._ckpt.restore()
        return restored

    def load_into(self, work: Path, into: StateDict) -> object:
        self._ckpt.restore(into=into)
        return into

    def end(self) -> None:
        if self.incremental:
            self.close()

    def close(self) -> None:
        ckpt, self._ckpt, self._run = self._ckpt, None, None
        if ckpt is not None:
            ckpt.close()


class DenseReferencePeer(CheckpointerPeer):
    """The eager Checkpointer on the run's bytes as a dense state (``dense_shapes`` of its
    size: 16 tensors), in the same rounds as the others: a many-small run's ratios per byte
    against dense, measured interleaved rather than across two runs minutes apart."""

    def __init__(self) -> None:
        super().__init__(lazy=False, incremental=False)
        self.key = "cryosnap_eager_dense"
        self.label = "cryosnap Checkpointer eager, dense (same bytes)"
        self.note = (
            "the eager Checkpointer on the same bytes in 16 tensors, saved and restored in the "
            "same rounds (its own state and into=): the reference of the per-byte ratios"
        )
        self._state: StateDict = {}
        self._into: StateDict = {}
        self.nbytes = 0

    def setup(self, root: Path, state: StateDict) -> None:
        self._state = build_state(dense_shapes(state_nbytes(state)))
        self.nbytes = state_nbytes(self._state)
        self._into = {k: t.clone().zero_() for k, t in self._state.items()}
        super().setup(root, self._state)

    def saved_state(self, state: StateDict) -> StateDict:
        return self._state

    def into_for(self, into: StateDict) -> StateDict:
        return self._into

    def close(self) -> None:
        super().close()
        self._state, self._into = {}, {}


def make_peers(workload: str, into: StateDict) -> tuple[list[Peer], dict[str, str]]:
    """The limits and every peer that imports, and why each missing one is missing."""
    incremental = workload == "sparse"
    peers: list[Peer] = [MemcpyLimit(into), RawLimit(), TorchSavePeer()]
    if not incremental:  # its aligned copy is made before the sparse change of each save
        peers.insert(2, RawDirectLimit())
    missing: dict[str, str] = {}
    if importlib.util.find_spec("safetensors") is not None:
        peers.append(SafetensorsPeer())
    else:
        missing["safetensors"] = "not installed"
    if dcp_available():
        peers += [DcpPeer(), DcpAsyncPeer()]
    else:
        missing["dcp"] = "torch.distributed is not available in this torch build"
    if importlib.util.find_spec("torchsnapshot") is not None:
        peers.append(TorchsnapshotPeer())
    else:
        missing["torchsnapshot"] = "not installed"
    from cryosnap.bench import _torch_checkpointing as tc  # it builds on Peer

    why = tc.unavailable()
    if why is None:
        peers.append(tc.TorchCheckpointingPeer())
    else:
        missing[tc.KEY] = why
    if not incremental:
        peers += [CryosnapPeer(), CheckpointerPeer(lazy=False, incremental=False, direct_io=False)]
    peers += [
        CheckpointerPeer(lazy=False, incremental=incremental),
        CheckpointerPeer(lazy=True, incremental=incremental),
    ]
    if workload == "many-small":
        peers.append(DenseReferencePeer())
    return peers, missing


def import_peers() -> None:
    """Import every peer that imports now, not inside its first timed call."""
    for name in (
        "cryosnap.checkpointer",
        "safetensors.torch",
        "torch.distributed.checkpoint",
        "torch.distributed.checkpoint.state_dict_saver",
        "torch.distributed.checkpoint.state_dict_loader",
        "torchsnapshot",
        "torch_checkpointing",
    ):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def dcp_available() -> bool:
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        importlib.import_module("torch.distributed.checkpoint")
    except ImportError:
        return False
    return True
