"""The one lazy import of torch: :func:`import_torch` (imports it) and :func:`loaded_torch`
(the module if a finished import already made it, else None; never imports).

``import torch`` takes seconds; two threads restoring at once in a fresh interpreter would
both start it, and the second could be handed the module half initialized (``partially
initialized module 'torch' has no attribute ...``). Every lazy import goes through one lock
here, and :func:`loaded_torch` does not hand out a module still being initialized: an object
can only be a torch tensor once torch's import has finished. Any thread; no I/O.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

__all__ = ["import_torch", "loaded_torch"]

_IMPORT_LOCK = threading.Lock()


def loaded_torch() -> Any | None:
    """``torch`` if it is imported and initialized, else None (nothing is imported)."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return torch


def import_torch() -> Any:
    """``torch``, imported on first use under one lock (``ImportError`` if not installed)."""
    torch = loaded_torch()
    if torch is not None:
        return torch
    with _IMPORT_LOCK:
        import torch

    return torch
