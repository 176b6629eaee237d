"""Checkpointer(codec=): the flush stores the persistent level's data files coded, readers get
the plain bytes back, incremental versions still de-duplicate, damage is found, "auto" codes
only where the level is slow, and a reader that cannot read codecs refuses by version."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import cryosnap
from cryosnap._format import manifest as manifest_format
from cryosnap._run.levels.codec import LevelCodec, pays
from cryosnap.errors import CheckpointFormatError, IntegrityError, MissingDependencyError
from cryosnap.storage import BlobWriter, LocalStore, Store, WrapperStore, read_index
from cryosnap.storage import _codec as store_codec
from cryosnap.storage.base import BytesLike

from ..support import assert_same, state_trees

CHUNK = 4096


def _manifest(run: Path, step: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((run / f"versions/{step:012d}/rank-00000.json").read_bytes())
    return doc


def _coded_files(run: Path, step: int) -> list[str]:
    doc = _manifest(run, step)
    return [doc["data_files"][i] for i in doc.get("coded", [])]


def _floats(seed: int, n: int) -> np.ndarray:
    """float32 of a few significant bits: about 1.2x with byte shuffle + zstd."""
    return (np.random.default_rng(seed).standard_normal(n) * 1e-3).astype(np.float32)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=state_trees())
def test_round_trip_from_a_coded_persistent_level(state: Any) -> None:
    tree = {"tree": state, "floats": _floats(0, 3000), "zeros": np.zeros(2000, np.float64)}
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        mp.setattr(store_codec, "FRAME_BYTES", 5000)  # frames across chunks and blobs
        with cryosnap.Checkpointer(
            f"{d}/run", scratch=f"{d}/scratch", chunk_bytes=CHUNK, codec="zstd", allow_pickle=True
        ) as ckpt:
            ckpt.save(3, tree).result()
        shutil.rmtree(f"{d}/scratch")
        run = Path(d, "run")
        doc = _manifest(run, 3)
        assert doc["format_version"] == 8 and doc["codec"] == "shuffle-zstd"
        coded = _coded_files(run, 3)
        assert coded and set(coded) == set(doc["data_files"])
        for key in coded:  # what is on disk is frames, fewer bytes than the plain ones
            assert read_index(LocalStore(run), key).stored_size == (run / key).stat().st_size
        assert_same(tree, cryosnap.load(f"{d}/run", step=3, allow_pickle=True))
        assert cryosnap.Run(f"{d}/run").verify().ok


def _two_versions(tmp_path: Path, **options: Any) -> tuple[Path, dict[str, Any]]:
    state: dict[str, Any] = {"w": _floats(1, 256 * 1024), "step": 1}
    with cryosnap.Checkpointer(
        tmp_path / "run", scratch=tmp_path / "scratch", chunk_bytes=CHUNK, **options
    ) as ckpt:
        ckpt.save(1, state).result()
        state["w"][:10] += 1.0  # one chunk of 256 changes
        state["step"] = 2
        info = ckpt.save(2, state).result()
        assert info.incremental and info.written_bytes == CHUNK
    return tmp_path / "run", state


def test_incremental_versions_still_deduplicate(tmp_path: Path) -> None:
    run, state = _two_versions(tmp_path, codec="zstd")
    (first,), (own,) = _coded_files(run, 1), _coded_files(run, 2)
    # Version 2 inherits the unchanged chunks from version 1 (whose manifest names its coded
    # file); its own file holds the changed chunk only (plus the small leaves' pack).
    assert _manifest(run, 2)["base"]["step"] == 1 and own != first
    assert read_index(LocalStore(run), own).plain_size <= 2 * CHUNK
    shutil.rmtree(tmp_path / "scratch")
    assert_same(state, cryosnap.load(run, step=2))
    assert cryosnap.load(run, step=1)["step"] == 1


def test_a_codec_off_run_keeps_what_is_coded(tmp_path: Path) -> None:
    run, state = _two_versions(tmp_path, codec="zstd")
    with cryosnap.Checkpointer(run, scratch=tmp_path / "scratch", chunk_bytes=CHUNK) as ckpt:
        assert ckpt.restore(step=2)["step"] == 2
        state["w"][5000:5010] -= 1.0
        ckpt.save(3, state).result()
    # Version 3's own file is plain; it resolves through versions 2 and 1, still coded.
    assert not _coded_files(run, 3) and _manifest(run, 3)["base"]["step"] == 2
    assert _coded_files(run, 2) and _coded_files(run, 1)
    shutil.rmtree(tmp_path / "scratch")
    assert_same(state, cryosnap.load(run, step=3))
    assert cryosnap.Run(run).verify().ok


def test_verify_finds_damage_in_coded_bytes(tmp_path: Path) -> None:
    run, _ = _two_versions(tmp_path, codec="zstd")
    shutil.rmtree(tmp_path / "scratch")
    (key,) = _coded_files(run, 1)
    raw = bytearray((run / key).read_bytes())
    raw[len(raw) // 3] ^= 0x01
    (run / key).write_bytes(bytes(raw))
    report = cryosnap.Run(run).verify()
    assert not report.ok
    assert {v.step for v in report.versions if v.damage} == {1, 2}
    with pytest.raises(IntegrityError, match=key.split("/")[1]):
        cryosnap.load(run, step=1)


def test_a_reader_without_codecs_refuses_by_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, _ = _two_versions(tmp_path, codec="zstd")
    shutil.rmtree(tmp_path / "scratch")
    # What a cryosnap from before codecs reads: manifest versions 1 to 6.
    monkeypatch.setattr(manifest_format, "_MANIFEST_VERSIONS", tuple(range(1, 7)))
    with pytest.raises(CheckpointFormatError, match="format_version 8 is not supported"):
        cryosnap.load(run, step=2)


def test_a_reader_without_zstandard_is_told_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, _ = _two_versions(tmp_path, codec="zstd")
    shutil.rmtree(tmp_path / "scratch")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'cryosnap\[zstd\]'"):
        cryosnap.load(run, step=2)


def test_bad_codec_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="codec='lz4' is invalid"):
        cryosnap.Checkpointer(tmp_path / "a", scratch=tmp_path / "s", codec="lz4")
    with pytest.raises(ValueError, match="with memory= needs scratch="):
        cryosnap.Checkpointer(tmp_path / "a", codec="zstd", memory="1GiB")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(MissingDependencyError, match=r"cryosnap\[zstd\]"):
        cryosnap.Checkpointer(tmp_path / "a", scratch=tmp_path / "s", codec="auto")
    assert not (tmp_path / "a").exists()


def test_codec_from_config(tmp_path: Path) -> None:
    config = {"path": str(tmp_path / "run"), "scratch": str(tmp_path / "s"), "codec": "zstd"}
    with cryosnap.Checkpointer.from_config(config, chunk_bytes=CHUNK) as ckpt:
        ckpt.save(1, {"w": _floats(2, 4096)}).result()
    assert _coded_files(tmp_path / "run", 1)


# -- "auto" ----------------------------------------------------------------------------------


class _SlowWriter:
    def __init__(self, inner: BlobWriter, bytes_per_s: float) -> None:
        self.key = inner.key
        self._inner = inner
        self._rate = bytes_per_s

    def write(self, buffers: Sequence[BytesLike]) -> None:
        self._inner.write(buffers)
        time.sleep(sum(memoryview(b).nbytes for b in buffers) / self._rate)

    def tell(self) -> int:
        return self._inner.tell()

    def commit(self) -> None:
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class ThrottledStore(WrapperStore):
    """A level whose large writes go at ``bytes_per_s`` (a slow link)."""

    def __init__(self, inner: Store, bytes_per_s: float) -> None:
        super().__init__(inner)
        self.bytes_per_s = bytes_per_s

    def open_writer(self, key: str) -> BlobWriter:
        return _SlowWriter(self.inner.open_writer(key), self.bytes_per_s)


def _auto_run(path: str | Store, scratch: Path, n: int = 256 * 1024) -> LevelCodec:
    state = {"w": _floats(3, n)}
    with cryosnap.Checkpointer(path, scratch=scratch, codec="auto", incremental=False) as ckpt:
        for step in (1, 2, 3):
            state["w"] = _floats(step, n)
            ckpt.save(step, state).result()
        codec = ckpt._levels.levels[-1].codec
        assert codec is not None
        return codec


def test_auto_leaves_a_fast_level_plain(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as d:
        # 16 MiB a version: a write of a few milliseconds, which a loaded machine's scheduling
        # cannot slow to below the codec's gain (a 1 MiB write once measured slower than it).
        codec = _auto_run(f"{d}/run", tmp_path / "scratch", 4 << 20)
        rates = codec.snapshot()
        assert (rates.coded_files, rates.plain_files) == (0, 3)
        assert not any(_coded_files(Path(d, "run"), s) for s in (1, 2, 3))


def test_auto_codes_for_a_slow_level(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    slow = ThrottledStore(LocalStore(tmp_path / "run"), 2e6)  # 2 MB/s
    codec = _auto_run(slow, tmp_path / "scratch")
    rates = codec.snapshot()
    # The first version is written plain while the level's rate is measured and the codec
    # calibrated on its chunks; the next ones are coded.
    assert (rates.coded_files, rates.plain_files) == (2, 1)
    assert [bool(_coded_files(tmp_path / "run", s)) for s in (1, 2, 3)] == [False, True, True]
    assert rates.ratio is not None and rates.ratio > 1.05
    shutil.rmtree(tmp_path / "scratch")
    np.testing.assert_array_equal(cryosnap.load(tmp_path / "run")["w"], _floats(3, 256 * 1024))


def test_pays() -> None:
    assert pays(10e6, 500e6, 1.2)  # 10 MB/s link, codec 500 MB/s saving 1/6: yes
    assert not pays(200e6, 500e6, 1.2)  # 200 MB/s > 500 * (1 - 1/1.2) = 83 MB/s
    assert not pays(1e3, 500e6, 1.0)  # nothing saved: never


def test_the_readers_of_a_run_read_coded_files(tmp_path: Path) -> None:
    """diff, history, a selective load and export go through the same decoded reads."""
    from cryosnap.export import export

    run, state = _two_versions(tmp_path, codec="zstd")
    shutil.rmtree(tmp_path / "scratch")
    reader = cryosnap.Run(run)
    diff = reader.diff(1, 2)
    assert {c.path for c in diff.leaves} == {"w", "step"} and diff.changed_bytes >= CHUNK
    values = dict(reader.history("w"))
    assert sorted(values) == [1, 2]
    np.testing.assert_array_equal(values[2], state["w"])
    assert not np.array_equal(values[1], state["w"])
    assert cryosnap.load(run, step=2, keys=["w"])["w"].tobytes() == state["w"].tobytes()
    export(run, tmp_path / "out.npz", step=2)
    with np.load(tmp_path / "out.npz") as npz:
        np.testing.assert_array_equal(npz["w"], state["w"])


def test_a_mark_given_before_the_flush_is_bound_to_the_coded_record(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    slow = ThrottledStore(LocalStore(tmp_path / "run"), 1e6)  # the flush takes about 1 s
    with cryosnap.Checkpointer(slow, scratch=tmp_path / "scratch", codec="zstd") as ckpt:
        pending = ckpt.save(1, {"w": _floats(4, 256 * 1024)})
        pending.result(tier="scratch")
        ckpt.mark(1, "eval_ok")  # on scratch only: the flush copies it
        pending.result()
    assert _coded_files(tmp_path / "run", 1)
    shutil.rmtree(tmp_path / "scratch")
    assert "eval_ok" in cryosnap.Run(tmp_path / "run").marks(1)


# The last commit before codecs: its cryosnap reads manifest versions 1 to 6.
_BEFORE_CODECS = "799bd3f"


def load_with_cryosnap_before_codecs(
    tmp_path: Path, run: Path, step: int
) -> subprocess.CompletedProcess[str]:
    """Load ``step`` of ``run`` in a subprocess with the real cryosnap of :data:`_BEFORE_CODECS`
    (from git: the test is skipped without git or that commit); its outcome."""
    repo = Path(__file__).resolve().parents[3]
    git = shutil.which("git")
    if (
        git is None
        or subprocess.run(
            [git, "-C", str(repo), "cat-file", "-e", f"{_BEFORE_CODECS}^{{commit}}"],
            capture_output=True,
        ).returncode
    ):
        pytest.skip(f"git or commit {_BEFORE_CODECS} not available")
    old = tmp_path / "old"
    old.mkdir()
    archive = subprocess.run(
        [git, "-C", str(repo), "archive", _BEFORE_CODECS, "src/cryosnap"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    code = f"import cryosnap; cryosnap.load({str(run)!r}, step={step})"
    env = {**os.environ, "PYTHONPATH": str(old / "src")}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=100
    )
    assert str(old / "src") in proc.stderr  # it was that cryosnap that ran
    return proc


@pytest.mark.timeout(120)
def test_a_cryosnap_from_before_codecs_refuses_by_version(tmp_path: Path) -> None:
    """The real thing: that commit's cryosnap, from git, loads a coded run in a subprocess."""
    run, _ = _two_versions(tmp_path, codec="zstd")
    shutil.rmtree(tmp_path / "scratch")
    proc = load_with_cryosnap_before_codecs(tmp_path, run, 2)
    assert proc.returncode != 0
    assert "format_version 8 is not supported by this cryosnap" in proc.stderr


def test_a_fork_of_a_coded_run_reads_its_coded_files(tmp_path: Path) -> None:
    run, state = _two_versions(tmp_path, codec="zstd")
    shutil.rmtree(tmp_path / "scratch")
    fork = cryosnap.Run(run).fork(2, tmp_path / "fork")
    assert_same(state, fork.load(step=2))
    assert fork.verify().ok
