"""Units for people: byte counts in binary units. Pure, no I/O; imports nothing of cryosnap,
so every layer may format with it (the engine's logs, the progress line, the CLI)."""

from __future__ import annotations

import re

__all__ = ["human_bytes", "parse_bytes"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
    "t": 1 << 40,
    "tib": 1 << 40,
    "tb": 10**12,
}


def human_bytes(n: float) -> str:
    """Bytes in binary units with one decimal: ``48 B``, ``1.5 KiB``, ``1.0 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int | None:
    """``"4GiB"``, ``"512MiB"``, ``"300MB"``, ``"4M"`` (binary), ``"1048576"`` as bytes; None
    when ``text`` is no size."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        return None
    return int(float(match.group(1)) * _UNITS[unit])
