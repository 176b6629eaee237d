"""Fixtures for the integration tests: a loopback S3 server (moto), as s3fs's own tests use.

``s3_endpoint`` runs moto's server (``moto.server.main``) in a child process bound to
127.0.0.1 for the whole session: nothing of moto is imported into the test process (moto
registers botocore handlers on import), its request log and warnings stay out of the tests, and
it exits with the test process however that ends. ``s3_bucket`` gives each test a fresh, empty
bucket and the ``storage_options`` that reach it; ``s3_env`` points boto's environment at it.
``killed_before_flush`` makes a two-level run whose program died before its last flush.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.integration.levels_support import KillBeforeFlush, KilledRun

_START_SECONDS = 30.0

# The server process exits when its stdin closes, i.e. when this test process goes away in any
# way (even SIGKILL), so an interrupted run never leaves a moto server behind.
_SERVER = """
import os, sys, threading
from moto.server import main

def orphaned():
    sys.stdin.buffer.read()
    os._exit(0)

threading.Thread(target=orphaned, daemon=True).start()
main(["-H", "127.0.0.1", "-p", sys.argv[1]])
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _answers(url: str) -> bool:
    # No proxy: the server is on loopback, whatever HTTP(S)_PROXY says.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start moto's server on a free loopback port; retry if another process took the port."""
    failures = []
    for _ in range(3):
        port = _free_port()
        endpoint = f"http://127.0.0.1:{port}"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER, str(port)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + _START_SECONDS
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers(endpoint + "/moto-api/"):
                return proc, endpoint
            time.sleep(0.1)
        _stop(proc)
        failures.append(f"port {port}: {log.read_text(errors='replace')[-2000:]}")
    raise RuntimeError("moto server did not start:\n" + "\n".join(failures))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a moto S3 server on 127.0.0.1, running for the whole session."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    proc, endpoint = _start_moto(tmp_path_factory.mktemp("moto") / "server.log")
    try:
        yield endpoint
    finally:
        _stop(proc)


def s3_options(endpoint: str) -> dict[str, Any]:
    """fsspec storage options for the moto server at ``endpoint``."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


@pytest.fixture(scope="session")
def _s3_session() -> Any:
    """One aiobotocore session for the whole run: it loads botocore's service models once.

    Every test still gets its own S3FileSystem and client (the instance cache is cleared), but a
    client on a fresh session costs ~0.3 s of JSON parsing, on a shared one ~0.05 s.
    """
    from aiobotocore.session import AioSession

    return AioSession()


@pytest.fixture(scope="session")
def _s3_admin(s3_endpoint: str, _s3_session: Any) -> Any:
    """A private S3FileSystem (outside the instance cache) that creates and removes buckets."""
    import s3fs

    return s3fs.S3FileSystem(
        skip_instance_cache=True, session=_s3_session, **s3_options(s3_endpoint)
    )


@dataclass
class S3Bucket:
    """A fresh bucket on the moto server and the storage options that reach it."""

    endpoint: str
    name: str
    storage_options: dict[str, Any]
    admin: Any  # an S3FileSystem of its own, to look behind a store's back (never its cache)

    def url(self, path: str = "run") -> str:
        return f"s3://{self.name}/{path}"


@pytest.fixture
def s3_bucket(s3_endpoint: str, _s3_session: Any, _s3_admin: Any) -> Iterator[S3Bucket]:
    """A new, empty bucket per test; no S3FileSystem instance is shared with other tests."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    name = f"cryosnap-{uuid.uuid4().hex[:16]}"
    # us-east-1 takes no LocationConstraint (which _s3_admin.mkdir(name) would send).
    _s3_admin.call_s3("create_bucket", Bucket=name)
    options = {**s3_options(s3_endpoint), "session": _s3_session}
    try:
        yield S3Bucket(s3_endpoint, name, options, _s3_admin)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        _s3_admin.rm(name, recursive=True)


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point boto's environment at the moto server (for tests that pass no storage options)."""
    for name in list(os.environ):
        if name.startswith("AWS_") and name != "AWS_CA_BUNDLE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3_endpoint


@pytest.fixture
def killed_before_flush(tmp_path: Path) -> KillBeforeFlush:
    """Makes, under ``tmp_path``, a run that saved steps 1..``last`` (default 2) on the scratch
    tiers named ``scratch`` (default one, ``scratch``) and on ``persistent``, and died as the
    flush of ``last`` began: ``last`` is on scratch only (tests/integration/levels_support.py)."""
    from tests.integration.levels_support import KilledRun, killed_run

    def make(*, last: int = 2, scratch: Sequence[str] = ("scratch",)) -> KilledRun:
        run = KilledRun(tmp_path / "persistent", [tmp_path / name for name in scratch])
        killed_run(run.persistent, run.scratch, last)
        return run

    return make
