"""The ``cryosnap`` command line: ls, inspect, verify, export; exit codes and error lines.

A few cases run the CLI as a user types it (``python -m cryosnap ...`` in a subprocess); the rest
call ``cryosnap.cli.main(argv)`` in process to stay fast.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import uuid
from datetime import datetime
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import cryosnap
import cryosnap.cli
import cryosnap.storage
from cryosnap import engine
from cryosnap.cli import main
from cryosnap.export import ExportError, ExportResult, export
from cryosnap.progress import human_bytes
from cryosnap.storage import LocalStore
from tests import forkserver


def torch_state() -> dict[str, Any]:
    emb = torch.arange(12.0).reshape(4, 3)
    return {
        "model": {"emb": emb, "head": emb, "bias": torch.ones(3, dtype=torch.float64)},
        "optim": {"step": 7, "lr": 1e-3, "name": "adamw", 0: torch.arange(4)},
        "pair": (1, 2.5),
    }


def mixed_state() -> dict[str, Any]:
    state = torch_state()
    state["arr"] = np.arange(5.0)
    state["scale"] = np.float32(2.5)
    state["raw"] = b"\x00ab\x00"
    state["none"] = None
    return state


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A run with steps 1 and 2 of a mixed torch/numpy/scalar state."""
    path = tmp_path / "run"
    state = mixed_state()
    cryosnap.save(path, state, step=1)
    state["arr"] = np.arange(6.0)
    cryosnap.save(path, state, step=2)
    return path


@pytest.fixture
def torch_run(tmp_path: Path) -> Path:
    path = tmp_path / "torch-run"
    cryosnap.save(path, torch_state(), step=3)
    return path


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


# The leaf paths of mixed_state(), in tree order.
MIXED_LEAVES = [
    "model/emb",
    "model/head",
    "model/bias",
    "optim/step",
    "optim/lr",
    "optim/name",
    "optim/0",
    "pair/0",
    "pair/1",
    "arr",
    "scale",
    "raw",
    "none",
]


def shell(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """Run ``python -m cryosnap ARGS`` as a user would (forked from tests/forkserver.py's
    server: a process of its own, its own exit status and streams)."""
    return forkserver.run(["-m", "cryosnap", *(str(a) for a in args)], timeout=120)


def assert_one_error_line(err: str, *fragments: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("cryosnap: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], err


def flip_byte(run: Path, content: bytes) -> None:
    """Damage the first byte of ``content`` (a leaf's bytes) where the run's data files hold it.

    Content is stored once per run (de-duplicated), so damage reaches every version that holds
    it: tests pick content that only one version has.
    """
    for data in sorted((run / "data").glob("*.dat")):
        raw = bytearray(data.read_bytes())
        at = raw.find(content)
        if at >= 0:
            raw[at] ^= 0xFF
            data.write_bytes(bytes(raw))
            return
    raise AssertionError(f"no data file holds {content!r:.40}")


ARR_1 = np.arange(5.0).tobytes()  # the leaf "arr" of step 1 only
ARR_2 = np.arange(6.0).tobytes()  # the leaf "arr" of step 2 only


# ---------------------------------------------------------------------------------------------
# the command line stands on the public API only

CLI_DIR = Path(cryosnap.cli.__file__).parent
# The public modules a command may use; the engine, the format, the lock, storage internals and
# every private module outside cli/ are out of bounds.
PUBLIC = {
    "cryosnap",
    "cryosnap.bench",
    "cryosnap.dcp",
    "cryosnap.demo",
    "cryosnap.errors",
    "cryosnap.export",
    "cryosnap.plan",
    "cryosnap.policy",
    "cryosnap.progress",
    "cryosnap.run",
}
THIRD_PARTY = {"typer", "rich", "numpy", "matplotlib"}


def cli_imports(source: Path) -> list[tuple[str, str | None]]:
    """``(module, name)`` of every import in ``source``, deferred ones included; relative
    imports resolved (``name`` None for a plain ``import``)."""
    package = "cryosnap.cli"
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join([*base, node.module] if node.module else base)
            if not node.level:
                module = node.module or ""
            found += [(module, alias.name) for alias in node.names]
    return found


def test_the_cli_imports_only_the_public_api() -> None:
    sources = sorted(CLI_DIR.glob("*.py"))
    assert len(sources) > 5
    wrong = []
    for source in sources:
        for module, name in cli_imports(source):
            if module == "cryosnap.cli" or module.startswith("cryosnap.cli."):
                continue
            if module.startswith("cryosnap"):
                target = f"{module}.{name}" if name and module == "cryosnap" else module
                public = target in PUBLIC or (module == "cryosnap" and name == "__version__")
                if not public or (name and name.startswith("_") and name != "__version__"):
                    wrong.append(f"{source.name}: from {module} import {name}")
            elif module.split(".")[0] not in sys.stdlib_module_names | THIRD_PARTY:
                wrong.append(f"{source.name}: import {module}")
    assert not wrong, wrong


def test_the_import_check_sees_a_private_import(tmp_path: Path) -> None:
    source = tmp_path / "bad.py"
    source.write_text("def f():\n    from ..engine import list_steps\n    from .. import _gc\n")
    assert cli_imports(source) == [("cryosnap.engine", "list_steps"), ("cryosnap", "_gc")]


# ---------------------------------------------------------------------------------------------
# as a user types it


def test_shell_help_and_commands(run: Path) -> None:
    res = shell("--help")
    assert res.returncode == 0, res.stderr
    commands = ("ls", "inspect", "verify", "export", "diff", "gc", "rm", "demo", "plan", "bench")
    for command in commands:
        assert command in res.stdout

    res = shell("ls", run)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert [line.split()[0] for line in res.stdout.splitlines()[1:]] == ["1", "2"]


def test_shell_verify_damaged_exits_1_naming_the_leaf(run: Path) -> None:
    flip_byte(run, ARR_2)
    res = shell("verify", run)
    assert res.returncode == 1, res.stderr
    assert "DAMAGED" in res.stdout
    assert "leaf arr" in res.stdout
    assert "1 of 2 versions damaged" in res.stdout
    assert "Traceback" not in res.stderr


def test_shell_missing_path_exits_2_with_one_line(tmp_path: Path) -> None:
    res = shell("inspect", tmp_path / "nope")
    assert res.returncode == 2
    assert res.stdout == ""
    assert_one_error_line(res.stderr, "no checkpoint at", "nope")


def test_shell_bad_option_exits_2_with_one_line(run: Path) -> None:
    res = shell("ls", run, "--bogus")
    assert res.returncode == 2
    assert_one_error_line(res.stderr, "--bogus", "cryosnap ls --help")


def test_shell_export_round_trip(torch_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "state.pt"
    res = shell("export", torch_run, "--step", "3", out)
    assert res.returncode == 0, res.stderr
    assert out.exists()
    loaded = torch.load(out, weights_only=True)
    expected = torch_state()
    assert torch.equal(loaded["model"]["emb"], expected["model"]["emb"])
    assert loaded["optim"]["step"] == 7


def test_shell_export_bfloat16_to_npz_exits_2(tmp_path: Path) -> None:
    cryosnap.save(tmp_path / "run", {"w": torch.ones(2, dtype=torch.bfloat16)}, step=0)
    out = tmp_path / "w.npz"
    res = shell("export", tmp_path / "run", "--step", "0", out)
    assert res.returncode == 2
    assert_one_error_line(res.stderr, "leaf w", "bfloat16", ".pt", ".safetensors")
    assert not out.exists()
    assert list(tmp_path.glob(".w.npz.*")) == []


# ---------------------------------------------------------------------------------------------
# ls


def test_ls_text(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    code, out, err = cli(capsys, "ls", run)
    assert (code, err) == (0, "")
    header, *rows = out.splitlines()
    assert header.split() == [
        *("step", "created", "world", "leaves", "logical", "written", "files"),
        *("owns", "reads", "pins"),
    ]
    assert len(rows) == 2
    cells = rows[1].split()
    assert cells[0] == "2"
    datetime.fromisoformat(cells[1])
    assert cells[2:4] == ["1", "13"]
    assert "\x1b[" not in out  # plain text when stdout is not a terminal


def test_ls_json(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    info = cryosnap.save(run, {"x": torch.zeros(1000)}, step=9)
    code, out, _ = cli(capsys, "ls", run, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["path"] == str(run)
    assert [v["step"] for v in doc["versions"]] == [1, 2, 9]
    last = doc["versions"][-1]
    assert last["damaged"] is False
    assert last["logical_bytes"] == info.logical_bytes == 4000
    assert last["written_bytes"] == info.written_bytes
    assert last["world_size"] == 1
    assert last["leaves"] == 1
    # Incremental: exactly the files its chunks lie in (its own, or its chain's).
    read = engine.resolve_version(LocalStore(run), 9).used_files()
    assert last["data_files"] == len(read)
    assert datetime.fromisoformat(last["created"]).timestamp() == pytest.approx(
        last["created_unix"], abs=1
    )


def test_ls_shows_a_damaged_commit_record_as_a_row(
    capsys: pytest.CaptureFixture[str], run: Path
) -> None:
    (run / "versions" / f"{1:012d}" / "COMMIT.json").write_bytes(b"garbage")
    code, out, err = cli(capsys, "ls", run)
    assert (code, err) == (0, "")
    rows = out.splitlines()[1:]
    assert rows[0].split()[:2] == ["1", "DAMAGED:"]
    assert "not valid JSON" in rows[0]
    assert rows[1].split()[0] == "2"

    code, out, _ = cli(capsys, "ls", run, "--json")
    assert code == 0
    first, second = json.loads(out)["versions"]
    assert first["damaged"] is True and "COMMIT.json" in first["error"]
    assert second["damaged"] is False


def test_ls_rich_table_on_a_terminal(
    capsys: pytest.CaptureFixture[str], run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (run / "versions" / f"{1:012d}" / "COMMIT.json").write_bytes(b"garbage")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    code, out, err = cli(capsys, "ls", run)
    assert (code, err) == (0, "")
    assert "created" in out and "DAMAGED" in out and "not valid JSON" in out


def test_ls_memory_url(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"memory://cli-{uuid.uuid4().hex}/run"
    cryosnap.save(url, {"w": np.ones(4)}, step=5)
    code, out, _ = cli(capsys, "ls", url, "--json")
    assert code == 0
    assert [v["step"] for v in json.loads(out)["versions"]] == [5]


def test_ls_dir_without_versions(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.dat").write_bytes(b"x")
    code, out, err = cli(capsys, "ls", tmp_path, "--json")
    assert code == 2
    assert_one_error_line(err, "no committed version in")
    # With --json the error is also one JSON object on stdout, with the exit code.
    doc = json.loads(out)
    assert doc["exit_code"] == 2 and doc["type"] == "CheckpointNotFoundError"
    assert doc["error"].startswith("no committed version in")


def test_version_flag(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out.strip() == f"cryosnap {cryosnap.__version__}"


def test_json_usage_errors_are_json_on_stdout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = cli(capsys, "inspect", tmp_path / "none", "--json")
    assert code == 2 and json.loads(out)["exit_code"] == 2
    assert_one_error_line(err, "no checkpoint at")
    code, out, _ = cli(capsys, "gc", tmp_path, "--json")  # --keep missing
    assert code == 2 and json.loads(out)["type"] == "usage"


def test_ls_of_a_directory_holding_tier_runs_points_at_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cryosnap.save(tmp_path / "persistent", {"x": np.arange(3)}, step=1)
    code, _, err = cli(capsys, "ls", tmp_path)
    assert code == 2
    assert_one_error_line(err, "holds the run(s)")
    assert str(tmp_path / "persistent") in err


def test_export_defaults_to_the_newest_and_never_overwrites(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cryosnap.save(run, {"x": np.arange(3)}, step=1)
    cryosnap.save(run, {"x": np.arange(4)}, step=2)
    out = tmp_path / "x.npz"
    code, stdout, _ = cli(capsys, "export", run, out, "--json")
    assert code == 0 and json.loads(stdout)["step"] == 2
    assert np.load(out)["x"].tolist() == [0, 1, 2, 3]
    code, _, err = cli(capsys, "export", run, out, "--step", "1")
    assert code == 2
    assert_one_error_line(err, "exists; pass --force")
    assert np.load(out)["x"].tolist() == [0, 1, 2, 3]
    code, _, _ = cli(capsys, "export", run, out, "--step", "1", "--force")
    assert code == 0 and np.load(out)["x"].tolist() == [0, 1, 2]


def test_gc_dry_run_deletes_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = tmp_path / "run"
    for step in range(4):
        cryosnap.save(run, {"x": np.full(1000, step)}, step=step, chunk_bytes=4096 << step)
    before = sorted(p.name for p in (run / "data").iterdir())
    code, out, _ = cli(capsys, "gc", run, "--keep", "1", "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["dry_run"] and doc["deleted_steps"] == [0, 1, 2]
    assert doc["data_files_deleted"] == 3 and doc["freed_bytes"] > 0
    assert sorted(p.name for p in (run / "data").iterdir()) == before
    code, out, _ = cli(capsys, "gc", run, "--keep", "1", "--json")
    assert json.loads(out)["deleted_steps"] == [0, 1, 2]
    assert len(list((run / "data").iterdir())) == 1


def test_ls_and_gc_say_what_kept_versions_pin(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A run kept whole (no retention, so nothing copied forward): every incremental version
    reads the small leaf from the first version's file. gc says that file stays, and once its
    version is gone ls shows the versions that pin it."""
    run = tmp_path / "run"
    small = np.arange(1000, dtype=np.uint8)
    with cryosnap.Checkpointer(run, chunk_bytes=4096) as ckpt:
        for step in range(5):
            ckpt.save(step, {"w": np.arange(4096.0) + step, "small": small}).result()
    first = next(p for p in (run / "data").iterdir() if p.name.startswith("000000000000-"))
    code, out, _ = cli(capsys, "ls", run, "--json")
    rows = {v["step"]: v for v in json.loads(out)["versions"]}
    assert code == 0 and rows[0]["referenced_bytes"] == 0
    assert all(rows[s]["referenced_bytes"] == first.stat().st_size for s in range(1, 5))
    assert all(rows[s]["owned_bytes"] == 4096 * 8 for s in range(1, 5))
    assert all(v["pinned_bytes"] == 0 for v in rows.values())
    code, out, _ = cli(capsys, "gc", run, "--keep", "3", "--dry-run", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["deleted_steps"] == [0, 1]
    assert doc["still_read_bytes"] == first.stat().st_size  # step 0's file stays
    assert doc["freed_bytes"] < 2 * 4096 * 8 + first.stat().st_size
    code, out, _ = cli(capsys, "gc", run, "--keep", "3", "--dry-run")
    assert "of their data stays: kept versions or forks read it" in out
    cli(capsys, "gc", run, "--keep", "3")
    assert first.exists()
    code, out, _ = cli(capsys, "ls", run, "--json")
    rows = {v["step"]: v for v in json.loads(out)["versions"]}
    assert sorted(rows) == [2, 3, 4]
    assert all(v["pinned_bytes"] == first.stat().st_size for v in rows.values())
    code, out, _ = cli(capsys, "ls", run)
    assert out.splitlines()[0].split()[-3:] == ["owns", "reads", "pins"]


# ---------------------------------------------------------------------------------------------
# rm


def run_files(run: Path) -> dict[str, bytes]:
    """The run's versions and data (the write lock's file records each writer that opens)."""
    files = {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    return {k: v for k, v in files.items() if k != "writer.lock"}


def test_rm_as_typed(tmp_path: Path) -> None:
    run_dir = tmp_path / "inc"
    arr = np.zeros(10_000)
    with cryosnap.Checkpointer(run_dir, chunk_bytes=4096) as ckpt:
        for step in range(3):
            arr[step * 1000] = step + 1
            ckpt.save(step, {"a": arr}).result()
    res = shell("rm", run_dir, "--step", "0")  # the base of 1 and 2: they still restore
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert res.stdout.startswith("removed step 0, kept 2 versions; freed "), res.stdout
    np.testing.assert_array_equal(cryosnap.load(run_dir)["a"], arr)
    res = shell("rm", run_dir, "--step", "0")
    assert res.returncode == 2 and res.stdout == ""
    assert_one_error_line(res.stderr, "step 0 not found in", str(run_dir))


def test_rm_dry_run_and_json(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    before = run_files(run)
    code, out, err = cli(capsys, "rm", run, "--step", "2", "--dry-run")
    assert (code, err) == (0, "")
    assert out.startswith("would remove step 2, kept 1 version; would free "), out
    assert out.rstrip().endswith("(1 data file)")
    code, out, _ = cli(capsys, "rm", run, "--step", "2", "--dry-run", "--json")
    planned = json.loads(out)
    assert code == 0 and planned["dry_run"] and planned["step"] == 2
    assert planned["kept_steps"] == [1] and planned["data_files_deleted"] == 1
    assert run_files(run) == before
    code, out, _ = cli(capsys, "rm", run, "--step", "2", "--json")
    done = json.loads(out)
    assert code == 0 and not done["dry_run"]
    assert {k: v for k, v in done.items() if k != "dry_run"} == {
        k: v for k, v in planned.items() if k != "dry_run"
    }
    assert cryosnap.Run(run).steps() == [1]
    code, out, _ = cli(capsys, "ls", run, "--json")
    assert [v["step"] for v in json.loads(out)["versions"]] == [1]


def test_rm_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    before = run_files(run)
    code, out, err = cli(capsys, "rm", run, "--step", "7", "--json")
    assert code == 2 and json.loads(out)["type"] == "CheckpointNotFoundError"
    assert_one_error_line(err, "step 7 not found in", str(run))
    code, out, err = cli(capsys, "rm", run.parent / "nope", "--step", "1")
    assert (code, out) == (2, "")
    assert_one_error_line(err, "no checkpoint at")
    assert not (run.parent / "nope").exists()
    code, _, err = cli(capsys, "rm", run)  # --step missing
    assert code == 2 and "--step" in err
    code, _, err = cli(capsys, "rm", run, "--step", "-1")
    assert code == 2 and "--step" in err
    with cryosnap.Checkpointer(run):
        code, out, err = cli(capsys, "rm", run, "--step", "1", "--json")
    doc = json.loads(out)
    assert code == 2 and doc["type"] == "RunLockedError"
    assert_one_error_line(err, "cannot remove step 1", str(run), "already open for writing by pid")
    assert run_files(run) == before


# ---------------------------------------------------------------------------------------------
# inspect


def test_inspect_json_latest(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    code, out, _ = cli(capsys, "inspect", run, "--json")
    assert code == 0
    doc = json.loads(out)
    assert (doc["step"], doc["rank"], doc["world_size"]) == (2, 0, 1)
    leaves = {leaf["path"]: leaf for leaf in doc["leaves"]}
    assert list(leaves) == MIXED_LEAVES
    emb = leaves["model/emb"]
    assert (emb["kind"], emb["dtype"], emb["shape"], emb["bytes"], emb["chunks"]) == (
        "torch",
        "float32",
        [4, 3],
        48,
        1,
    )
    assert leaves["model/head"]["shared_with"] == "model/emb"
    assert leaves["model/head"]["chunks"] == 0
    assert (leaves["arr"]["kind"], leaves["arr"]["dtype"], leaves["arr"]["shape"]) == (
        "numpy",
        "float64",
        [6],
    )
    assert leaves["optim/step"]["kind"] == "int"
    assert leaves["optim/step"]["value"] == "7"
    assert leaves["optim/name"]["value"] == "'adamw'"
    assert (leaves["scale"]["kind"], leaves["scale"]["dtype"]) == ("npscalar", "float32")
    assert leaves["raw"]["bytes"] == 4
    assert leaves["none"]["kind"] == "none"
    # model/bias and the optimizer's small tensors share one pack.
    assert leaves["optim/0"]["packed_with"] == "model/bias"
    assert leaves["optim/0"]["chunks"] == 0 and leaves["optim/0"]["shared_with"] is None
    assert doc["totals"] == {"leaves": 13, "blobs": 4, "chunks": 4, "logical_bytes": 156}


def test_inspect_text_step(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    code, out, err = cli(capsys, "inspect", run, "--step", "1")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith(f"step 1 of {run}, rank 0 of 1")
    assert lines[1].split() == [
        "path",
        "kind",
        "dtype",
        "shape",
        "bytes",
        "chunks",
        "value",
        "/",
        "note",
    ]
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert rows["arr"].split()[:4] == ["arr", "numpy", "float64", "(5,)"]
    assert "shares storage with model/emb" in rows["model/head"]
    assert "packed with model/bias" in rows["optim/0"]
    assert lines[-1] == "13 leaves, 4 blobs, 4 chunks, 148 B stored"


def test_inspect_missing_step_exits_2(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    code, out, err = cli(capsys, "inspect", run, "--step", "7", "--json")
    assert code == 2 and json.loads(out)["error"].startswith("step 7 not found")
    assert_one_error_line(err, "step 7 not found")


def test_inspect_damaged_manifest_exits_1(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    manifest = run / "versions" / f"{2:012d}" / "rank-00000.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"float32"', b'"float64"'))
    code, _, err = cli(capsys, "inspect", run)
    assert code == 1
    assert_one_error_line(err, "rank-00000.json", "does not match")


# ---------------------------------------------------------------------------------------------
# verify


def test_verify_ok_text_and_json(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    code, out, err = cli(capsys, "verify", run)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[1].split()[:2] == ["1", "OK"]
    assert lines[2].split()[:2] == ["2", "OK"]
    assert lines[-1] == "2 versions OK"

    code, out, _ = cli(capsys, "verify", run, "--step", "2", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["ok"] is True
    assert doc["versions"] == [
        {
            "step": 2,
            "ok": True,
            "world_size": 1,
            "leaves": 13,
            "logical_bytes": 156,
            "errors": [],
        }
    ]


def test_verify_damage_json(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    flip_byte(run, ARR_1)
    code, out, _ = cli(capsys, "verify", run, "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False
    first, second = doc["versions"]
    assert first["ok"] is False and second["ok"] is True
    (error,) = first["errors"]
    assert "step 1" in error and "leaf arr" in error and "does not match its hash" in error

    code, out, _ = cli(capsys, "verify", run, "--step", "2")
    assert code == 0


def test_verify_missing_data_file_is_damage(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    for data in (run / "data").glob(f"{2:012d}-*.dat"):
        data.unlink()
    code, out, err = cli(capsys, "verify", run, "--step", "2")
    assert (code, err) == (1, "")
    assert "DAMAGED" in out and "missing" in out


def test_verify_missing_step_exits_2(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    code, out, err = cli(capsys, "verify", run, "--step", "3")
    assert (code, out) == (2, "")
    assert_one_error_line(err, "step 3 not found")


# ---------------------------------------------------------------------------------------------
# export


def test_export_pt(capsys: pytest.CaptureFixture[str], torch_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    code, stdout, err = cli(capsys, "export", torch_run, "--step", "3", out, "--json")
    assert (code, err) == (0, "")
    doc = json.loads(stdout)
    assert (doc["step"], doc["format"], doc["out"]) == (3, "pt", str(out))
    assert doc["bytes"] == out.stat().st_size
    loaded = torch.load(out, weights_only=True)
    expected = torch_state()
    assert torch.equal(loaded["model"]["emb"], expected["model"]["emb"])
    assert torch.equal(loaded["model"]["bias"], expected["model"]["bias"])
    assert torch.equal(loaded["optim"][0], expected["optim"][0])
    assert loaded["model"]["head"].untyped_storage().data_ptr() == (
        loaded["model"]["emb"].untyped_storage().data_ptr()
    )
    assert {k: v for k, v in loaded["optim"].items() if k != 0} == {
        "step": 7,
        "lr": 1e-3,
        "name": "adamw",
    }
    assert loaded["pair"] == (1, 2.5)


def test_export_pt_with_numpy_leaves_notes_weights_only(
    capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out.pt"
    code, stdout, err = cli(capsys, "export", run, "--step", "1", out)
    assert code == 0
    assert stdout.startswith(f"exported step 1 of {run} to {out}")
    assert err.startswith("cryosnap: note: ") and "weights_only" in err
    loaded = torch.load(out, weights_only=False)
    np.testing.assert_array_equal(loaded["arr"], np.arange(5.0))
    assert loaded["raw"] == b"\x00ab\x00"
    assert loaded["none"] is None


def test_export_safetensors(capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.safetensors"
    code, _, err = cli(capsys, "export", run, "--step", "2", out)
    assert (code, err) == (0, "")
    tensors = load_file(out)
    assert set(tensors) == {
        "model/emb",
        "model/head",
        "model/bias",
        "optim/0",
        "arr",
        "scale",
        "raw",
    }
    assert torch.equal(tensors["model/emb"], torch.arange(12.0).reshape(4, 3))
    assert torch.equal(tensors["model/head"], tensors["model/emb"])  # tied: cloned, equal
    assert torch.equal(tensors["arr"], torch.arange(6.0, dtype=torch.float64))
    assert tensors["scale"].shape == () and tensors["scale"].item() == 2.5
    assert tensors["raw"].tolist() == [0, 97, 98, 0]
    with safe_open(out, "pt") as f:
        metadata = f.metadata()
    assert json.loads(metadata["optim/step"]) == 7
    assert json.loads(metadata["optim/name"]) == "adamw"
    assert json.loads(metadata["pair/1"]) == 2.5
    assert json.loads(metadata["none"]) is None
    assert metadata["format"] == "pt"
    assert out.stat().st_mode & 0o777 == (tmp_path / "run" / "data").stat().st_mode & 0o666


def test_export_safetensors_keeps_bfloat16(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    w = torch.randn(3, 2).to(torch.bfloat16)
    cryosnap.save(tmp_path / "run", {"w": w, "wt": w.t()}, step=0)
    out = tmp_path / "w.safetensors"
    code, _, err = cli(capsys, "export", tmp_path / "run", "--step", "0", out)
    assert (code, err) == (0, "")
    tensors = load_file(out)
    assert torch.equal(tensors["w"], w)
    assert torch.equal(tensors["wt"], w.t())


def test_export_npz(capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    code, _, err = cli(capsys, "export", run, "--step", "2", out)
    assert code == 0
    assert_one_error_line(err.replace("cryosnap: note:", "cryosnap: error:"), "none")
    with np.load(out) as npz:
        assert set(npz.files) == set(MIXED_LEAVES) - {"none"}  # npz cannot hold None
        np.testing.assert_array_equal(
            npz["model/emb"], np.arange(12.0, dtype=np.float32).reshape(4, 3)
        )
        np.testing.assert_array_equal(npz["arr"], np.arange(6.0))
        assert npz["optim/step"].shape == () and npz["optim/step"].item() == 7
        assert npz["optim/name"].item() == "adamw"
        assert npz["scale"].dtype == np.float32 and npz["scale"].item() == 2.5
        assert npz["raw"].tobytes() == b"\x00ab\x00"


def test_export_npz_leaf_named_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cryosnap.save(tmp_path / "run", {"file": np.ones(2), "allow_pickle": 1}, step=0)
    out = tmp_path / "x.npz"
    assert cli(capsys, "export", tmp_path / "run", "--step", "0", out)[0] == 0
    with np.load(out) as npz:
        assert set(npz.files) == {"file", "allow_pickle"}


@pytest.mark.parametrize(
    ("out", "fragment"),
    [("state.txt", "must end in .pt, .safetensors or .npz"), ("nodir/state.pt", "does not exist")],
)
def test_export_bad_out_exits_2(
    capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path, out: str, fragment: str
) -> None:
    code, stdout, err = cli(capsys, "export", run, "--step", "1", tmp_path / out)
    assert (code, stdout) == (2, "")
    assert_one_error_line(err, fragment)


def test_export_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path
) -> None:
    code, _, err = cli(capsys, "export", tmp_path / "nothing", tmp_path / "x.pt")
    assert code == 2
    assert_one_error_line(err, "no checkpoint at")
    code, _, err = cli(capsys, "export", run, "--step", "8", tmp_path / "x.pt")
    assert code == 2
    assert_one_error_line(err, "step 8 not found")
    code, _, err = cli(capsys, "export", run, "--step", "-1", tmp_path / "x.pt")
    assert code == 2
    assert_one_error_line(err, "--step")
    assert list(tmp_path.glob("*.pt")) == []


def test_export_damaged_exits_1_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path
) -> None:
    flip_byte(run, ARR_2)
    out = tmp_path / "x.npz"
    code, stdout, err = cli(capsys, "export", run, "--step", "2", out)
    assert (code, stdout) == (1, "")
    assert_one_error_line(err, "leaf arr", "does not match its hash")
    assert not out.exists()


def test_export_from_python(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.npz"
    result = export(run, out)  # the newest version, rank 0
    assert result == ExportResult(
        path=str(run),
        step=2,
        rank=0,
        out=out,
        format="npz",
        leaves=len(MIXED_LEAVES) - 1,
        skipped=("none",),
        bytes=out.stat().st_size,
    )
    with np.load(out) as npz:
        np.testing.assert_array_equal(npz["arr"], np.arange(6.0))
    pt = export(str(run), str(tmp_path / "out.pt"), step=1)
    assert (pt.step, pt.format, pt.numpy_leaves) == (1, "pt", ("arr", "scale"))
    assert torch.load(pt.out, weights_only=False)["optim"]["name"] == "adamw"


def test_export_from_python_errors(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "x.npz"
    for kwargs, error, match in [
        ({"step": True}, TypeError, "step must be an int"),
        ({"step": -1}, ValueError, "step=-1 is invalid"),
        ({"rank": 1.0}, TypeError, "rank must be an int"),
        ({"force": 1}, TypeError, "force must be a bool"),
    ]:
        with pytest.raises(error, match=match):
            export(run, out, **kwargs)
    with pytest.raises(ValueError, match=r"must end in \.pt, \.safetensors or \.npz"):
        export(run, tmp_path / "x.txt")
    with pytest.raises(TypeError, match="out must be a local file path"):
        export(run, 3)  # type: ignore[arg-type]
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="no checkpoint at"):
        export(tmp_path / "nothing", out)
    assert not out.exists()
    out.write_bytes(b"mine")
    with pytest.raises(ValueError, match="exists; pass --force"):
        export(run, out)
    assert out.read_bytes() == b"mine"
    assert export(run, out, step=1, force=True).step == 1
    cryosnap.save(tmp_path / "bf16", {"w": torch.ones(2, dtype=torch.bfloat16)}, step=0)
    with pytest.raises(ExportError, match="leaf w is a torch bfloat16 tensor") as exc:
        export(tmp_path / "bf16", out, force=True)
    assert isinstance(exc.value, cryosnap.CheckpointError)
    assert np.load(out)["arr"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]  # left as it was


# ---------------------------------------------------------------------------------------------
# parsing and exit codes


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], run: Path) -> None:
    for args, fragment in [
        (["frobnicate"], "No such command"),
        (["inspect"], "Missing argument"),
        (["verify", str(run), "--step", "x"], "--step"),
        (["ls", ""], "must not be empty"),
        (["ls", "nosuchprotocol://bucket/run"], "nosuchprotocol"),
    ]:
        code, out, err = cli(capsys, *args)
        assert (code, out) == (2, ""), args
        assert_one_error_line(err, fragment)


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "verify", "--help")
    assert code == 0
    assert "--step" in out and "--json" in out


def test_no_arguments_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(capsys)
    assert (code, err) == (2, "")
    assert "Usage" in out and "inspect" in out


def test_main_without_argv_exits_the_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "argv", ["cryosnap", "ls", str(tmp_path / "nope")])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    assert_one_error_line(capsys.readouterr().err, "no checkpoint")


def test_internal_error_is_one_line_exit_3(
    capsys: pytest.CaptureFixture[str], run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*_args: object, **_kwargs: object) -> list[int]:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr("cryosnap.engine.list_steps", boom)
    code, out, err = cli(capsys, "ls", run)
    assert (code, out) == (3, "")
    assert_one_error_line(err, "internal error: ZeroDivisionError: boom", "CRYOSNAP_TRACEBACK")

    monkeypatch.setenv("CRYOSNAP_TRACEBACK", "1")
    with pytest.raises(ZeroDivisionError):
        main(["ls", str(run)])


def test_inspect_and_export_unusual_numpy_dtypes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    struct = np.dtype([("id", "<i4"), ("xy", "<f8", (2,)), ("inner", [("a", "u1"), ("b", ">i2")])])
    state = {
        "rec": np.zeros(3, dtype=struct),
        "big": np.arange(4, dtype=">f8"),
        "when": np.array(["2024-01-01"], dtype="<M8[D]"),
    }
    cryosnap.save(tmp_path / "run", state, step=0)
    code, out, _ = cli(capsys, "inspect", tmp_path / "run", "--json")
    assert code == 0
    dtypes = {leaf["path"]: leaf["dtype"] for leaf in json.loads(out)["leaves"]}
    assert dtypes == {"rec": str(struct), "big": ">f8", "when": "datetime64[D]"}

    out_npz = tmp_path / "x.npz"
    assert cli(capsys, "export", tmp_path / "run", "--step", "0", out_npz)[0] == 0
    with np.load(out_npz) as npz:
        for key, value in state.items():
            np.testing.assert_array_equal(npz[key], value)
            assert npz[key].dtype == value.dtype

    out_st = tmp_path / "x.safetensors"
    code, _, err = cli(capsys, "export", tmp_path / "run", "--step", "0", out_st)
    assert code == 2
    assert_one_error_line(err, "leaf rec", "numpy", ".npz")
    assert not out_st.exists()


def test_diff_and_gc_as_typed(tmp_path: Path) -> None:
    run_dir = tmp_path / "inc"
    arr = np.zeros(100_000)
    with cryosnap.Checkpointer(run_dir, chunk_bytes=4096) as ckpt:
        for step in range(4):
            arr[step * 2000 : step * 2000 + 10] = step + 1
            ckpt.save(step, {"a": arr, "lr": 0.1 * step, "same": np.ones(10)}).result()
    res = shell("diff", run_dir, "0", "3", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    leaves = {r["path"]: r for r in doc["leaves"]}
    assert set(leaves) == {"a", "lr"}
    assert leaves["a"]["changed_chunks"] == 3
    assert leaves["a"]["changed_bytes"] == 3 * 4096
    res = shell("diff", run_dir, "1", "2")
    assert res.returncode == 0 and "1/196 chunks" in res.stdout, res.stdout
    res = shell("gc", run_dir, "--keep", "2", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["deleted_steps"] == [0, 1]
    assert cryosnap.engine.list_steps(cryosnap.storage.LocalStore(run_dir)) == [2, 3]
    np.testing.assert_array_equal(cryosnap.load(run_dir)["a"], arr)
    res = shell("gc", run_dir, "--keep", "0")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    res = shell("diff", run_dir, "0", "3")
    assert res.returncode == 2 and "step 0 not found" in res.stderr


# ---------------------------------------------------------------------------------------------
# issue 54: a tree that is not a run, leaves two names map to, flush onto itself, pickles, help


def test_ls_of_a_large_tree_that_is_not_a_run_lists_one_level(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = tmp_path / "usr"
    for i in range(20):
        for j in range(20):
            leaf = tree / f"d{i}" / f"e{j}"
            leaf.mkdir(parents=True)
            (leaf / "file.h").write_text("x")
    (tree / "d0" / "e0" / "not a key!").write_text("x")  # a name the walk would warn about
    listings: list[object] = []
    real_scandir = os.scandir

    def counting_scandir(path: Any = ".") -> Any:
        listings.append(path)
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", counting_scandir)
    code, out, err = cli(capsys, "ls", tree)
    assert code == 2 and out == ""
    assert_one_error_line(err, str(tree), "is not a cryosnap run", "searched 1 level")
    assert len(listings) <= 3, listings  # the directory and the level below it, not 421 dirs


def test_ls_of_a_tree_that_is_not_a_run_as_typed_is_one_line(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    for i in range(30):
        (tree / f"d{i}" / "x").mkdir(parents=True)
        (tree / f"d{i}" / "x" / "bad name!").write_text("x")
    res = shell("ls", tree)
    assert res.returncode == 2 and res.stdout == ""
    assert_one_error_line(res.stderr, "is not a cryosnap run")


def test_leaves_two_names_map_to_export_to_pt_as_a_tree(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run_dir, out = tmp_path / "c", tmp_path / "c.pt"
    state = {"a/b": torch.ones(2), "a": {"b": torch.zeros(3)}, 1: torch.arange(2), "1": 5}
    cryosnap.save(run_dir, state, step=1)
    code, _, err = cli(capsys, "export", run_dir, out)
    assert code == 0, err
    got = torch.load(out, weights_only=True)
    assert set(got) == {"a/b", "a", 1, "1"} and got["1"] == 5
    assert torch.equal(got["a/b"], torch.ones(2)) and torch.equal(got["a"]["b"], torch.zeros(3))
    assert torch.equal(got[1], torch.arange(2))
    for fmt in ("safetensors", "npz"):
        code, _, err = cli(capsys, "export", run_dir, tmp_path / f"c.{fmt}")
        assert code == 2
        assert_one_error_line(err, "'a/b'", f".{fmt} cannot hold", "export to .pt")
        assert not (tmp_path / f"c.{fmt}").exists()


def test_flush_onto_its_own_scratch_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run_dir = tmp_path / "R"
    cryosnap.save(run_dir, {"x": np.arange(3)}, step=1)
    for scratch in (run_dir, f"{run_dir}/", tmp_path / "." / "R"):
        code, out, err = cli(capsys, "flush", run_dir, "--scratch", scratch)
        assert code == 2 and out == ""
        assert_one_error_line(err, f"--scratch {scratch}", f"PATH {run_dir}", "itself")
    assert cryosnap.Run(run_dir).steps() == [1]


def test_export_of_a_pickled_leaf_needs_allow_pickle(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run_dir, out = tmp_path / "pk", tmp_path / "pk.pt"
    cryosnap.save(run_dir, {"a": Fraction(1, 3), "n": 1}, step=1, allow_pickle=True)
    code, _, err = cli(capsys, "export", run_dir, out)
    assert code == 2 and not out.exists()
    assert_one_error_line(err, "leaf a is pickled", "--allow-pickle")
    assert "allow_pickle=True" not in err  # the command line has no such argument
    code, _, err = cli(capsys, "export", run_dir, out, "--allow-pickle")
    assert code == 0, err
    assert torch.load(out, weights_only=False) == {"a": Fraction(1, 3), "n": 1}
    code, out_text, _ = cli(capsys, "export", "--help")
    assert "--allow-pickle" in out_text and "runs code" in " ".join(out_text.split())


# ---------------------------------------------------------------------------------------------
# a live writer's retention; a damaged commit record


def test_verify_of_a_version_retired_while_verified_is_no_damage(
    capsys: pytest.CaptureFixture[str], run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer (keep=1) retires a version while its part is verified: said, exit 0."""
    real = engine.verify_part

    def retire_while_verified(doomed: int) -> Any:
        plan = engine.plan_retire(LocalStore(run), drop=[doomed])

        def verify_part(store: Any, step: int, **kwargs: Any) -> None:
            if step == doomed and (run / "versions" / f"{step:012d}" / "COMMIT.json").exists():
                engine.apply_retire(LocalStore(run), plan)  # its commit record, then its files
            real(store, step, **kwargs)

        return verify_part

    monkeypatch.setattr(engine, "verify_part", retire_while_verified(1))
    code, out, err = cli(capsys, "verify", run)
    assert (code, err) == (0, "")
    rows = out.splitlines()
    assert rows[1].split()[:2] == ["1", "RETIRED"] and "retired while verified" in rows[1]
    assert "DAMAGED" not in out and "missing" not in out
    assert rows[-1] == "1 version OK; 1 retired while verified"
    monkeypatch.setattr(engine, "verify_part", retire_while_verified(2))
    code, out, _ = cli(capsys, "verify", run, "--step", "2", "--json")
    (check,) = json.loads(out)["versions"]
    assert code == 0 and check["retired"] is True and check["ok"] is True


def _damage_commit_record(run: Path, step: int) -> None:
    (run / "versions" / f"{step:012d}" / "COMMIT.json").write_bytes(b'{"step": ')


def test_ls_with_a_damaged_commit_record_shows_the_others_sizes(
    capsys: pytest.CaptureFixture[str], run: Path
) -> None:
    owned = sum(p.stat().st_size for p in (run / "data").glob(f"{1:012d}-*"))
    assert owned > 0
    _damage_commit_record(run, 2)
    code, out, err = cli(capsys, "ls", run, "--json")
    assert (code, err) == (0, "")
    first, second = json.loads(out)["versions"]
    assert first["damaged"] is False and first["owned_bytes"] == owned
    assert second["damaged"] is True and "COMMIT.json" in second["error"]
    code, out, _ = cli(capsys, "ls", run)
    rows = out.splitlines()[1:]
    assert rows[0].split()[0] == "1" and human_bytes(owned) in rows[0]
    assert rows[1].split()[:2] == ["2", "DAMAGED:"]


def test_inspect_and_export_skip_a_damaged_newest_commit_record(
    capsys: pytest.CaptureFixture[str], run: Path, tmp_path: Path
) -> None:
    """As cryosnap.load() does: the newest version whose commit record reads, and a note on
    stderr naming the damaged step."""
    _damage_commit_record(run, 2)
    code, out, err = cli(capsys, "inspect", run, "--json")
    assert code == 0 and json.loads(out)["step"] == 1
    assert "skipping damaged step 2" in err and "using step 1" in err
    npz = tmp_path / "x.npz"
    code, out, err = cli(capsys, "export", run, npz, "--json")
    assert code == 0 and json.loads(out)["step"] == 1
    assert "skipping damaged step 2" in err and "using step 1" in err
    assert np.load(npz)["arr"].tolist() == np.arange(5.0).tolist()
    code, _, err = cli(capsys, "inspect", run, "--step", "2")  # asked for: the damage is said
    assert code == 2 and "COMMIT.json" in err


COMMANDS = ["ls", "inspect", "verify", "export", "diff", "gc", "rm", "flush", "demo", "plan"]


@pytest.mark.parametrize("command", [[], *([c] for c in [*COMMANDS, "bench", "import-dcp"])])
def test_help_shows_flags_without_a_type(
    capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    code, out, _ = cli(capsys, *command, "--help")
    assert code == 0
    assert "<bool>" not in out and "BOOLEAN" not in out, out
    flags = [line for line in out.splitlines() if "--help" in line]
    assert flags and "bool" not in flags[0].lower()


@pytest.mark.parametrize(
    ("typed", "meant"),
    [("remove", "rm"), ("delete", "rm"), ("remov", "rm"), ("clean", "gc"), ("list", "ls")],
)
def test_an_unknown_command_suggests_the_one_meant(
    capsys: pytest.CaptureFixture[str], typed: str, meant: str
) -> None:
    code, _, err = cli(capsys, typed, "runs/x")
    assert code == 2
    assert_one_error_line(err, f"No such command '{typed}'", f"Did you mean '{meant}'?")
    assert "demo" not in err and "plan" not in err
