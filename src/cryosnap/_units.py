"""Units for people: byte counts in binary units, rates and durations. Pure, no I/O; imports
nothing of cryosnap, so every layer may format and parse with it (the engine's logs, the
progress line, the planner's job shape)."""

from __future__ import annotations

import re

__all__ = ["human_bytes", "parse_bytes", "parse_rate", "parse_seconds"]

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
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)\s*([a-zA-Zµ]*)\s*$")
# Seconds per unit as (multiplier, divisor): "50us" is 50 / 1e6, exactly the float 50e-6.
_SECONDS = {
    "": (1, 1),
    "s": (1, 1),
    "ms": (1, 10**3),
    "us": (1, 10**6),
    "µs": (1, 10**6),
    "ns": (1, 10**9),
    "m": (60, 1),
    "min": (60, 1),
    "h": (3600, 1),
    "d": (86400, 1),
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


def parse_rate(text: str) -> float | None:
    """``"2GB/s"``, ``"1.5 GiB/s"``, ``"800MB/s"`` as bytes per second (the size as
    :func:`parse_bytes` reads it, then ``/s``); None when ``text`` is no rate."""
    body = text.strip()
    if not body.lower().endswith("/s"):
        return None
    match = _SIZE.match(body[:-2])
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        return None
    return float(match.group(1)) * _UNITS[unit]


def parse_seconds(text: str) -> float | None:
    """``"5us"``, ``"2ms"``, ``"1.5s"``, ``"90"``, ``"10m"``, ``"2h"``, ``"7d"`` as seconds
    (``m`` is minutes); None when ``text`` is no duration."""
    match = _DURATION.match(text)
    if match is None or match.group(2) not in _SECONDS:
        return None
    multiplier, divisor = _SECONDS[match.group(2)]
    return float(match.group(1)) * multiplier / divisor
