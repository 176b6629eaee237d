"""The entry point: run the command line, map every error to one line on stderr
(``cryosnap: error: ...``, never a traceback unless ``CRYOSNAP_TRACEBACK=1``) and an exit code:
0 success, 1 corruption (verify found damage, any IntegrityError), 2 usage errors, missing
checkpoints and every other CheckpointError, 3 an internal error (a bug), 130 interrupted.
typer and rich (the ``cli`` extra) are imported only when the command line runs, so
``import cryosnap`` never pulls them in. Runs on the caller's thread."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from cryosnap.cli._common import (
    EXIT_DAMAGED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    CliUsageError,
)
from cryosnap.cli._render import PROG, Invocation
from cryosnap.errors import CheckpointError, IntegrityError


def main(argv: list[str] | None = None) -> int:
    """Run the command line and return its exit code.

    With ``argv`` given (tests, embedding) the exit code is returned. With ``argv`` None the
    arguments come from ``sys.argv`` and the process exits with the code: that is what the
    ``cryosnap`` console script (``cryosnap.cli:main``) does.
    """
    code = _run(Invocation(tuple(sys.argv[1:] if argv is None else argv)))
    if argv is None:
        sys.exit(code)
    return code


def _bare_json(args: list[str]) -> list[str]:
    """``bench ... --json`` without a FILE (last, or before another option) as ``--json -``:
    the scale workload's JSON on stdout (the parser has no options with an optional value)."""
    if not args or args[0] != "bench":
        return args
    out: list[str] = []
    for i, arg in enumerate(args):
        out.append(arg)
        after = args[i + 1] if i + 1 < len(args) else None
        if arg == "--json" and (after is None or (after.startswith("-") and after != "-")):
            out.append("-")
    return out


def _run(invocation: Invocation) -> int:
    args, error = _bare_json(list(invocation.args)), invocation.error
    try:
        import typer
    except ImportError:
        error("the command line needs the 'cli' extra: pip install -e '.[cli]'", EXIT_USAGE)
        return EXIT_USAGE
    from cryosnap.cli._app import build_app

    click_exc = _click_exceptions()
    command = typer.main.get_command(build_app(invocation))
    try:
        # standalone_mode=False: click raises instead of printing a multi-line usage block and
        # calling sys.exit, so every error is rendered here as one line.
        if not args:  # a bare `cryosnap`: the help is the answer, but it is still a usage error
            command.main(args=["--help"], prog_name=PROG, standalone_mode=False)
            return EXIT_USAGE
        rv = command.main(args=args, prog_name=PROG, standalone_mode=False)
    except CliUsageError as exc:
        return error(str(exc), EXIT_USAGE, "usage")
    except IntegrityError as exc:
        return error(str(exc), EXIT_DAMAGED, type(exc).__name__)
    except CheckpointError as exc:
        return error(str(exc), EXIT_USAGE, type(exc).__name__)
    except click_exc.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        return error(exc.format_message() + hint, EXIT_USAGE, "usage")
    except click_exc.ClickException as exc:
        return error(exc.format_message(), int(exc.exit_code), "usage")
    except typer.Abort:
        return error("aborted", EXIT_INTERRUPTED, "interrupted")
    except SystemExit as exc:  # typer exits itself on a broken stdout pipe
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except Exception as exc:
        if os.environ.get("CRYOSNAP_TRACEBACK"):
            raise
        return error(
            f"internal error: {type(exc).__name__}: {exc} "
            "(run with CRYOSNAP_TRACEBACK=1 to see the traceback)",
            EXIT_INTERNAL,
            "internal",
        )
    # typer returns the code of a typer.Exit (verify's 1, --help's 0, Ctrl-C's 130) or the
    # command's None.
    return rv if isinstance(rv, int) else EXIT_OK


def _click_exceptions() -> Any:
    """The click exception module: vendored as ``typer._click`` by recent typer releases."""
    try:
        return importlib.import_module("typer._click.exceptions")
    except ImportError:  # older typer depends on click itself
        return importlib.import_module("click.exceptions")
