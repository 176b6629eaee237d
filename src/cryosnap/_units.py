"""Units for people: byte counts in binary units. Pure, no I/O; imports nothing of cryosnap,
so every layer may format with it (the engine's logs, the progress line, the CLI)."""

from __future__ import annotations

__all__ = ["human_bytes"]


def human_bytes(n: float) -> str:
    """Bytes in binary units with one decimal: ``48 B``, ``1.5 KiB``, ``1.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
