"""``cryosnap flush``: finish the flush of a run whose program died (a job epilogue's scavenge).

A thin command over :func:`cryosnap.flush`: one line per version flushed, or JSON; exit 1 when
a version could not be flushed (one line on stderr each). Under mpiexec or torchrun one process
per rank runs it and rank 0 alone prints. Caller's thread.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from cryosnap.cli._common import EXIT_DAMAGED, EXIT_OK, CliUsageError
from cryosnap.cli._render import PROG, one_line, plural, print_json, print_line
from cryosnap.progress import human_bytes
from cryosnap.run import FlushReport, flush


def cmd_flush(
    location: str, *, scratch: list[str], as_json: bool = False, retry_seconds: float = 300.0
) -> int:
    """Flush what ``scratch`` holds and the persistent run at ``location`` lacks, each version's
    copy retried for at most ``retry_seconds`` in all; the exit code."""
    if not location:
        raise CliUsageError("PATH must not be empty")
    if not scratch or not all(scratch):
        raise CliUsageError("--scratch DIR is required (once per scratch device of the run)")
    if not math.isfinite(retry_seconds) or retry_seconds < 0:
        raise CliUsageError(f"--retry-seconds must be a number >= 0, got {retry_seconds}")
    for device in scratch:
        if _same_location(device, location):
            raise CliUsageError(
                f"--scratch {device} is the persistent PATH {location} itself: a scratch "
                "device is another directory (node-local: tmpfs, NVMe)"
            )
    with _warnings_as_lines():
        report = flush(location, scratch=scratch, retry_seconds=retry_seconds)
    if report.rank == 0:
        _print(report, as_json=as_json)
    return EXIT_OK if report.ok else EXIT_DAMAGED


def _same_location(a: str, b: str) -> bool:
    """Whether two locations name one directory, as the run's levels compare them (a local
    path made absolute, not resolved; a URL as written, less a trailing ``/``)."""
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(os.path.expanduser(a)) == os.path.abspath(os.path.expanduser(b))


def _print(report: FlushReport, *, as_json: bool) -> None:
    if as_json:
        print_json(report.to_json())
    else:
        for v in report.flushed:
            print_line(f"step {v.step}: flushed {human_bytes(v.nbytes)} in {v.seconds:.3f} s")
        for step in report.superseded:
            print_line(f"step {step}: superseded by a rewind saved later, not flushed")
        for step in report.partial:
            print_line(f"step {step}: committed on some ranks' scratch only, not a version")
        if not report.flushed and not report.failed:
            if report.already:
                steps = ", ".join(map(str, report.already))
                print_line(
                    f"nothing to flush: {plural(len(report.already), 'version')} on scratch "
                    f"({'step' if len(report.already) == 1 else 'steps'} {steps}) already "
                    f"persistent in {report.path}"
                )
            else:
                print_line(f"nothing to flush: no version on scratch ({', '.join(report.scratch)})")
    for f in report.failed:
        sys.stderr.write(f"{PROG}: error: {one_line(f.error)}\n")


class _OneLine(logging.Handler):
    """The flush's warnings (a retry) as one line each; its errors are the report's."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.ERROR:
            sys.stderr.write(f"{PROG}: warning: {one_line(record.getMessage())}\n")


@contextmanager
def _warnings_as_lines() -> Iterator[None]:
    logger = logging.getLogger("cryosnap")
    handler = _OneLine(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
