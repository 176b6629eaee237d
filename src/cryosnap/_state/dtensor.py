"""DTensor leaves and other tensor subclasses: what flatten stores of them and into= checks.

A DTensor is stored as its local shard (a plain torch leaf) with a ``dtensor`` record: mesh
shape, mesh device type, this rank's mesh coordinate, placements, global shape. A subclass whose
bytes cannot be read is a ``TypeError`` naming its path. Pure; caller's thread; imports no
torch (a DTensor exists only once ``torch.distributed.tensor`` is). docs/design/state-trees.md.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from cryosnap._format.skeleton import Json, dict_items, format_path, iter_leaves

__all__ = [
    "check_into",
    "dtensor_record",
    "fill_target",
    "for_stateful",
    "is_dtensor",
    "local_shard",
    "unreadable",
]

Path = tuple[str | int, ...]


def _dtensor_type() -> Any:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t: Any) -> bool:
    kind = _dtensor_type()
    return kind is not None and isinstance(t, kind)


def local_shard(t: Any, path: Path) -> tuple[Any, dict[str, Any]] | None:
    """``(local shard, its dtensor record)`` of a DTensor, None for any other tensor."""
    if not is_dtensor(t):
        return None
    return t._local_tensor, dtensor_record(t, path)


def dtensor_record(t: Any, path: Path) -> dict[str, Any]:
    """The layout of DTensor ``t`` as the skeleton keeps it (docs/FORMAT.md)."""
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    return {
        "mesh": [int(n) for n in mesh.shape],
        "mesh_device": str(mesh.device_type),
        "coordinate": None if coordinate is None else [int(c) for c in coordinate],
        "placements": [_placement(p, path) for p in t.placements],
        "shape": [int(n) for n in t.shape],
    }


def _placement(p: Any, path: Path) -> str:
    """``S(dim)``, ``R`` or ``P(op)``; a placement that is none of those is refused."""
    from_module = sys.modules["torch.distributed.tensor"]
    kind = type(p)
    if kind is from_module.Shard:
        return f"S({int(p.dim)})"
    if kind is from_module.Replicate:
        return "R"
    if kind is from_module.Partial:
        return f"P({p.reduce_op})"
    raise TypeError(
        f"cannot checkpoint {format_path(path)}: a DTensor placement {p!r} "
        f"({kind.__module__}.{kind.__qualname__}) is not stored by a Checkpointer (Shard, "
        "Replicate and Partial are); save it through cryosnap.dcp (DCP's planner handles it)"
    )


def unreadable(t: Any) -> str | None:
    """Why the bytes of tensor ``t`` (of a subclass of torch.Tensor) cannot be read, or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a FakeTensor warns that its pointer is no memory
            storage = t.untyped_storage()
            address = storage.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError, AttributeError) as exc:
        return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if address == 0 and storage.nbytes() > 0:
        return "its storage holds no memory (a fake or symbolic tensor)"
    return None


def check_into(node: dict[str, Any], into: Any, path: Path) -> tuple[Any, str | None]:
    """The tensor of ``into`` a saved torch leaf fills (a DTensor's local shard), and what does
    not match between the saved layout and ``into``'s (None: nothing)."""
    saved = node.get("dtensor")
    if not is_dtensor(into):
        return into, None  # a plain tensor takes a DTensor's local shard as it takes any
    if saved is None:
        return into, (
            "saved a plain tensor, into= has a DTensor (a Checkpointer restores each rank's "
            "own shard into a DTensor saved as one; to shard a plain tensor, load it and "
            "distribute it, or save and load through cryosnap.dcp)"
        )
    have = dtensor_record(into, path)
    if have != saved:
        diff = [k for k in have if have[k] != _text(saved, k)]
        what = ", ".join(f"{k} saved {_text(saved, k)}, into= has {have[k]}" for k in diff)
        return into._local_tensor, (
            f"a DTensor of another layout ({what}): a Checkpointer restores each rank's own "
            "shard into a DTensor of the same mesh and placements; to reshard, save and load "
            "through cryosnap.dcp (DCP's planner reshards)"
        )
    return into._local_tensor, None


def _text(saved: Json, key: str) -> Any:
    return saved.get(key) if isinstance(saved, dict) else None


def fill_target(into: Any) -> Any:
    """The tensor a restore copies into: a DTensor's local shard, else ``into`` itself."""
    return into._local_tensor if is_dtensor(into) else into


def for_stateful(obj: Any, node: Json, loaded: Any) -> Any:
    """``loaded`` (the state dict restored for stateful ``obj``) with each local shard of a
    DTensor leaf wrapped again as a DTensor of the layout ``obj`` has there (its
    ``state_dict()``'s DTensor, or an optimizer's parameter), so that ``load_state_dict`` of
    an FSDP2 module or of an optimizer over DTensors takes it; other leaves as they are."""
    if not any("dtensor" in leaf for _p, leaf in iter_leaves(node)):
        return loaded
    torch = sys.modules["torch"]
    if isinstance(obj, torch.optim.Optimizer):
        reference = _optimizer_reference(obj, loaded)
    else:
        reference = obj.state_dict()
    return _rewrap(node, loaded, reference)


def _optimizer_reference(opt: Any, loaded: Any) -> Any:
    """An optimizer's state dict as a tree of the parameters its states have the layout of
    (state ``i`` belongs to the ``i``-th parameter over the groups, as torch numbers them)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    states = loaded.get("state") if isinstance(loaded, dict) else None
    if not isinstance(states, dict):
        return {}
    return {
        "state": {
            i: {k: params[i] for k in st}
            for i, st in states.items()
            if type(i) is int and 0 <= i < len(params) and isinstance(st, dict)
        }
    }


def _rewrap(node: Json, loaded: Any, reference: Any) -> Any:
    t = node.get("t") if isinstance(node, dict) else None
    if t in ("dict", "odict") and isinstance(loaded, dict) and isinstance(reference, dict):
        for k, v in dict_items(node, ""):
            if k in loaded and k in reference:
                loaded[k] = _rewrap(v, loaded[k], reference[k])
        return loaded
    if t == "stateful":
        return _rewrap(node["v"], loaded, reference)
    if (
        t == "torch"
        and "dtensor" in node
        and is_dtensor(reference)
        and dtensor_record(reference, ()) == node["dtensor"]
    ):
        return _dtensor_type().from_local(
            loaded,
            reference.device_mesh,
            reference.placements,
            run_check=False,
            shape=reference.shape,
            stride=reference.stride(),
        )
    return loaded
