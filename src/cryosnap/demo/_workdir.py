"""The demo's work directory: taken only when missing, empty or marked by an earlier demo run
(``.cryosnap-demo``); a rerun removes what the demo created and nothing else. Runs in the
parent process.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# The work directory's marker: written when the demo takes a directory, required to reuse one.
MARKER = ".cryosnap-demo"
MARKER_TEXT = "A cryosnap demo run: the next `cryosnap demo` here replaces what it created.\n"
TORCH_SAVES = 3  # torch.save runs timed for the comparison, each to work / torch-{i}.pt
# Everything a run creates in the work directory; a rerun removes these and nothing else.
OWN = (
    "scratch",
    "persistent",
    "events.jsonl",
    "final.pt",
    "summary.png",
    *(f"torch-{i}.pt" for i in range(TORCH_SAVES)),
)


def prepare(work: Path) -> str | None:
    """Make ``work`` ready for a new run; return why it cannot be, or None.

    The demo deletes only what it created. A missing or empty directory becomes a demo directory
    (:data:`MARKER` says so); in a demo directory the previous run's entries (:data:`OWN`) are
    removed and nothing else; any other non-empty directory is refused, untouched.
    """
    marker = work / MARKER
    try:
        if work.exists() and not work.is_dir():
            return f"--dir {work} exists and is not a directory"
        if work.is_dir() and any(work.iterdir()) and not marker.is_file():
            return (
                f"--dir {work} is not empty and is not a demo directory (no {MARKER} file): "
                "the demo deletes only what it created; choose a new or empty directory"
            )
        work.mkdir(parents=True, exist_ok=True)
        for name in OWN:
            _remove(work / name)
        marker.write_text(MARKER_TEXT)
    except OSError as exc:
        return f"cannot prepare --dir {work}: {exc}"
    return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
