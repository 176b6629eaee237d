"""cryosnap as DeepSpeed's checkpoint engine, with the real DeepSpeed on CPU (``DS_ACCELERATOR=
cpu``) on 2 gloo ranks under ``torchrun``: deepspeed_job.py beside this file is the training.

One job at ZeRO stage 2 runs in ``make test`` (the engine's contract in one training: lazy
capture, 1/N bytes, incremental bytes, bad input), and one consolidation (``zero_to_fp32``) at
ZeRO 3; the other stages, the SIGKILL-and-resume runs, another data-parallel size and another
stage are ``deep``. DeepSpeed builds a small shared-memory op with g++ and ninja the first time
(cached in ~/.cache/torch_extensions); the ``built_op`` fixture builds it once, under a file
lock, after removing a stale build lock (a build killed midway leaves one, and DeepSpeed would
then wait for it forever).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_dist_torch import free_port

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("torch") is None,
    reason="deepspeed is not installed (pip install -r requirements-dev.txt)",
)

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).resolve().parent / "deepspeed_job.py"
CHUNK = 16 << 10  # deepspeed_job.py's default --chunk-bytes
LAUNCH_TIMEOUT = 420  # one torchrun job on a busy 2-core machine (DeepSpeed's init: ~10 s)
STALE_BUILD_SECONDS = 600  # a build lock older than this was left by a killed build


def _env() -> dict[str, str]:
    # DeepSpeed's op build runs `ninja`: the one pip installed beside this interpreter too.
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }


def _extensions_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "torch_extensions"


_BUILD = (
    "from deepspeed.accelerator import get_accelerator\n"
    "get_accelerator().create_op_builder('ShareMemCommBuilder').load()\n"
)


@pytest.fixture(scope="session")
def built_op() -> None:
    """DeepSpeed's shared-memory op, built (or found built) before any job starts."""
    compiler, path = os.environ.get("CXX", "c++"), _env()["PATH"]
    if shutil.which(compiler, path=path) is None or shutil.which("ninja", path=path) is None:
        pytest.fail(
            f"DeepSpeed builds its CPU op with a C++ compiler ({compiler}) and ninja, and one "
            "is missing: apt-get install g++ (ninja comes with deepspeed's requirements)"
        )
    root = _extensions_dir()
    root.mkdir(parents=True, exist_ok=True)
    with (root / "cryosnap-tests.flock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the kernel releases it if this process dies
        now = time.time()
        for lock in root.glob("*/*/lock"):
            with contextlib.suppress(OSError):
                if now - lock.stat().st_mtime > STALE_BUILD_SECONDS:
                    lock.unlink()
        proc = subprocess.run(
            [sys.executable, "-c", _BUILD],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


def _command(scenario: str, run: Path, out: Path, *args: str, ranks: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(JOB),
        scenario,
        str(run),
        str(out),
        *args,
    ]


def _launch(scenario: str, run: Path, out: Path, *args: str, ranks: int = 2) -> str:
    """Run the job to its end; what rank 0 printed."""
    proc = subprocess.run(
        _command(scenario, run, out, *args, ranks=ranks),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return proc.stdout


def _reports(out: Path, ranks: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]


# -- the contract in one training -----------------------------------------------------------------


@pytest.fixture(scope="module")
def checked(
    built_op: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[int, tuple[Path, list[dict[str, Any]]]]]:
    """The "checks" job per ZeRO stage, run once when first asked for: its run and each
    rank's report."""

    class Lazy(dict[int, tuple[Path, list[dict[str, Any]]]]):
        def __missing__(self, stage: int) -> tuple[Path, list[dict[str, Any]]]:
            base = tmp_path_factory.mktemp(f"checks-{stage}")
            _launch("checks", base / "run", base / "out", "--stage", str(stage))
            self[stage] = (base / "run", _reports(base / "out", 2))
            return self[stage]

    yield Lazy()


def _assert_contract(stage: int, reports: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(reports):
        # A client_state object cryosnap cannot store without pickle: refused when saved.
        assert r["pickle"].startswith("TypeError: cannot checkpoint bad/"), r["pickle"]
        assert "Opaque" in r["pickle"]
        # Two saves at one global step: the second is refused when it is saved.
        assert r["same_step"].startswith("CheckpointExistsError: tag 'b2': global step 3")
        assert r["tags"] == {"a": 2, "b": 3}
        assert r["missing_tag"].startswith("CheckpointNotFoundError: no DeepSpeed checkpoint")
        assert "'a', 'b'" in r["missing_tag"]
        # Lazy capture: "a" holds the weights of its save, not those of the step after it
        # (the step that committed it, before its optimizer step, changed them).
        assert r["step_changed_weights"] and r["lazy_capture"]
        assert r["global_steps"] == 2 and r["client"] == {"position": 2}
        assert r["load_path"].endswith(f"/a/{_model_file(stage, rank)}")
        # Loaded from "a", step 3 again gives the loss and weights of the first time.
        assert r["resumed_loss"] and r["resumed_weights"]
        # DeepSpeed's documented flags: without the scheduler's state it keeps its own.
        assert r["kept_scheduler"]
        if stage == 3:
            assert r["no_optimizer"].startswith("UnsupportedError: load_optimizer_states=False")
        else:
            assert r["module_only"]
        # Saves at consecutive steps wait for the one before (never a hang): all landed.
        assert r["tags_end"] == {"a": 2, "c3": 3, "c4": 4, "c5": 5}
        # Saved to another folder, as the HF Trainer does (no tag): loaded from there.
        assert r["elsewhere"] == {
            "tag_folder": True,
            "load_path": f"global_step6/{_model_file(stage, rank)}",
            "weights": True,
            "tags": {"global_step6": 6},
        }
    assert reports[0]["verified"]
    _assert_bytes(stage, reports)


def _model_file(stage: int, rank: int) -> str:
    prefix = f"zero_pp_rank_{rank}_" if stage == 3 else ""
    return f"{prefix}mp_rank_00_model_states.pt"


def _assert_bytes(stage: int, reports: list[dict[str, Any]]) -> None:
    """Bytes written per rank (SaveInfo.written_bytes) against what DeepSpeed's state holds."""
    world = len(reports)
    first = [r["info"][0] for r in reports]
    second = [r["info"][1] for r in reports]
    replicated = reports[0]["bytes"]["replicated"]
    for info in first:
        # The files every rank holds alike: 1/N of them each (and all of its own part).
        own = info["logical"] - replicated
        assert info["written"] <= replicated / world + own + CHUNK, (info, replicated)
    assert sum(i["written"] for i in first) >= replicated  # all of it, once in total
    # The second save: the frozen base is not written again; the trained parameters and the
    # optimizer state (fp32 master copy at ZeRO 1-3, two Adam moments) are.
    trained, frozen = reports[0]["bytes"]["trained"], reports[0]["bytes"]["frozen"]
    changed = trained * (3 if stage == 0 else 4)
    assert sum(i["written"] for i in second) <= changed + 4 * CHUNK * world, (second, changed)
    assert sum(i["written"] for i in first) - sum(i["written"] for i in second) >= frozen - CHUNK


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_engine_contract_at_zero_stage_2(checked: dict[int, Any]) -> None:
    _run, reports = checked[2]
    _assert_contract(2, reports)


@pytest.mark.deep
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_engine_contract(checked: dict[int, Any], stage: int) -> None:
    _run, reports = checked[stage]
    _assert_contract(stage, reports)


@pytest.mark.deep
def test_replicated_state_is_written_1_over_n(checked: dict[int, Any]) -> None:
    """At ZeRO 0 the whole version is replicated: each rank writes within 1/N + one chunk."""
    _run, reports = checked[0]
    first = [r["info"][0] for r in reports]
    logical = first[0]["logical"]
    assert all(i["logical"] == logical for i in first)
    for info in first:
        assert info["written"] <= logical / len(reports) + CHUNK, first
    assert sum(i["written"] for i in first) <= logical + CHUNK


# -- another data-parallel size, another ZeRO stage ----------------------------------------------


@pytest.mark.deep
@pytest.mark.parametrize("stage", [0, 2])
def test_another_data_parallel_size(checked: dict[int, Any], tmp_path: Path, stage: int) -> None:
    """A version of 2 ranks loaded by 1: at ZeRO 0 (every file replicated) all of it; at ZeRO 2
    a WorldSizeError saying what to do, and the model weights with load_module_only."""
    run, reports = checked[stage]
    _launch("world", run, tmp_path, "--stage", str(stage), ranks=1)
    [got] = _reports(tmp_path, 1)
    if stage == 0:
        assert got["full"] is True
    else:
        assert got["full"].startswith("WorldSizeError: tag 'c5' (step 5 of ")
        assert "restart at 2 ranks" in got["full"] and "load_module_only=True" in got["full"]
    assert got["module_only"] is True
    assert got["weights"] == reports[0]["weights_c5"]


@pytest.mark.deep
def test_another_zero_stage(checked: dict[int, Any], tmp_path: Path) -> None:
    run = checked[2][0]
    _launch("stage", run, tmp_path, "--stage", "1")
    for got in _reports(tmp_path, 2):
        assert got["stage"].startswith("StateMismatchError: tag 'c5' (step 5 of ")
        assert "saved at ZeRO stage 2, this engine runs stage 1" in got["stage"]


# -- killed with SIGKILL, resumed -----------------------------------------------------------------


def _losses(out: str) -> dict[int, str]:
    return {int(s): v for s, v in re.findall(r"^loss (\d+) (\S+)$", out, re.M)}


def _signal_tree(pid: int, signum: int) -> None:
    """``signum`` to ``pid`` and every process below it (torchrun's ranks)."""
    import psutil

    procs = [psutil.Process(pid)]
    with contextlib.suppress(psutil.NoSuchProcess):
        procs += procs[0].children(recursive=True)
    for p in reversed(procs):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signum)


def _killed(run: Path, out: Path, args: list[str], after: str) -> str:
    """Start a training; SIGKILL it and its ranks once rank 0 printed ``after``."""
    proc = subprocess.Popen(
        _command("train", run, out, *args, "--sleep", "0.5", ranks=2),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    seen = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(after + " "):
                _signal_tree(proc.pid, signal.SIGKILL)
                break
        rest = proc.communicate(timeout=LAUNCH_TIMEOUT)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return "".join(seen) + (rest or "")


@pytest.mark.deep
@pytest.mark.timeout(4 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize(("stage", "how"), [(2, "install"), (3, "register"), (1, "install")])
def test_killed_and_resumed_bit_for_bit(
    built_op: None, tmp_path: Path, stage: int, how: str
) -> None:
    """A training killed with SIGKILL mid-way resumes from its newest durable version and
    ends as the uninterrupted one: the same loss at every step after, the same weights."""
    args = ["--stage", str(stage), "--steps", "12", "--every", "3"]
    if how == "register":
        args.append("--register")  # register() and a "cryosnap" config section
    want = _launch("train", tmp_path / "straight", tmp_path / "out", *args)
    want_losses = _losses(want)
    assert sorted(want_losses) == list(range(1, 13))
    run = tmp_path / "killed"
    out = _killed(run, tmp_path / "out", args, after="loss 8")
    assert "saved 6" in out and "final" not in out, out[-3000:]
    assert all(want_losses[s] == v for s, v in _losses(out).items())
    again = _launch("train", run, tmp_path / "out", *args, "--resume")
    [resumed] = re.findall(r"^resumed (\d+)$", again, re.M)
    assert int(resumed) in (3, 6), again[-3000:]  # a version saved before the kill
    got = _losses(again)
    assert sorted(got) == list(range(int(resumed) + 1, 13))
    assert all(want_losses[s] == v for s, v in got.items())
    assert re.findall(r"^final (\w+)$", again, re.M) == re.findall(r"^final (\w+)$", want, re.M)


# -- zero_to_fp32 from a version -------------------------------------------------------------------


def _assert_consolidated(stage: int, out: Path) -> None:
    """The safetensors consolidated from the version are the live engine's fp32 weights of
    that save, bit for bit; the errors are clear; no temporary folder is left."""
    import torch
    from safetensors.torch import load_file

    report = json.loads((out / "rank-0.json").read_text())
    assert report["by_step"] == report["by_tag"] == 3 and report["newest"] == 4
    assert report["plain"].startswith("CheckpointFormatError: step 1 of ")
    assert "is not a DeepSpeed checkpoint" in report["plain"]
    assert report["missing_tag"].startswith("CheckpointNotFoundError: no DeepSpeed checkpoint")
    want = torch.load(out / "reference.pt")
    assert len(want) == 6, sorted(want)
    for name in ("by-step", "by-tag"):
        got = load_file(out / f"{name}.safetensors")
        assert sorted(got) == sorted(want), (stage, name)
        for key, tensor in want.items():
            assert got[key].dtype == torch.float32 and got[key].shape == tensor.shape, key
            assert torch.equal(got[key].view(torch.int32), tensor.view(torch.int32)), key
    newest = load_file(out / "newest.safetensors")
    assert any(not torch.equal(newest[k], want[k]) for k in want)  # step 4 trained on
    leftover = list(Path(tempfile.gettempdir()).glob("cryosnap-zero-to-fp32-*"))
    assert not leftover, leftover


@pytest.mark.deep
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
def test_consolidate_at_zero_stage_3(built_op: None, tmp_path: Path) -> None:
    _launch("fp32", tmp_path / "run", tmp_path / "out", "--stage", "3")
    _assert_consolidated(3, tmp_path / "out")


@pytest.mark.deep
@pytest.mark.timeout(2 * LAUNCH_TIMEOUT)
@pytest.mark.parametrize("stage", [1, 2])
def test_consolidate(built_op: None, tmp_path: Path, stage: int) -> None:
    _launch("fp32", tmp_path / "run", tmp_path / "out", "--stage", str(stage))
    _assert_consolidated(stage, tmp_path / "out")
