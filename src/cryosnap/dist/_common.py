"""Defaults shared by the coordinators (no imports of the implementations here)."""

from __future__ import annotations

__all__ = ["DEFAULT_TIMEOUT_SECONDS"]

# How long a collective waits for every participant by default: longer than any save step of
# a healthy run (a rank may be writing a large part), short enough that a dead rank surfaces.
DEFAULT_TIMEOUT_SECONDS = 600.0
