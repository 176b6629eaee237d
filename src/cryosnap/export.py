"""Export one version of a run to a single file: ``.pt``, ``.safetensors`` or ``.npz``; or,
with ``since=``, a delta: only the leaves changed since another version, with the document
``cryosnap.apply_delta`` checks them by (``_delta.py``).

>>> from cryosnap.export import export
>>> result = export("run", "model.safetensors")   # the newest version, rank 0
>>> result.step, result.leaves, result.bytes
>>> export("run", "delta.safetensors", step=200, since=100)   # the leaves 200 changed

Runs on the caller's thread; reads the run through :func:`cryosnap.load` (a delta through
the lineage's reader, ``_lineage.py``: the changed leaves only) and takes no lock.
docs/design/api.md has the formats, how leaves map onto them, and the guarantees;
docs/design/lineage.md the deltas.
"""

from __future__ import annotations

import json
import os
import secrets
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cryosnap import _validate
from cryosnap._delta import DELTA_KEY, delta_document
from cryosnap._format.skeleton import format_path
from cryosnap._lineage import delta_parts
from cryosnap._state.files import File
from cryosnap._state.torch_import import import_torch, loaded_torch
from cryosnap.checkpointer import load
from cryosnap.errors import ExportError
from cryosnap.run import committed_steps, is_dcp_version
from cryosnap.storage import Store, open_run_store

__all__ = [
    "EXPORT_FORMATS",
    "ExportError",
    "ExportResult",
    "check_out",
    "committed_steps",
    "export",
    "export_leaves",
    "is_dcp_version",
]

EXPORT_FORMATS = (".pt", ".safetensors", ".npz")


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What :func:`export` wrote.

    ``format`` is ``"pt"``, ``"safetensors"`` or ``"npz"``; ``leaves`` counts the leaves
    written; ``skipped`` names those left out (None leaves in ``.npz``); ``bytes`` is the size
    of ``out``. ``numpy_leaves`` (``.pt`` only) names the leaves with numpy values, which
    ``torch.load(weights_only=True)`` refuses.
    """

    path: str
    step: int
    rank: int
    out: Path
    format: str
    leaves: int
    skipped: tuple[str, ...]
    bytes: int
    numpy_leaves: tuple[str, ...] = ()
    # A delta (export(since=)): the base step; ``leaves`` then counts the leaves added or
    # changed since it, and ``removed`` names those it lacks.
    since: int | None = None
    removed: tuple[str, ...] = ()


def export(
    path: str | os.PathLike[str] | Store,
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    rank: int = 0,
    force: bool = False,
    allow_pickle: bool = False,
    since: int | None = None,
) -> ExportResult:
    """Write version ``step`` (default: the newest committed) of the run at ``path`` to ``out``.

    The format follows the suffix of ``out`` (``.pt``, ``.safetensors``, ``.npz``). An
    existing ``out`` is replaced only with ``force=True``. ``rank`` picks a rank's part of a
    distributed version. ``allow_pickle=True`` loads pickled leaves (as :func:`cryosnap.load`:
    it runs code from the checkpoint; a run you trust only). The newest version is taken as it
    is: if it is damaged, the export fails (``IntegrityError``) rather than exporting an older
    one.

    ``since=A``: a delta from step A to ``step``: only the leaves ``step`` added or changed
    since A (``.safetensors`` or ``.npz``), and, in the file (the metadata key, or the
    ``.npz`` array, ``__cryosnap_delta__``), a JSON document of both steps, the removed
    leaves and each version's Merkle root per leaf, which :func:`cryosnap.apply_delta`
    checks a state by before and after applying it. Unchanged data is not read.
    """
    out_path, fmt = check_out(out, force=_validate.boolean(force, "force"))
    if step is not None:
        step = _validate.step(step)
    rank = _validate.step(rank, "rank")
    if since is not None:
        since = _validate.step(since, "since")
        if fmt == ".pt":
            raise ValueError(
                f"cannot export a delta to {str(out)!r}: a delta (since=) is a .safetensors or "
                ".npz file"
            )
    store = open_run_store(path)
    if step is None:
        step = committed_steps(store)[-1]
    if since is not None:
        return _export_delta(store, out_path, fmt, a=since, b=step, rank=rank)
    if is_dcp_version(store, step):
        if rank != 0:
            raise ValueError(
                f"rank={rank} does not apply: step {step} of {store.url} was written through "
                "torch.distributed.checkpoint (cryosnap.dcp) and is exported whole, every "
                "rank's shards assembled"
            )
        from cryosnap.dcp import full_state_dict

        tree = full_state_dict(store, step)
    else:
        tree = _files_as_bytes(load(store, step=step, rank=rank, allow_pickle=allow_pickle))
    # A .pt holds the tree itself: two leaves may have one path there (a key holding '/').
    leaves = _walk_leaves(tree) if fmt == ".pt" else export_leaves(tree, fmt)
    # Every conversion a format needs happens before its file is complete: a leaf it cannot
    # hold is an error and OUT is left as it was.
    writers: dict[str, Callable[[Path], tuple[int, list[str]]]] = {
        ".pt": lambda tmp: _write_pt(tree, len(leaves), tmp),
        ".safetensors": lambda tmp: _write_safetensors(leaves, tmp),
        ".npz": lambda tmp: _write_npz(leaves, tmp),
    }
    with _atomic_output(out_path) as tmp:
        written, skipped = writers[fmt](tmp)
    numpy_leaves = [p for p, v in leaves if isinstance(v, (np.ndarray, np.generic))]
    return ExportResult(
        path=store.url,
        step=step,
        rank=rank,
        out=out_path,
        format=fmt.lstrip("."),
        leaves=written,
        skipped=tuple(skipped),
        bytes=out_path.stat().st_size,
        numpy_leaves=tuple(numpy_leaves) if fmt == ".pt" else (),
    )


def _export_delta(store: Store, out: Path, fmt: str, *, a: int, b: int, rank: int) -> ExportResult:
    """Write the delta from step ``a`` to step ``b`` to ``out`` (see :func:`export`)."""
    for step in (a, b):
        if is_dcp_version(store, step):
            raise ValueError(
                f"step {step} of {store.url} was written through torch.distributed.checkpoint "
                "(cryosnap.dcp): a delta compares cryosnap's own versions; export it whole"
            )
    parts = delta_parts(store, a, b, rank=rank)
    doc = delta_document(parts, store.url)
    if DELTA_KEY in doc["leaves"]:
        raise ExportError(f"leaf {DELTA_KEY} has the name a delta keeps its document under")
    arrays = [(p, v) for p, v in parts.values if doc["leaves"][p]["stored"] == "tensor"]
    text = json.dumps(doc, separators=(",", ":"))
    with _atomic_output(out) as tmp:
        if fmt == ".safetensors":
            _write_safetensors(arrays, tmp, extra={DELTA_KEY: text})
        else:
            document = np.frombuffer(text.encode("utf-8"), np.uint8)
            _write_npz([*arrays, (DELTA_KEY, document)], tmp)
    return ExportResult(
        path=store.url,
        step=b,
        rank=rank,
        out=out,
        format=fmt.lstrip("."),
        leaves=len(parts.values),
        skipped=(),
        bytes=out.stat().st_size,
        since=a,
        removed=parts.removed,
    )


def check_out(out: str | os.PathLike[str], *, force: bool = False) -> tuple[Path, str]:
    """``out`` as a path and its format (``.pt``...) if it can be exported to; else ValueError.

    Touches nothing: :func:`export` calls it first, and so can a caller that wants to refuse a
    bad ``out`` before reading anything.
    """
    if not isinstance(out, (str, os.PathLike)):
        _validate.wrong_type(out, "out", "a local file path (str or os.PathLike)")
    text = os.fspath(out)
    if not isinstance(text, str):
        _validate.wrong_type(out, "out", "a local file path (str or os.PathLike)")
    if "://" in text:
        raise ValueError(f"cannot export to {text!r}: out must be a local file path, not a URL")
    path = Path(text).expanduser()
    fmt = path.suffix.lower()
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"cannot export to {text!r}: out must end in .pt, .safetensors or .npz")
    if path.is_dir():
        raise ValueError(f"cannot export to {text!r}: it is a directory")
    if path.exists() and not force:
        raise ValueError(
            f"cannot export to {text!r}: it exists; pass --force (force=True) to replace it"
        )
    if not path.absolute().parent.is_dir():
        raise ValueError(
            f"cannot export to {text!r}: directory {str(path.parent)!r} does not exist"
        )
    return path, fmt


# ---------------------------------------------------------------------------------------------
# leaves


def export_leaves(tree: Any, fmt: str = ".safetensors") -> list[tuple[str, Any]]:
    """``(path, value)`` of every leaf of a loaded tree; paths joined by ``/``, unique (the
    names of a ``fmt`` file: two leaves of one path are an ExportError pointing at .pt)."""
    out = _walk_leaves(tree)
    seen: set[str] = set()
    for path, _ in out:
        if path in seen:
            raise ExportError(
                f"two leaves have the path {path!r} (a key holds '/' or int and str keys "
                f"collide), and {fmt} cannot hold both under one name; export to .pt "
                "instead, which keeps the tree"
            )
        seen.add(path)
    return out


def _walk_leaves(tree: Any) -> list[tuple[str, Any]]:
    """``(path, value)`` of every leaf of a loaded tree, in tree order; paths joined by ``/``
    (two leaves may have one path)."""
    out: list[tuple[str, Any]] = []

    def walk(obj: Any, path: tuple[str | int, ...]) -> None:
        if type(obj) in (dict, OrderedDict):
            for k, v in obj.items():
                walk(v, (*path, k))
        elif type(obj) in (list, tuple):  # torch.Size, a tuple subclass, is a leaf
            for i, v in enumerate(obj):
                walk(v, (*path, i))
        else:
            out.append((format_path(path), obj))

    walk(tree, ())
    return out


def _files_as_bytes(tree: Any) -> Any:
    """``tree`` with each ``File`` handle replaced by its verified bytes (what every format
    holds: a ``uint8`` array or tensor, or ``bytes`` in a ``.pt``)."""
    if isinstance(tree, File):
        return tree.read_bytes()
    if type(tree) in (dict, OrderedDict):
        return type(tree)((k, _files_as_bytes(v)) for k, v in tree.items())
    if type(tree) in (list, tuple):
        return type(tree)(_files_as_bytes(v) for v in tree)
    return tree


def _is_tensor(obj: Any) -> bool:
    torch = loaded_torch()
    return torch is not None and isinstance(obj, torch.Tensor)


# ---------------------------------------------------------------------------------------------
# .npz


def _to_numpy(path: str, value: Any) -> np.ndarray | None:
    """The array .npz stores for a leaf; None for a leaf it cannot hold at all (None)."""
    if _is_tensor(value):
        t = value.detach().cpu().resolve_conj().resolve_neg()
        try:
            arr: np.ndarray = t.numpy()
        except TypeError as exc:
            dtype = str(t.dtype).removeprefix("torch.")
            raise ExportError(
                f"leaf {path} is a torch {dtype} tensor, which numpy has no dtype for; "
                "export to .pt or .safetensors instead"
            ) from exc
        return arr
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (bytes, bytearray)):
        return np.frombuffer(bytes(value), dtype=np.uint8)
    if value is None:
        return None
    try:
        arr = np.asarray(value)  # Python and numpy scalars, torch.Size: 0-d or 1-d arrays
    except (OverflowError, ValueError, TypeError) as exc:
        raise ExportError(f"leaf {path}: .npz cannot hold {value!r:.60}: {exc}") from exc
    if arr.dtype.hasobject:
        raise ExportError(f"leaf {path}: .npz cannot hold {type(value).__name__} values")
    return arr


def _write_npz(leaves: list[tuple[str, Any]], tmp: Path) -> tuple[int, list[str]]:
    arrays: list[tuple[str, np.ndarray]] = []
    skipped: list[str] = []
    for path, value in leaves:
        arr = _to_numpy(path, value)
        if arr is None:
            skipped.append(path)
        else:
            arrays.append((path, arr))
    # What numpy.savez writes, without its keyword arguments: a leaf named "file" or
    # "allow_pickle" would collide with savez's own parameters.
    with zipfile.ZipFile(tmp, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, arr in arrays:
            with zf.open(name + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, arr, allow_pickle=False)
    return len(arrays), skipped


# ---------------------------------------------------------------------------------------------
# .safetensors and .pt


def _import_torch(fmt: str) -> Any:
    try:
        torch = import_torch()
    except ImportError as exc:
        raise ExportError(f"export to {fmt} needs torch: pip install 'cryosnap[torch]'") from exc
    return torch


def _to_tensor(path: str, value: Any, torch: Any) -> Any:
    if isinstance(value, np.generic):
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        arr = value if value.flags.c_contiguous else value.copy(order="C")
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        try:
            return torch.from_numpy(arr)
        except TypeError as exc:
            raise ExportError(
                f"leaf {path} is a numpy {value.dtype} array, which torch has no dtype for; "
                "export to .npz or .pt instead"
            ) from exc
    if isinstance(value, (bytes, bytearray)):
        return torch.from_numpy(np.frombuffer(bytearray(value), dtype=np.uint8))
    return value.detach().cpu().resolve_conj().resolve_neg()


def _json_leaf(value: Any) -> str:
    if isinstance(value, complex):
        return json.dumps({"real": value.real, "imag": value.imag})
    if isinstance(value, tuple):  # torch.Size
        return json.dumps(list(value))
    return json.dumps(value)


def _write_safetensors(
    leaves: list[tuple[str, Any]], tmp: Path, *, extra: dict[str, str] | None = None
) -> tuple[int, list[str]]:
    """Write ``leaves`` to ``tmp``: tensors, and the other leaves as JSON in the metadata,
    with ``extra`` (a delta's document)."""
    torch = _import_torch(".safetensors")
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    metadata: dict[str, str] = {}
    storages: set[int] = set()
    for path, value in leaves:
        if _is_tensor(value) or isinstance(value, (np.ndarray, np.generic, bytes, bytearray)):
            t = _to_tensor(path, value, torch).contiguous()
            # safetensors refuses tensors that share memory (tied weights): copy all but one.
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
            if ptr and ptr in storages:
                t = t.clone()
            storages.add(ptr)
            tensors[path] = t
        else:
            metadata[path] = _json_leaf(value)
    written = len(tensors) + len(metadata)
    if "format" not in metadata:
        metadata["format"] = "pt"  # what transformers and others expect of a torch file
    metadata.update(extra or {})
    try:
        save_file(tensors, str(tmp), metadata=metadata)
    except Exception as exc:
        raise _safetensors_error(tensors, exc) from exc
    return written, []


def _safetensors_error(tensors: dict[str, Any], exc: Exception) -> ExportError:
    """Name the leaf safetensors refused: try the tensors one at a time (failure path only)."""
    from safetensors.torch import save

    for path, t in tensors.items():
        try:
            save({path: t})
        except Exception:
            dtype = str(t.dtype).removeprefix("torch.")
            return ExportError(
                f"leaf {path}: .safetensors cannot hold a {dtype} tensor ({exc}); "
                "export to .pt instead"
            )
    return ExportError(f"cannot write .safetensors: {exc}")


def _write_pt(tree: Any, leaves: int, tmp: Path) -> tuple[int, list[str]]:
    torch = _import_torch(".pt")
    torch.save(tree, tmp)
    return leaves, []


# ---------------------------------------------------------------------------------------------
# writing OUT


@contextmanager
def _atomic_output(out: Path) -> Iterator[Path]:
    """A temporary file beside ``out``, renamed over it once written and fsynced."""
    tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}.tmp")
    try:
        # O_EXCL reserves the name; mode 0o666 lets the umask decide, as for any new file.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        mode = tmp.stat().st_mode & 0o777
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from exc
    try:
        yield tmp
        # Some writers replace the file rather than fill it (safetensors makes it 0o600).
        os.chmod(tmp, mode)
        _fsync(tmp, 0)
        os.replace(tmp, out)
        _fsync(out.absolute().parent, getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise ExportError(f"cannot write {out}: {exc.strerror or exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
