"""cryosnap.dcp in one process (DCP's ``no_dist`` path): the step rule, the metadata schema and
its validation, staging for ``dcp.async_save``, integrity on load, ``import-dcp`` and ``export``.

The multi-rank behaviour (global commit, DTensor resharding) is in
tests/integration/test_dcp_dist.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.planner import LoadPlan  # noqa: E402

import cryosnap  # noqa: E402
import cryosnap.dcp  # noqa: E402
from cryosnap import engine  # noqa: E402
from cryosnap.cli import main as cli  # noqa: E402
from cryosnap.dcp._parts import part_state  # noqa: E402
from cryosnap.storage import open_store  # noqa: E402

CHUNK = 4096

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 64, generator=g),
        "b": torch.randn(64, generator=g).to(torch.bfloat16),
        "nested": {"step": 7, "name": "run", "mask": torch.rand(33, generator=g) > 0.5},
    }


def save(sd: dict[str, Any], writer: Any, **kwargs: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer, **kwargs)


def load(sd: dict[str, Any], reader: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=reader)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        torch.equal(a["w"], b["w"])
        and torch.equal(a["b"], b["b"])
        and torch.equal(a["nested"]["mask"], b["nested"]["mask"])
        and a["nested"]["step"] == b["nested"]["step"]
    )


def test_versions_steps_and_incremental_bytes(tmp_path: Path) -> None:
    sd = state()
    with cryosnap.dcp.StorageWriter(tmp_path, chunk_bytes=CHUNK) as writer:
        save(sd, writer)  # the first version of a new run: step 0
        first = writer.last_info
        sd["w"][3, :8] += 1.0  # 32 bytes, inside one chunk
        save(sd, writer, checkpoint_id=10)
        assert writer.last_step == 10 and writer.last_info is not None
        assert writer.last_info.written_bytes == CHUNK
        save(sd, writer)  # after the newest: 11; nothing changed, nothing written
        assert writer.last_info.written_bytes == 0
        with pytest.raises(BaseException, match="step 10 already exists"):
            save(sd, writer, checkpoint_id="10")
        assert writer.run.steps() == [0, 10, 11]
    assert first is not None and first.written_bytes > 64 << 10
    target = state(seed=1)
    load(target, cryosnap.dcp.StorageReader(tmp_path))
    assert same(target, sd)
    old = state(seed=1)
    load(old, cryosnap.dcp.StorageReader(tmp_path, step=0))
    assert same(old, state()) and not torch.equal(old["w"], sd["w"])


def test_a_writer_per_save_never_closed_writes_the_next_incremental_version(
    tmp_path: Path,
) -> None:
    """DCP's habit (a writer per save, as with FileSystemWriter): each is the next version,
    incremental against the previous one, and no writer holds the run between saves."""
    sd = state()
    writers = []
    for change in range(3):
        if change:
            sd["w"][change, :8] += 1.0  # inside one chunk
        writer = cryosnap.dcp.StorageWriter(tmp_path, chunk_bytes=CHUNK)
        save(sd, writer)
        writers.append(writer)  # kept alive, never closed
        # Between saves the run is free: a Checkpointer opens it in this very process.
        with cryosnap.Checkpointer(tmp_path) as ckpt:
            assert ckpt.steps() == list(range(change + 1))
    written = [w.last_info.written_bytes for w in writers if w.last_info is not None]
    assert [w.last_step for w in writers] == [0, 1, 2]
    assert written[0] > 64 << 10 and written[1:] == [CHUNK, CHUNK]
    assert all(w.last_info is not None and w.last_info.stall_seconds > 0 for w in writers)
    sd["w"][5, :8] += 1.0
    async_writer = cryosnap.dcp.StorageWriter(tmp_path, chunk_bytes=CHUNK)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.async_save(sd, storage_writer=async_writer).result()
    info = async_writer.last_info
    assert async_writer.last_step == 3 and info is not None and info.written_bytes == CHUNK
    assert info.stall_seconds > 0  # the staging copy's time, not 0.0
    assert writers[0].run.steps() == [0, 1, 2, 3]
    for step in range(4):  # a reader per load, never closed
        got = state(seed=1)
        load(got, cryosnap.dcp.StorageReader(tmp_path, step=step))
        assert torch.equal(got["w"][step], sd["w"][step]) and same(got, sd) == (step == 3)


class _HeldPlanner(DefaultSavePlanner):
    """Holds the save inside write_data (the run open, its lock taken) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()
        self.release = threading.Event()

    def resolve_data(self, write_item: Any) -> Any:
        self.inside.set()
        assert self.release.wait(60), "the test never released the save"
        return super().resolve_data(write_item)


def _open_in_another_process(path: Path) -> subprocess.CompletedProcess[str]:
    src = str(Path(cryosnap.__file__).resolve().parents[1])
    code = "import sys, cryosnap; cryosnap.Checkpointer(sys.argv[1]).close()"
    env = {**os.environ, "PYTHONPATH": src}
    return subprocess.run(
        [sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True
    )


def test_the_run_is_locked_only_while_a_save_is_in_flight(tmp_path: Path) -> None:
    """Another process is refused during a save and welcome after it; a second writer's save
    of the run in this process waits for the first instead of failing."""
    sd = state()
    planner = _HeldPlanner()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = dcp.async_save(
            sd, storage_writer=cryosnap.dcp.StorageWriter(tmp_path), planner=planner
        )
        assert planner.inside.wait(60)
        refused = _open_in_another_process(tmp_path)
        assert refused.returncode != 0 and "RunLockedError" in refused.stderr
        assert "already open for writing" in refused.stderr
        second = dcp.async_save(sd, storage_writer=cryosnap.dcp.StorageWriter(tmp_path))
        planner.release.set()
        first.result()
        second.result()
    assert cryosnap.Run(tmp_path).steps() == [0, 1]
    assert _open_in_another_process(tmp_path).returncode == 0


def test_a_reopened_writer_goes_on_after_the_newest_version(tmp_path: Path) -> None:
    with cryosnap.dcp.StorageWriter(tmp_path) as writer:
        save(state(), writer, checkpoint_id=4)
    with cryosnap.dcp.StorageWriter(tmp_path) as writer:
        save(state(), writer)
        assert writer.last_step == 5


def test_arguments_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_inflight= is not an option"):
        cryosnap.dcp.StorageWriter(tmp_path, max_inflight=2)
    with pytest.raises(ValueError, match="allow_pickle= is not an option"):
        cryosnap.dcp.StorageWriter(tmp_path, allow_pickle=True)
    with cryosnap.dcp.StorageWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="checkpoint_id='/tmp/x' is invalid"):
            writer.reset("/tmp/x")
        assert cryosnap.dcp.StorageWriter.validate_checkpoint_id("12")
        assert not cryosnap.dcp.StorageWriter.validate_checkpoint_id("ckpt/12")


def test_metadata_is_json_in_rank_0s_manifest(tmp_path: Path) -> None:
    with cryosnap.dcp.StorageWriter(tmp_path) as writer:
        save(state(), writer)
    store = open_store(tmp_path)
    manifest, _ref = engine.read_manifest(store, engine.read_commit(store, 0), 0)
    top = manifest.skeleton["v"][0]
    text = top["v"][top["k"].index("metadata")]["v"]
    doc = json.loads(text)
    assert doc["schema"] == "cryosnap.dcp/1" and doc["step"] == 0 and doc["world_size"] == 1
    assert doc["state_dict"]["w"] == {
        "type": "tensor",
        "dtype": "float32",
        "requires_grad": False,
        "size": [256, 64],
        "chunks": [{"offsets": [0, 0], "sizes": [256, 64], "rank": 0}],
    }
    assert doc["state_dict"]["nested.step"] == {"type": "bytes", "rank": 0}
    assert doc["planner_data"]["nested.step"] == ["nested", "step"]
    # The version is a plain cryosnap version: it loads without allowing pickle.
    raw = cryosnap.load(tmp_path)
    assert raw["cryosnap.dcp"]["tensors"]["w@0,0"].nbytes == 256 * 64 * 4
    metadata, located, step = cryosnap.dcp.read_version_metadata(tmp_path)
    assert step == 0 and located[("w", (0, 0))] == 0
    assert list(metadata.state_dict_metadata["w"].size) == [256, 64]


def _commit_part(path: Path, step: int, metadata: str | None) -> None:
    with cryosnap.Checkpointer(path) as ckpt:
        ckpt.save(step, part_state(0, {}, {}, metadata)).result()


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ("{not json", "step 3 of .*: DCP metadata: is not valid JSON"),
        ('{"schema": "cryosnap.dcp/9"}', "schema 'cryosnap.dcp/9'"),
        (
            '{"schema": "cryosnap.dcp/1", "step": 3, "world_size": 1, "state_dict": '
            '{"w": {"type": "tensor", "dtype": "float32", "size": [4], "chunks": '
            '[{"offsets": [2], "sizes": [4], "rank": 0}]}}}',
            r"state_dict\['w'\].chunks\[0\] \(offsets \[2\], sizes \[4\]\) is outside size",
        ),
        (
            '{"schema": "cryosnap.dcp/1", "step": 3, "world_size": 1, "state_dict": '
            '{"x": {"type": "bytes", "rank": 1}}}',
            r"state_dict\['x'\].rank is 1, outside the 1 rank",
        ),
        (None, "rank 0's part holds no DCP metadata"),
    ],
)
def test_bad_metadata_is_a_format_error_naming_the_step(
    tmp_path: Path, metadata: str | None, message: str
) -> None:
    _commit_part(tmp_path, 3, metadata)
    with pytest.raises(cryosnap.dcp.DcpFormatError, match=message):
        cryosnap.dcp.StorageReader(tmp_path).read_metadata()
    assert issubclass(cryosnap.dcp.DcpFormatError, cryosnap.CheckpointError)


def test_a_plain_version_is_not_taken_for_a_dcp_one(tmp_path: Path) -> None:
    cryosnap.save(tmp_path, {"w": torch.zeros(3)}, step=2)
    with pytest.raises(cryosnap.dcp.DcpFormatError, match=r"step 2 of .* is not a torch\.dist"):
        cryosnap.dcp.StorageReader(tmp_path).read_metadata()


def test_damaged_data_fails_the_load(tmp_path: Path) -> None:
    with cryosnap.dcp.StorageWriter(tmp_path) as writer:
        save(state(), writer)
    data = [p for p in (tmp_path / "data").rglob("*") if p.is_file()]
    assert data
    with open(data[0], "r+b") as f:
        # The last byte: always a blob's (padding before a blob is never read).
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(BaseException, match="does not match its hash") as err:
        load(state(seed=1), cryosnap.dcp.StorageReader(tmp_path))
    assert "IntegrityError" in str(err.value)


def test_async_save_stages_into_the_reused_pool(tmp_path: Path) -> None:
    sd = state()
    with cryosnap.dcp.StorageWriter(tmp_path, staging_bytes=256 << 20) as writer:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            future = dcp.async_save(sd, storage_writer=writer)
            expected = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
            sd["w"] += 1.0  # training goes on while the copy is written
            future.result()
            allocated = writer._staging.allocated_bytes
            dcp.async_save(sd, storage_writer=writer, async_stager=writer).result()
        assert writer._staging.allocated_bytes == allocated > 0  # the slabs were reused
        assert writer.run.steps() == [0, 1]
    got = state(seed=1)
    load(got, cryosnap.dcp.StorageReader(tmp_path, step=0))
    assert torch.equal(got["w"], expected["w"]) and torch.equal(got["b"], expected["b"])
    load(got, cryosnap.dcp.StorageReader(tmp_path, step=1))
    assert torch.equal(got["w"], sd["w"])


@pytest.mark.parametrize("scratch", [False, True], ids=["one-level", "scratch"])
def test_a_version_is_not_durable_before_its_save_stopped_blocking(
    tmp_path: Path, scratch: bool
) -> None:
    """seconds (to durable) and stall_seconds (the caller blocked) run from one start: DCP's
    set-up for dcp.save, the staging copy for dcp.async_save (issue 55)."""
    options: dict[str, Any] = {"chunk_bytes": CHUNK}
    if scratch:
        options["scratch"] = tmp_path / "scratch"
    sd = state()
    infos = []
    for change in range(2):  # a full version, then an incremental one
        sd["w"][change, :8] += 1.0
        writer = cryosnap.dcp.StorageWriter(tmp_path / "run", **options)
        save(sd, writer)
        infos.append(writer.last_info)
    for change in range(2):
        sd["w"][change + 2, :8] += 1.0
        writer = cryosnap.dcp.StorageWriter(tmp_path / "run", **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.async_save(sd, storage_writer=writer).result()  # durable once it returns
        infos.append(writer.last_info)
    assert all(info is not None for info in infos)
    assert [info.seconds >= info.stall_seconds > 0 for info in infos if info] == [True] * 4
    assert [len(info.tiers) for info in infos if info] == [1 + scratch] * 4


def test_the_old_name_checkpointer_warns_and_gives_the_run(tmp_path: Path) -> None:
    with cryosnap.dcp.StorageWriter(tmp_path) as writer:
        save(state(), writer)
        with pytest.warns(DeprecationWarning, match=r"checkpointer is deprecated, use .*\.run"):
            old = writer.checkpointer
        assert isinstance(old, cryosnap.Run) and old.url == writer.run.url
        assert old.steps() == writer.run.steps() == [0]


def test_a_state_larger_than_the_staging_budget_is_refused(tmp_path: Path) -> None:
    big = {
        "a": torch.zeros(40 << 20, dtype=torch.uint8),
        "b": torch.zeros(40 << 20, dtype=torch.uint8),
    }
    with (
        cryosnap.dcp.StorageWriter(tmp_path, staging_bytes=64 << 20) as writer,
        pytest.raises(cryosnap.dcp.DcpError, match="more than staging_bytes=67108864"),
    ):
        writer.stage(big)


def _dcp_directory(path: Path) -> dict[str, Any]:
    sd = state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(path))
    return sd


def test_import_dcp_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sd = _dcp_directory(tmp_path / "dcp")
    run = tmp_path / "run"
    assert cli(["import-dcp", str(tmp_path / "dcp"), str(run), "--step", "5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["step"] == 5 and doc["tensor_chunks"] == 3 and doc["bytes_items"] == 2
    got = state(seed=1)
    load(got, cryosnap.dcp.StorageReader(run))
    assert same(got, sd)
    assert cli(["export", str(run), str(tmp_path / "out.pt")]) == 0
    tree = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(tree["w"], sd["w"]) and tree["nested"]["name"] == "run"
    assert cli(["export", str(run), str(tmp_path / "r1.pt"), "--rank", "1"]) == 2
    assert "rank=1 does not apply" in capsys.readouterr().err
    assert cli(["import-dcp", str(tmp_path), str(run)]) == 2
    assert "has no .metadata file" in capsys.readouterr().err


def test_a_rank_that_read_another_version_than_the_coordinator_fails_the_load(
    tmp_path: Path,
) -> None:
    """Without a step each rank reads the newest version's metadata itself; a version
    committed in between would split them, so the coordinator's step travels with the plans."""
    with cryosnap.dcp.StorageWriter(tmp_path) as writer:
        save(state(), writer, checkpoint_id=1)
        save(state(seed=2), writer, checkpoint_id=2)
    coordinator = cryosnap.dcp.StorageReader(tmp_path, step=1)
    coordinator.read_metadata()
    (plan,) = coordinator.prepare_global_plan([LoadPlan([])])
    rank = cryosnap.dcp.StorageReader(tmp_path)  # the newest: step 2
    rank.read_metadata()
    with pytest.raises(cryosnap.dcp.DcpError, match="step 2, the coordinator that of step 1"):
        rank.read_data(plan, DefaultLoadPlanner())
    target = state(seed=1)
    load(target, cryosnap.dcp.StorageReader(tmp_path))  # one process: one version, the newest
    assert same(target, state(seed=2))


def test_a_staged_copy_no_save_claimed_goes_back_once_dropped() -> None:
    """An async save that failed before setting up the writer never claims its staged copy:
    the next stage() takes its slabs back once nobody holds the copy, instead of waiting."""
    from cryosnap.dcp._staging import Staging

    staging = Staging(budget_bytes=None, timeout_seconds=0.2)
    sd = state()
    held = staging.stage(sd)
    allocated = staging.allocated_bytes
    with pytest.raises(cryosnap.dcp.DcpError, match=r"was not written within 0\.2 s"):
        staging.stage(sd)  # the first copy is still referenced: it may still be written
    del held
    again = staging.stage(sd)
    assert same(again, sd)
    assert staging.allocated_bytes == allocated  # the same slabs, reused
