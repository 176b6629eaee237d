"""The one lazy import of torch: :func:`import_torch` (imports it) and :func:`loaded_torch`
(the module if a finished import already made it, else None; never imports).

Every lazy import goes through one lock here, so no thread is handed a half-initialized torch.
Any thread; no I/O. docs/design/state-trees.md has the why.
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
