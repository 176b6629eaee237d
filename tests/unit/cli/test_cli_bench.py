"""``cryosnap bench``: every workload end to end on a tiny state, the JSON, the table, the plot,
usage errors, and the temporary files gone afterwards (also after Ctrl-C).

In process through ``cryosnap.cli.main(argv)`` (torch is imported once for the whole file); the
usage errors also as a user types them, ``python -m cryosnap bench ...``. No test asserts a
timing or a ratio of timings: the figures of a 4 MiB state on a shared machine are noise. The
machine-wide page cache is never dropped here (``drop_page_cache`` stubbed); the cold reads
drop only each peer's own files.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from cryosnap import bench as benchmark
from cryosnap.bench import _peers, _probes, _save_load, _training
from cryosnap.bench import _torch_checkpointing as tc
from cryosnap.bench._probes import MemoryMeter
from cryosnap.bench._result import PeerFigures
from cryosnap.bench._workloads import dense_shapes
from cryosnap.cli import main

TINY = ["--size", "4MiB", "--repeat", "1", "--warmup", "0"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def expected_peers() -> set[str]:
    """Every peer that imports here, and the two limits."""
    keys = {"memcpy", "raw", "torch", "cryosnap_eager", "cryosnap_lazy"}
    if importlib.util.find_spec("safetensors") is not None:
        keys.add("safetensors")
    if _peers.dcp_available():
        keys |= {"dcp", "dcp_async"}
    if importlib.util.find_spec("torchsnapshot") is not None:
        keys.add("torchsnapshot")
    if tc.unavailable() is None:
        keys.add(tc.KEY)
    return keys


@pytest.fixture(autouse=True)
def no_real_drop(monkeypatch: pytest.MonkeyPatch) -> None:
    # As root, the real drop would empty the page cache of the whole (shared) machine.
    monkeypatch.setattr(_probes, "drop_page_cache", lambda: True)


def bench(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str
) -> tuple[dict[str, Any], str]:
    """Run ``cryosnap bench ARGS --dir D --json F``; return (the JSON, stdout); D is left empty."""
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "bench.json"
    code = main(["bench", *args, "--dir", str(work), "--json", str(out)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert list(work.iterdir()) == [], "the run's temporary folder was not removed"
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("cryosnap bench ")
    assert {"cpus", "platform", "python", "torch"} <= set(doc["machine"])
    assert doc["date"] and doc["machine"]["cpus"] >= 1
    assert f"wrote {out}" in stdout
    return doc, stdout


def peers_of(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["key"]: p for p in doc["peers"]}


def table_lines(stdout: str) -> list[str]:
    """The lines of the tables: from the first header to the first line after a blank one
    that starts no table."""
    lines = stdout.splitlines()
    out: list[str] = []
    for i, line in enumerate(lines[3:], 3):
        if not line and i + 1 < len(lines) and not lines[i + 1].startswith(("peer", "method")):
            break
        out.append(line)
    return out


def check_save_load(
    doc: dict[str, Any],
    stdout: str,
    *,
    incremental: bool,
    extra: frozenset[str] = frozenset(),
    wide: bool = False,
) -> None:
    peers = peers_of(doc)
    rows = table_lines(stdout)
    dense = {"cryosnap", "cryosnap_eager_buffered", "raw_direct"}
    assert set(peers) == expected_peers() | (dense if not incremental else set()) | extra
    state_bytes = doc["state"]["bytes"]
    # The dense reference saves the run's bytes as 16 equal tensors: its own state, a few
    # bytes short of a many-small state's (4 MiB, not 4,196,864 here).
    dense_bytes = sum(4 * math.prod(shape) for _name, shape in dense_shapes(state_bytes))
    for key, peer in peers.items():
        assert peer["error"] is None, (key, peer["error"])
        name = peer["label"] if wide else key
        assert any(row.startswith(f"{name}  ") for row in rows), f"{key} has no row in the table"
        medians = peer["medians"]
        assert medians["stall_seconds"] > 0
        if key == "memcpy":
            continue
        assert medians["durable_seconds"] > 0
        assert medians["durable_seconds"] >= medians["stall_seconds"]
        assert medians["cpu_seconds"] >= 0
        if incremental and key.startswith("cryosnap"):
            assert 0 < medians["written_bytes"] < state_bytes / 2  # 1 chunk of 16
        else:
            saved = dense_bytes if key == "cryosnap_eager_dense" else state_bytes
            assert medians["written_bytes"] >= saved, key
        restores = [m for m in ("restore_seconds", "restore_into_seconds") if m in medians]
        if key not in ("dcp_async", "cryosnap_lazy"):
            assert restores, f"{key} measured no restore"
        for metric in restores:
            assert medians[metric] > 0
    for metric in ("memcpy_seconds", "write_fsync_seconds", "read_warm_seconds"):
        assert doc["limits"][metric] > 0
    assert peers["cryosnap_eager"]["medians"]["restore_into_seconds"] > 0
    header = stdout.splitlines()[3].split()
    assert header[:3] == ["peer", "stall", "durable"]
    if wide:
        assert "peak mem save/restore/into" in rows[0]
    else:  # two tables, saving and restoring, within 100 columns
        assert max(len(row) for row in rows) <= 100, "\n".join(rows)
        assert sum(row.split()[:2] == ["peer", "restore"] for row in rows) == 1, rows
        assert "--wide: one table" in stdout


def test_dense_json_table_cold_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "dense.png"
    doc, stdout = bench(capsys, tmp_path, *TINY, "--plot", str(png))
    assert doc["config"]["workload"] == "dense" and doc["state"]["tensors"] == 16
    assert doc["state"]["bytes"] == 4 << 20
    check_save_load(doc, stdout, incremental=False)
    # Each peer's own files are dropped from the page cache (fsync + POSIX_FADV_DONTNEED)
    # before its cold reads; a memory file system keeps them, and says so.
    if doc["cold"].startswith("not measured"):
        pytest.skip(f"cold reads: {doc['cold']}")
    assert doc["cold"].startswith("before each cold read")
    assert doc["limits"]["read_cold_seconds"] > 0 and doc["limits"]["direct_read_seconds"] > 0
    cryosnap_medians = peers_of(doc)["cryosnap"]["medians"]
    assert cryosnap_medians["restore_cold_seconds"] > 0
    assert cryosnap_medians["restore_cold_fresh_seconds"] > 0
    assert "restore_cold_seconds" in peers_of(doc)["cryosnap"]["ratios"]  # x the direct read
    assert "restore cold" in stdout and "cold fresh" in stdout
    # Every reader, the peers as well as cryosnap, is read cold too, after mincore found at
    # most a tenth of its pages still cached (one check per cold read: 2 with fresh and into=).
    for key, peer in peers_of(doc).items():
        reads = sum(
            m in peer["samples"] for m in ("restore_cold_seconds", "restore_cold_fresh_seconds")
        )
        warm = sum(m in peer["samples"] for m in ("restore_seconds", "restore_into_seconds"))
        assert reads == warm, key  # raw_direct: its read is cold whatever the cache
        if not reads:
            continue
        pages, cached = peer["samples"]["cold_pages"], peer["samples"]["cold_cached_pages"]
        assert len(pages) == len(cached) == reads, key
        assert all(p * 4096 >= doc["state"]["bytes"] for p in pages), key
        assert all(c <= p // 10 for c, p in zip(cached, pages, strict=True)), key
    (checked,) = [n for n in doc["notes"] if n.startswith("cold reads checked with mincore")]
    assert "torch," in checked and "cryosnap," in checked
    assert doc["memory_method"]
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    assert f"wrote {png}" in stdout


def test_many_small(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc, stdout = bench(capsys, tmp_path, *TINY, "--workload", "many-small", "--tensors", "100")
    assert 80 <= doc["state"]["tensors"] <= 100
    # The same bytes dense, saved and restored in the same rounds: the per-byte reference.
    check_save_load(doc, stdout, incremental=False, extra=frozenset({"cryosnap_eager_dense"}))
    (note,) = [n for n in doc["notes"] if n.startswith("many small tensors per byte")]
    for what in ("stall", "durable", "restore into", "fresh restore"):
        assert f"{what} " in note and re.search(rf"{what} \d+\.\d\dx", note), note


def test_sparse_saves_incrementally(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    doc, stdout = bench(capsys, tmp_path, *TINY, "--workload", "sparse", "--no-cold", "--wide")
    check_save_load(doc, stdout, incremental=True, wide=True)
    assert "--wide" not in stdout
    assert doc["cold"] == "not measured (--no-cold)"
    assert "cold: not measured (--no-cold)" in stdout


def test_training(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "training.png"
    doc, stdout = bench(
        capsys, tmp_path, "--workload", "training", "--size", "2MiB", "--repeat", "1",
        "--steps", "1", "--step-seconds", "0.01", "--plot", str(png),
    )  # fmt: skip
    methods = {(m["key"], m["every"]): m for m in doc["training"]["methods"]}
    keys = {"none", "cryosnap_eager", "cryosnap_lazy", "torch"}
    if _peers.dcp_available():
        keys.add("dcp_async")
    if tc.unavailable() is None:
        keys.add(tc.KEY)
    assert set(methods) == {(k, every) for k in keys for every in (1, 10)}
    for (key, _every), m in methods.items():
        assert m["error"] is None, (key, m["error"])
        assert m["samples"]["step_seconds"] and min(m["samples"]["step_seconds"]) > 0
        assert m["label"] in stdout
        if key != "none":
            assert m["saves"] == 1
            assert m["medians"]["written_bytes"] > 0
            assert m["overhead_percent"] is not None
    assert stdout.splitlines()[3].split()[:2] == ["method", "every"]
    assert png.read_bytes().startswith(PNG_SIGNATURE)


def test_ctrl_c_removes_the_temporary_folder(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(self: object, work: Path, state: object) -> None:
        assert any(work.parent.parent.iterdir())  # the run's folder exists while it runs
        raise KeyboardInterrupt

    monkeypatch.setattr(_peers.TorchSavePeer, "save", interrupted)
    code = main(["bench", *TINY, "--dir", str(tmp_path), "--no-cold"])
    assert code == 130
    assert list(tmp_path.iterdir()) == []
    assert "Traceback" not in capsys.readouterr().err


def test_ctrl_c_wrapped_by_a_peer_still_stops_the_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DCP catches the KeyboardInterrupt of a Ctrl-C and raises its own exception instead.
    def wrapping(self: object, work: Path, state: object) -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the signal arrives before this ends
        except BaseException as exc:
            raise RuntimeError(f"wrapped: {exc!r}") from exc

    monkeypatch.setattr(_peers.TorchSavePeer, "save", wrapping)
    started = time.monotonic()
    code = main(["bench", *TINY, "--dir", str(tmp_path), "--no-cold"])
    assert code == 130
    assert time.monotonic() - started < 60
    assert list(tmp_path.iterdir()) == []
    assert "Traceback" not in capsys.readouterr().err


# ------------------------------------------------------------------------------ usage errors


def one_error_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("cryosnap: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_shell_bad_size_exits_2_with_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cryosnap", "bench", "--size", "1XB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    one_error_line(proc.stderr, "--size", "'1XB'", "not a size")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--workload", "huge"], ["--workload", "'huge'", "dense, many-small, sparse, training"]),
        (["--size", "12"], ["--size", "smallest"]),
        (["--size", "GiB"], ["--size", "not a size"]),
        (["--repeat", "0"], ["--repeat", ">= 1"]),
        (["--repeat", "two"], ["--repeat"]),
        (["--dir", "/nonexistent/bench"], ["--dir", "not an existing directory"]),
        (["--json", "/nonexistent/out.json"], ["--json", "no such directory"]),
        (["--plot", "chart.nope"], ["--plot", "unknown image format"]),
    ],
)
def test_bad_arguments_exit_2_before_measuring(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    fragments: list[str],
) -> None:
    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a bad argument must be refused before the benchmark runs")

    monkeypatch.setattr(benchmark, "run", never)
    code = main(["bench", *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    one_error_line(err, *fragments)


def test_plot_without_matplotlib_says_how_to_install(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    assert main(["bench", "--plot", "out.png"]) == 2
    one_error_line(capsys.readouterr().err, "--plot needs matplotlib (pip install cryosnap[demo])")


def test_parse_size() -> None:
    assert benchmark.parse_size("1GiB") == 1 << 30
    assert benchmark.parse_size("512MiB") == 512 << 20
    assert benchmark.parse_size("300MB") == 300 * 10**6
    assert benchmark.parse_size("4M") == 4 << 20
    assert benchmark.parse_size("1.5gib") == 3 << 29
    assert benchmark.parse_size("2097152") == 2 << 20
    for bad in ("1XB", "", "-1GiB", "1 G B", "GiB"):
        with pytest.raises(benchmark.BenchError, match="not a size"):
            benchmark.parse_size(bad)


def test_a_folder_is_dropped_from_the_page_cache(direct_dir: Path) -> None:
    """The cold reads' drop: fsync, POSIX_FADV_DONTNEED, and what mincore says is left."""
    from cryosnap import _native

    (direct_dir / "sub").mkdir()
    for name in ("a.bin", "sub/b.bin"):
        with open(direct_dir / name, "wb") as f:  # buffered: the page cache holds it
            f.write(os.urandom(1 << 20))
    (direct_dir / "empty").write_bytes(b"")
    fd = os.open(direct_dir / "a.bin", os.O_RDONLY)
    try:
        counts = _native.cached_pages(fd, 1 << 20)
    finally:
        os.close(fd)
    if counts is None or counts[0] < counts[1] // 2:
        pytest.skip("mincore is not available here, or the file was not cached")
    counts = _probes.drop_file_cache(direct_dir)
    assert counts is not None and counts[1] == 2 * (1 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert counts[0] <= counts[1] // 10


def test_an_absent_peer_is_skipped_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_checkpointing is optional: where it does not import, no peer and no saver, and the
    reason in ``missing`` (the run's notes say "not measured (...)")."""
    why = f"not installed; pip install --no-deps torch_checkpointing=={tc.VERSION}"
    monkeypatch.setattr(tc, "unavailable", lambda: why)
    import torch

    into = {"x": torch.zeros(4)}
    peers, missing = _peers.make_peers("dense", into)
    assert tc.KEY not in {p.key for p in peers}
    assert missing[tc.KEY] == why
    training_missing: dict[str, str] = {}
    savers = _training._savers(training_missing)
    assert tc.KEY not in {s.key for s in savers}
    assert training_missing[tc.KEY] == why


def test_a_missing_module_is_reported_as_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_checkpointing", None)  # import raises ImportError
    assert tc.unavailable() == (
        f"not installed; pip install --no-deps torch_checkpointing=={tc.VERSION}"
    )


def _cold_counts(direct_dir: Path, peer: _peers.Peer) -> tuple[PeerFigures, str | None]:
    """Save with ``peer`` into ``direct_dir`` (durable), then its cold reads."""
    import torch

    state = {f"t{i}": torch.arange(i, i + (1 << 18), dtype=torch.float32) for i in range(4)}
    into = {k: torch.zeros_like(t) for k, t in state.items()}
    work = direct_dir / "work"
    work.mkdir()
    peer.setup(direct_dir, state)
    try:
        finish = peer.save(work, state)
        if finish is not None:
            finish()
        fig = PeerFigures(peer.key, peer.label, peer.limit)
        why = _save_load._time_cold(peer, fig, work, into, MemoryMeter())
        if why is None and peer.restores_into:
            assert all(torch.equal(into[k], state[k]) for k in state)
    finally:
        peer.close()
    return fig, why


def test_torch_save_read_cold_after_mincore_says_evicted(direct_dir: Path) -> None:
    fig, why = _cold_counts(direct_dir, _peers.TorchSavePeer())
    assert why is None
    assert len(fig.samples["restore_cold_seconds"]) == 1
    (pages,), (cached,) = fig.samples["cold_pages"], fig.samples["cold_cached_pages"]
    assert pages * 4096 >= 4 << 20 and cached <= pages // 10


def test_cold_reads_without_posix_fadvise_say_why(
    direct_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(os, "posix_fadvise")
    fig, why = _cold_counts(direct_dir, _peers.TorchSavePeer())
    assert why is not None and "no posix_fadvise" in why
    assert "restore_cold_seconds" not in fig.samples and "cold_pages" not in fig.samples


@pytest.mark.skipif(tc.unavailable() is not None, reason=f"torch_checkpointing: {tc.unavailable()}")
@pytest.mark.timeout(180)
def test_torch_checkpointing_saves_durably_and_reads_cold(direct_dir: Path) -> None:
    """The real peer: an async save staged and written (fsync'd by the bench), its files
    evicted (mincore) before a cold load into the tensors and a cold fresh load."""
    peer = tc.TorchCheckpointingPeer()
    fig, why = _cold_counts(direct_dir, peer)
    assert why is None
    assert set(fig.samples) >= {"restore_cold_seconds", "restore_cold_fresh_seconds"}
    pages, cached = fig.samples["cold_pages"], fig.samples["cold_cached_pages"]
    assert len(pages) == 2
    assert all(p * 4096 >= 4 << 20 and c <= p // 10 for c, p in zip(cached, pages, strict=True))
    files = list((direct_dir / "work" / "tc").rglob("*"))
    assert sum(f.stat().st_size for f in files if f.is_file()) >= 4 << 20


# -- the scale workload ------------------------------------------------------------------------

SCALE_KEYS = {
    "ranks",
    "max_sent_bytes_per_rank",
    "max_received_bytes_per_rank",
    "rounds",
    "leader_seconds",
    "restore_read_bytes_per_rank",
    "metadata_bytes_per_rank",
}


def test_scale_prints_the_json_alone(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        main(["bench", "--workload", "scale", "--ranks", "2,8", "--dir", str(tmp_path), "--json"])
        == 0
    )
    out, err = capsys.readouterr()
    rows = json.loads(out)["scale"]
    assert [row["ranks"] for row in rows] == [2, 8]
    for row in rows:
        assert set(row) >= SCALE_KEYS
        assert row["rounds"] > 0 and row["max_sent_bytes_per_rank"] > 0
        assert row["restore_read_bytes_per_rank"] > 0 and row["metadata_bytes_per_rank"] > 0
    # 8 ranks: each receives the other 7's contributions, more than 2 ranks' one
    assert rows[1]["max_received_bytes_per_rank"] > rows[0]["max_received_bytes_per_rank"]
    assert "8 ranks: restore" in err
    assert list(tmp_path.iterdir()) == []


def test_scale_table_and_json_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_file = tmp_path / "scale.json"
    assert main(["bench", "--workload", "scale", "--ranks", "3", "--json", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^ +3 +\d+ B", out, re.MULTILINE), out
    assert f"wrote {out_file}" in out
    assert [row["ranks"] for row in json.loads(out_file.read_text())["scale"]] == [3]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--workload", "scale", "--ranks", "64,x"], ["--ranks", "'x' is not a world size"]),
        (["--workload", "scale", "--ranks", "0"], ["--ranks", "'0' is not a world size"]),
        (
            ["--workload", "scale", "--size", "4MiB"],
            ["--size", "does not apply to --workload scale"],
        ),
        (
            ["--workload", "scale", "--dir", "/nonexistent/x"],
            ["--dir", "not an existing directory"],
        ),
        (["--ranks", "64"], ["--ranks applies to --workload scale only"]),
        (["--json"], ["--json needs a FILE except with --workload scale"]),
    ],
)
def test_scale_bad_arguments_exit_2_before_measuring(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    args: list[str],
    fragments: list[str],
) -> None:
    from cryosnap.bench import _scale

    def never(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a bad argument must be refused before the benchmark runs")

    monkeypatch.setattr(_scale, "measure_scale", never)
    monkeypatch.setattr(benchmark, "run", never)
    assert main(["bench", *args]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    one_error_line(err, *fragments)


def test_measure_rates_measures_and_leaves_nothing(tmp_path: Path) -> None:
    rates = benchmark.measure_rates(tmp_path, nbytes=4 << 20)
    assert rates.memcpy_bytes_per_second > 0 and rates.hash_bytes_per_second > 0
    assert rates.write_bytes_per_second > 0 and rates.read_bytes_per_second > 0
    assert rates.latency_seconds > 0 and rates.folder == str(tmp_path)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(benchmark.BenchError, match="not a folder"):
        benchmark.measure_rates(tmp_path / "f", nbytes=4 << 20)
