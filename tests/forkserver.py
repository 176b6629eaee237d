"""Test processes forked from a server that has torch imported already.

A test of several ranks starts each rank as its own process running a script (``python
script.py ARGS`` with torchrun's environment). Started with ``exec``, every rank pays the
interpreter start and the import of torch, numpy and cryosnap again: about 2 s of CPU each,
which made a third of the CPU of ``make test`` on a 2-core machine. :func:`start` runs the same
script in a process forked from a server (multiprocessing's ``forkserver``, one per pytest
worker, started at the first launch) that imported those modules once: the rank is still a
real process of its own, with its own pid, environment, working directory and exit status
(``-9`` when SIGKILLed), running the script as ``__main__``; ``atexit`` handlers and
non-daemon threads end as at a normal interpreter exit.

``CRYOSNAP_TEST_FORKSERVER=0`` starts every rank with ``exec`` instead (``subprocess``), as
before; ``make test-deep`` keeps the default.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.process
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

# Imported once by the server, inherited by every rank it forks.
PRELOAD = ["numpy", "torch", "torch.distributed", "cryosnap", "cryosnap.dist", "cryosnap.cli"]


def enabled() -> bool:
    return os.environ.get("CRYOSNAP_TEST_FORKSERVER", "1") != "0"


_context: Any = None
_lock = threading.Lock()


def _server() -> Any:
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _context = ctx
        return _context


def _run_script(argv: Sequence[str], env: Mapping[str, str], cwd: str, logs: Sequence[str]) -> None:
    """In the forked rank: the process a ``python argv...`` exec would have been."""
    # multiprocessing made this process a child of the server's: make it a main process again,
    # with the platform's default start method (a DataLoader's workers are then its own
    # children, which notice its death, not the server's).
    multiprocessing.set_start_method(None, force=True)
    me: Any = multiprocessing.current_process()  # as multiprocessing's _MainProcess is made
    me._identity, me._name, me._parent_pid = (), "MainProcess", None
    multiprocessing.process._parent_process = None  # type: ignore[attr-defined]
    multiprocessing.process._children = set()  # type: ignore[attr-defined]
    for target, path in zip((1, 2), logs, strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if "numpy" in sys.modules:  # a fresh process seeds numpy's global generator anew
        sys.modules["numpy"].random.seed()  # (random reseeds itself at fork)
    threads = env.get("OMP_NUM_THREADS")
    if threads and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))  # torch read the server's env
    try:
        if argv[0] == "-c":  # python -c CODE ARGS...
            sys.path[:] = ["", *extra, *sys.path[1:]]
            sys.argv[:] = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":  # python -m MODULE ARGS...
            sys.path[:] = [cwd, *extra, *sys.path[1:]]
            sys.argv[:] = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # python SCRIPT ARGS...
            script = str(argv[0])
            sys.path[:] = [str(Path(script).resolve().parent), *extra, *sys.path[1:]]
            sys.argv[:] = [script, *argv[1:]]
            runpy.run_path(script, run_name="__main__")
    finally:
        # What an interpreter does at exit, before multiprocessing's os._exit: join the
        # non-daemon threads, then run the atexit handlers.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


class Rank:
    """A started process, used like a ``subprocess.Popen`` of ``[sys.executable, *argv]``
    with its stdout and stderr in the files ``<log>.out`` and ``<log>.err``: ``pid``,
    ``wait(timeout)``, ``poll()``, ``returncode`` (``-N`` for signal N), ``kill()``,
    ``send_signal(sig)``, ``communicate(timeout)`` (what it printed, as two strings) and
    ``output()`` (both streams, for a failure message)."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        *,
        log: Path,
    ) -> None:
        self.logs = (Path(f"{log}.out"), Path(f"{log}.err"))
        env = dict(os.environ if env is None else env)
        where = Path.cwd() if cwd is None else Path(cwd)
        self.returncode: int | None = None
        self._proc: Any = None
        self._popen: subprocess.Popen[bytes] | None = None
        if enabled():
            ctx = _server()
            self._proc = ctx.Process(
                target=_run_script,
                args=(list(argv), env, str(where), [str(p) for p in self.logs]),
                daemon=False,
            )
            self._proc.start()
            self.pid = int(self._proc.pid)
        else:
            with open(self.logs[0], "wb") as out, open(self.logs[1], "wb") as err:
                self._popen = subprocess.Popen(
                    [sys.executable, *argv], env=env, cwd=where, stdout=out, stderr=err
                )
            self.pid = self._popen.pid

    def poll(self) -> int | None:
        if self.returncode is None:
            if self._popen is not None:
                self.returncode = self._popen.poll()
            else:
                code = self._proc.exitcode
                self.returncode = None if code is None else int(code)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; :class:`TimeoutError` when still running after ``timeout``."""
        if self._popen is not None:
            try:
                self.returncode = self._popen.wait(timeout)
            except subprocess.TimeoutExpired as exc:
                raise TimeoutError(f"pid {self.pid} still running after {timeout} s") from exc
            return self.returncode
        self._proc.join(timeout)
        if self.poll() is None:
            raise TimeoutError(f"pid {self.pid} still running after {timeout} s")
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        try:
            self.wait(timeout)
        except TimeoutError:
            self.kill()
            raise
        out, err = (p.read_text(errors="replace") for p in self.logs)
        return out, err

    def output(self) -> str:
        texts = []
        for path in self.logs:
            with contextlib.suppress(OSError):
                texts.append(path.read_text(errors="replace"))
        return "".join(texts)


def start(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    *,
    log: Path,
) -> Rank:
    """Run ``python argv...`` (a script, ``-c CODE`` or ``-m MODULE``, and its arguments);
    see :class:`Rank` and the module's doc."""
    return Rank(argv, env, cwd, log=log)


def wait_all(ranks: Sequence[Rank], timeout: float) -> list[int]:
    """Every rank's exit status, within ``timeout`` seconds for all; on a timeout every rank is
    killed and :class:`TimeoutError` raised with their output."""
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for rank in ranks:
            codes.append(rank.wait(max(0.0, deadline - time.monotonic())))
    except TimeoutError as exc:
        for rank in ranks:
            rank.kill()
        for rank in ranks:
            with contextlib.suppress(TimeoutError):
                rank.wait(30)
        logs = "\n".join(f"--- rank pid {r.pid}:\n{r.output()}" for r in ranks)
        raise TimeoutError(f"{exc}\n{logs}") from None
    return codes


def run(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    *,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True,
    timeout=timeout)``, the process forked from the server (see :func:`start`); a timeout
    kills it and raises :class:`subprocess.TimeoutExpired`."""
    fd, stem = tempfile.mkstemp(prefix="cryosnap-test-")
    os.close(fd)
    try:
        proc = Rank(argv, env, cwd, log=Path(stem))
        try:
            out, err = proc.communicate(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired([sys.executable, *argv], timeout) from None
        return subprocess.CompletedProcess([sys.executable, *argv], proc.wait(), out, err)
    finally:
        for path in (stem, f"{stem}.out", f"{stem}.err"):
            with contextlib.suppress(OSError):
                os.unlink(path)
