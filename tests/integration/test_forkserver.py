"""The test launcher's forked processes behave as the ``python ...`` processes they replace."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from tests import forkserver

_PROBE = textwrap.dedent(
    """
    import atexit, json, multiprocessing, os, sys, threading, time
    import numpy as np

    out = sys.argv[1]

    def child_ppid():  # a child of the default start method is this process's own
        q = multiprocessing.Queue()
        p = multiprocessing.Process(target=report_ppid, args=(q,))
        p.start(); ppid = q.get(timeout=60); p.join(60)
        return ppid

    def report_ppid(q):
        q.put(os.getppid())
    def at_exit():
        with open(out + ".atexit", "w") as f:
            f.write("ran")
    atexit.register(at_exit)
    def late():  # a non-daemon thread: the interpreter waits for it before exiting
        time.sleep(0.2)
        with open(out + ".thread", "w") as f:
            f.write("ran")
    threading.Thread(target=late).start()
    report = {
        "pid": os.getpid(), "cwd": os.getcwd(), "argv": sys.argv, "name": __name__,
        "env": os.environ.get("PROBE"), "rand": float(np.random.random()),
        "path0": sys.path[0], "start": multiprocessing.get_start_method(),
        "process": multiprocessing.current_process().name,
        "parent": multiprocessing.parent_process() is None,
        "child_ppid": child_ppid(),
    }
    with open(out, "w") as f:
        json.dump(report, f)
    print("to stdout"); print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[2]))
    """
)


@pytest.mark.parametrize("how", ["script", "-c"])
def test_a_forked_process_is_the_process_it_replaces(tmp_path: Path, how: str) -> None:
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    reports = []
    for k in range(2):
        out = tmp_path / f"report-{k}.json"
        argv = [str(script)] if how == "script" else ["-c", _PROBE]
        env = {**os.environ, "PROBE": f"value-{k}"}
        proc = forkserver.start([*argv, str(out), "3"], env, tmp_path, log=tmp_path / f"log-{k}")
        assert proc.wait(60) == 3
        stdout, stderr = proc.communicate(1)
        assert stdout == "to stdout\n" and stderr == "to stderr\n"
        report = json.loads(out.read_text())
        assert report["pid"] == proc.pid != os.getpid()
        assert report["cwd"] == str(tmp_path) and report["env"] == f"value-{k}"
        assert report["name"] == "__main__"
        assert (report["start"], report["process"], report["parent"]) == (
            "fork",
            "MainProcess",
            True,
        )
        assert report["child_ppid"] == proc.pid
        assert report["argv"][1:] == [str(out), "3"]
        assert report["path0"] == (str(tmp_path) if how == "script" else "")
        assert (tmp_path / f"report-{k}.json.atexit").read_text() == "ran"
        assert (tmp_path / f"report-{k}.json.thread").read_text() == "ran"
        reports.append(report)
    assert reports[0]["rand"] != reports[1]["rand"]  # numpy's generator seeded per process


def test_a_killed_process_reports_the_signal(tmp_path: Path) -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert forkserver.start(["-c", code], log=tmp_path / "log").wait(60) == -signal.SIGKILL
    done = forkserver.run(["-c", "import sys; print('x'); sys.exit(2)"], timeout=60)
    assert (done.returncode, done.stdout, done.args[0]) == (2, "x\n", sys.executable)


def test_a_hung_process_is_killed_at_the_timeout(tmp_path: Path) -> None:
    hung = forkserver.start(["-c", "import time; time.sleep(600)"], log=tmp_path / "log")
    with pytest.raises(TimeoutError, match="still running"):
        forkserver.wait_all([hung], 0.5)
    assert hung.wait(30) == -signal.SIGKILL
