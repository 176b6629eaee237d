"""``cryosnap demo``: the options forwarded to :func:`cryosnap.demo.main` (python -m
cryosnap.demo). Runs on the caller's thread; torch is imported only when the demo runs.
"""

from __future__ import annotations


def cmd_demo(directory: str, *, steps: int, every: int, seed: int | None, as_json: bool) -> int:
    """Run the demo; return its exit code."""
    from cryosnap import demo

    argv = ["--dir", directory, "--steps", str(steps), "--every", str(every)]
    if seed is not None:
        argv += ["--seed", str(seed)]
    if as_json:
        argv.append("--json")
    return demo.main(argv)
