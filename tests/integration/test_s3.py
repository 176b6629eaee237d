"""cryosnap on real S3 semantics: FsspecStore over s3fs against a loopback moto server.

The Store conformance suite runs unchanged against ``s3://<bucket>/run``; the end-to-end tests
save and load through the public API, exercise incremental versions with retention, damage a
data object, take the object-store write lock twice, and reach for an endpoint nobody serves.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import cryosnap
from cryosnap._format.keys import commit_key, manifest_key
from cryosnap._format.manifest import Manifest
from cryosnap._run.lock import LOCK_KEY
from cryosnap.storage import FsspecStore, Store, TimeoutStore, open_store, unwrap
from cryosnap.testing.store import StoreTests

from .conftest import S3Bucket

torch = pytest.importorskip("torch")
pytest.importorskip("s3fs")

pytestmark = pytest.mark.timeout(120)


def make_store(bucket: S3Bucket, path: str = "run", **extra: Any) -> FsspecStore:
    return FsspecStore(bucket.url(path), **bucket.storage_options, **extra)


def make_state(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": {
            "weight": torch.from_numpy(rng.standard_normal((64, 64)).astype(np.float32)),
            "bias": torch.zeros(64, dtype=torch.bfloat16),
        },
        "opt": [torch.arange(10), {3: torch.ones(2, 2)}],
        "data": {"x": rng.standard_normal(5000), "idx": np.arange(7, dtype=np.int16)},
        "blob": rng.bytes(3000),
        "scalar": np.float32(1.5),
        "step": 1,
        "name": "run",
        "flags": (True, None),
    }


def assert_same(expected: Any, actual: Any, path: str = "<root>") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual, expected), path
    elif isinstance(expected, np.ndarray | np.generic):
        assert type(actual) is type(expected), path
        np.testing.assert_array_equal(actual, expected, err_msg=path)
        assert actual.dtype == expected.dtype, path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and list(actual) == list(expected), path
        for k in expected:
            assert_same(expected[k], actual[k], f"{path}/{k}")
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected), path
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{path}/{i}")
    else:
        assert type(actual) is type(expected) and actual == expected, path


# ---------------------------------------------------------------------------------------------
# The Store contract on S3


class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, s3_bucket: S3Bucket) -> FsspecStore:
        return make_store(s3_bucket)


def test_conditional_writes_through_the_timeout_store(s3_bucket: S3Bucket) -> None:
    """As open_store returns the store: its conditional writes reach through the TimeoutStore
    (the rest of the suite over TimeoutStore runs in tests/unit/storage)."""
    store = TimeoutStore(make_store(s3_bucket), 60)
    assert store.capabilities.conditional_writes is not None
    StoreTests().test_conditional_writes_compare_and_swap(store)


def test_bucket_prefix_is_isolated(s3_bucket: S3Bucket) -> None:
    """Two runs in one bucket see only their own keys ("run" is not a prefix of "run2")."""
    a, b = make_store(s3_bucket, "run"), make_store(s3_bucket, "run2")
    a.write("k", b"a")
    b.write("versions/1", b"b")
    assert a.list() == ["k"] and b.list() == ["versions/1"]
    assert make_store(s3_bucket, "run/").read("k") == b"a"  # a trailing slash is the same run


def test_writer_uploads_in_parts(s3_bucket: S3Bucket) -> None:
    """A data file larger than s3fs's block size goes up as a multipart upload."""
    store = make_store(s3_bucket)
    part = bytes(range(256)) * 4096  # 1 MiB
    w = store.open_writer("data/big.dat")
    for _ in range(12):  # 12 MiB: more than two 5 MiB parts
        w.write([part])
    assert not store.exists("data/big.dat")
    w.commit()
    assert store.size("data/big.dat") == 12 * len(part)
    buf = memoryview(bytearray(300))
    store.read_into("data/big.dat", 11 * len(part) + 5, [buf])
    assert bytes(buf) == part[5:305]


def test_writer_abort_discards_a_multipart_upload(s3_bucket: S3Bucket) -> None:
    store = make_store(s3_bucket)
    w = store.open_writer("data/gone.dat")
    w.write([b"\0" * (6 << 20)])  # past the first part: the upload has started
    w.abort()
    assert store.list() == []
    uploads = s3_bucket.admin.call_s3("list_multipart_uploads", Bucket=s3_bucket.name)
    assert not uploads.get("Uploads"), uploads


def test_writers_leave_nothing_behind_on_the_filesystem(s3_bucket: S3Bucket) -> None:
    store = make_store(s3_bucket)
    for i in range(3):
        w = store.open_writer(f"data/{i}.dat")
        w.write([b"x" * 100])
        if i % 2:
            w.abort()
        else:
            w.commit()
    assert list(store.fs.transaction.files) == []


def test_a_second_reader_sees_new_keys(s3_bucket: S3Bucket) -> None:
    """A long-lived reader (its own S3FileSystem, listings cached) sees what a writer adds."""
    writer = make_store(s3_bucket)
    reader = make_store(s3_bucket, skip_instance_cache=True)
    assert reader.fs is not writer.fs
    assert reader.list() == [] and reader.list("versions") == []
    assert not reader.exists("versions/000000000001/COMMIT.json")
    writer.write("versions/000000000001/COMMIT.json", b"1")
    assert reader.list() == ["versions/000000000001/COMMIT.json"]
    assert reader.exists("versions/000000000001/COMMIT.json")
    writer.write("versions/000000000002/COMMIT.json", b"2")
    assert reader.list("versions") == [
        "versions/000000000001/COMMIT.json",
        "versions/000000000002/COMMIT.json",
    ]
    assert reader.exists("versions/000000000002/COMMIT.json")
    writer.delete("versions/000000000001/COMMIT.json")
    assert reader.list() == ["versions/000000000002/COMMIT.json"]


def test_a_second_reader_sees_deleted_keys_gone(s3_bucket: S3Bucket) -> None:
    writer = make_store(s3_bucket)
    reader = make_store(s3_bucket, skip_instance_cache=True)
    writer.write("d/k", b"1")
    writer.write("d/other", b"22")
    assert reader.list() == ["d/k", "d/other"]
    writer.delete("d/k")
    writer.write("d/other", b"333")
    assert reader.list() == ["d/other"]
    assert not reader.exists("d/k")
    assert reader.size("d/other") == 3


def test_missing_bucket(s3_endpoint: str) -> None:
    """A bucket that does not exist: reads find nothing, writes fail naming the URL."""
    from .conftest import s3_options

    store = FsspecStore("s3://cryosnap-no-such-bucket/run", **s3_options(s3_endpoint))
    assert store.list() == [] and not store.exists("k")
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        store.read("k")
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        cryosnap.load(store)
    with pytest.raises(cryosnap.StorageError, match="s3://cryosnap-no-such-bucket/run"):
        store.write("k", b"x")


def test_write_does_not_create_a_missing_bucket(s3_endpoint: str) -> None:
    from .conftest import s3_options

    options = s3_options(s3_endpoint)
    options["client_kwargs"]["region_name"] = "eu-west-1"
    store = FsspecStore("s3://cryosnap-typo-bucket/run", **options, skip_instance_cache=True)
    try:
        with pytest.raises(cryosnap.StorageError, match="s3://cryosnap-typo-bucket/run"):
            store.write("k", b"x")
    finally:
        created = store.fs.exists("cryosnap-typo-bucket")
        if created:
            store.fs.rm("cryosnap-typo-bucket", recursive=True)
    assert not created


def test_credentials_and_endpoint_from_the_environment(s3_bucket: S3Bucket, s3_env: str) -> None:
    """With AWS_ENDPOINT_URL and AWS_* credentials set, a bare URL needs no storage options."""
    store = FsspecStore(s3_bucket.url())
    store.write("k", b"from env")
    assert make_store(s3_bucket).read("k") == b"from env"
    url = s3_bucket.url("env-run")
    state = make_state()
    cryosnap.save(url, state, step=3)  # the plain URL string, through open_store
    assert isinstance(unwrap(open_store(url)), FsspecStore)
    assert_same(state, cryosnap.load(url))


# ---------------------------------------------------------------------------------------------
# End to end through the public API


def test_save_load_round_trip(s3_bucket: S3Bucket) -> None:
    state = make_state()
    info = cryosnap.save(make_store(s3_bucket), state, step=1, chunk_bytes=4096)
    assert info.step == 1 and info.written_bytes > 0
    assert_same(state, cryosnap.load(make_store(s3_bucket)))
    assert_same(state, cryosnap.load(make_store(s3_bucket), step=1))
    # What the run looks like on S3: one data object, a manifest, the commit record last.
    keys = make_store(s3_bucket).list()
    assert LOCK_KEY not in keys  # released on close
    assert [k for k in keys if not k.startswith("data/")] == [
        "versions/000000000001/COMMIT.json",
        "versions/000000000001/rank-00000.json",
    ]
    assert len([k for k in keys if k.startswith("data/")]) == 1
    with pytest.raises(cryosnap.CheckpointExistsError):
        cryosnap.save(make_store(s3_bucket), state, step=1)


def test_load_into_in_place(s3_bucket: S3Bucket) -> None:
    state = make_state()
    cryosnap.save(make_store(s3_bucket), state, step=2)
    into = make_state(seed=1)
    weight = into["model"]["weight"]
    cryosnap.load(make_store(s3_bucket), into=into)
    assert into["model"]["weight"] is weight
    assert torch.equal(weight, state["model"]["weight"])


def test_load_of_an_empty_run_is_not_found(s3_bucket: S3Bucket) -> None:
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        cryosnap.load(make_store(s3_bucket, "nothing-here"))


def test_incremental_versions_and_retention(s3_bucket: S3Bucket) -> None:
    store = make_store(s3_bucket)
    state = make_state()
    states: dict[int, dict[str, Any]] = {}
    infos = []
    with cryosnap.Checkpointer(store, keep=2, chunk_bytes=4096) as ckpt:
        for step in range(1, 6):
            state["model"]["weight"][step] += 1.0  # one row (256 B) changes per version
            state["step"] = step
            infos.append(ckpt.save(step, state).result(timeout=60))
            states[step] = {
                "weight": state["model"]["weight"].clone(),
                "x": state["data"]["x"].copy(),
            }
        assert ckpt.steps() == [4, 5]
        assert ckpt.latest_step() == 5
    assert not infos[0].incremental
    for info in infos[1:]:
        assert info.incremental
        assert info.written_bytes < infos[0].written_bytes / 4, info
    # Retention deleted every object no kept version needs: the commit records of 1..3 and
    # the data of 2; the manifests of the chain 1..5 and the data files it names remain.
    data_files, version_keys = set(), set()
    for step in (4, 5):
        record = json.loads(store.read(commit_key(step)))
        data_files |= set(record["data_files"])
        version_keys |= {commit_key(step)} | {manifest_key(s, 0) for s in record["chain"]}
    assert set(make_store(s3_bucket).list("versions")) == version_keys
    assert set(make_store(s3_bucket).list("data")) == data_files
    assert not [k for k in data_files if k.startswith("data/000000000002-")]
    assert set(s3_bucket.admin.find(f"{s3_bucket.name}/run/data")) == {
        f"{s3_bucket.name}/run/{k}" for k in data_files
    }
    # Both kept versions restore, resolving their incremental chain from S3.
    for step in (4, 5):
        out = cryosnap.load(make_store(s3_bucket), step=step)
        assert out["step"] == step
        assert torch.equal(out["model"]["weight"], states[step]["weight"])
        np.testing.assert_array_equal(out["data"]["x"], states[step]["x"])
    with pytest.raises(cryosnap.CheckpointNotFoundError):
        cryosnap.load(make_store(s3_bucket), step=3)
    # A new Checkpointer on the same run carries on incrementally from the latest version.
    with cryosnap.Checkpointer(make_store(s3_bucket), keep=2, chunk_bytes=4096) as ckpt:
        assert ckpt.steps() == [4, 5]
        info = ckpt.save(6, state).result(timeout=60)
        assert info.incremental and info.written_bytes < infos[0].written_bytes / 4
        assert ckpt.steps() == [5, 6]
        assert_same(state, ckpt.restore())


def _owner_offset(store: Store, step: int, leaf: tuple[str, ...]) -> tuple[str, int]:
    """The data object and a byte offset inside the stored chunks of the leaf at ``leaf``."""
    manifest = Manifest.from_json(store.read(manifest_key(step, 0)), "test")
    node = manifest.skeleton
    for name in leaf:
        node = node["v"][node["k"].index(name)]
    blob = manifest.blobs[node["b"]]
    segment = blob.segments[0]
    return manifest.data_files[segment.file], segment.offset + segment.nbytes // 2


def test_flipped_byte_in_a_data_object_names_the_leaf(s3_bucket: S3Bucket) -> None:
    store = make_store(s3_bucket)
    state = make_state()
    cryosnap.save(store, state, step=7, chunk_bytes=4096)
    data_key, pos = _owner_offset(store, 7, ("data", "x"))
    good = store.read(data_key)
    damaged = bytearray(good)
    damaged[pos] ^= 0x01
    s3_bucket.admin.pipe_file(f"{s3_bucket.name}/run/{data_key}", bytes(damaged))
    with pytest.raises(cryosnap.IntegrityError) as info:
        cryosnap.load(make_store(s3_bucket), step=7)
    msg = str(info.value)
    assert "step 7" in msg and "leaf data/x" in msg and store.url in msg, msg
    # Without an explicit step: a warning, and no older version to fall back to.
    with (
        pytest.warns(RuntimeWarning, match="damaged step 7"),
        pytest.raises(cryosnap.CheckpointError),
    ):
        cryosnap.load(make_store(s3_bucket))
    # Repaired, it loads again.
    s3_bucket.admin.pipe_file(f"{s3_bucket.name}/run/{data_key}", good)
    assert_same(state, cryosnap.load(make_store(s3_bucket), step=7))


def test_damaged_newest_version_falls_back(s3_bucket: S3Bucket) -> None:
    store = make_store(s3_bucket)
    first, second = make_state(0), make_state(1)
    with cryosnap.Checkpointer(store, incremental=False, chunk_bytes=4096) as ckpt:
        ckpt.save(1, first).result(timeout=60)
        ckpt.save(2, second).result(timeout=60)
    data_key, pos = _owner_offset(store, 2, ("model", "weight"))
    damaged = bytearray(store.read(data_key))
    damaged[pos] ^= 0xFF
    s3_bucket.admin.pipe_file(f"{s3_bucket.name}/run/{data_key}", bytes(damaged))
    with pytest.warns(RuntimeWarning, match="damaged step 2"):
        out = cryosnap.load(make_store(s3_bucket))
    assert_same(first, out)


def test_one_writer_per_run(s3_bucket: S3Bucket) -> None:
    with cryosnap.Checkpointer(make_store(s3_bucket)) as ckpt:
        ckpt.save(1, {"a": np.arange(10)}).result(timeout=60)
        with pytest.raises(cryosnap.CheckpointError, match="already open for writing"):
            cryosnap.Checkpointer(make_store(s3_bucket))
        with pytest.raises(cryosnap.CheckpointError, match="already open for writing"):
            cryosnap.save(make_store(s3_bucket), {"a": 1}, step=2)
        # Readers need no lock.
        np.testing.assert_array_equal(cryosnap.load(make_store(s3_bucket))["a"], np.arange(10))
        holder = json.loads(make_store(s3_bucket).read(LOCK_KEY))
        assert holder["token"] == ckpt._levels.levels[-1].locks[0].token
    assert not make_store(s3_bucket).exists(LOCK_KEY)
    with cryosnap.Checkpointer(make_store(s3_bucket)) as ckpt:  # released on close
        assert ckpt.steps() == [1]


_KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    import cryosnap
    from cryosnap.storage import FsspecStore

    url, endpoint = sys.argv[1], sys.argv[2]
    store = FsspecStore(url, key="testing", secret="testing",
                        client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})
    ckpt = cryosnap.Checkpointer(store)
    ckpt.save(1, {"a": 1}).result()
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_lock_of_a_killed_writer_is_recovered(s3_bucket: S3Bucket) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, s3_bucket.url(), s3_bucket.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr
    assert make_store(s3_bucket).exists(LOCK_KEY)  # left behind by the dead process
    with cryosnap.Checkpointer(make_store(s3_bucket)) as ckpt:
        assert ckpt.steps() == [1]
        ckpt.save(2, {"a": 2}).result(timeout=60)
    assert cryosnap.load(make_store(s3_bucket))["a"] == 2


# ---------------------------------------------------------------------------------------------
# An endpoint nobody serves


DEAD_ENDPOINT = "http://127.0.0.1:9"  # discard port: nothing listens on loopback


@pytest.fixture
def dead_store() -> Iterator[FsspecStore]:
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    store = FsspecStore(
        "s3://cryosnap-unreachable/run",
        key="testing",
        secret="testing",
        client_kwargs={"endpoint_url": DEAD_ENDPOINT, "region_name": "us-east-1"},
        # One attempt, one second: botocore's defaults retry for ~8 s per request.
        config_kwargs={"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}},
    )
    yield store
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "op",
    [
        "read",
        "write",
        "list",
        "exists",
        "size",
        "open_writer",
    ],
)
def test_unreachable_endpoint_is_a_storage_error(dead_store: FsspecStore, op: str) -> None:
    calls = {
        "read": lambda: dead_store.read("k"),
        "write": lambda: dead_store.write("k", b"x"),
        "list": lambda: dead_store.list(),
        "exists": lambda: dead_store.exists("k"),
        "size": lambda: dead_store.size("k"),
        "open_writer": lambda: dead_store.open_writer("k").commit(),
    }
    with pytest.raises(cryosnap.StorageError) as info:
        calls[op]()  # a hang fails through the timeout marker, not a wall-clock assert
    msg = str(info.value)
    assert "s3://cryosnap-unreachable/run" in msg and DEAD_ENDPOINT in msg, msg
    assert info.value.__cause__ is not None


@pytest.mark.timeout(60)
def test_unreachable_endpoint_through_the_api(dead_store: FsspecStore) -> None:
    with pytest.raises(cryosnap.StorageError, match="s3://cryosnap-unreachable/run"):
        cryosnap.load(dead_store)
    with pytest.raises(cryosnap.StorageError, match="s3://cryosnap-unreachable/run"):
        cryosnap.save(dead_store, {"a": 1}, step=1)
    with pytest.raises(cryosnap.StorageError, match="s3://cryosnap-unreachable/run"):
        cryosnap.Checkpointer(dead_store)


def test_scratch_then_s3_flush_wipe_restore(s3_bucket: S3Bucket, tmp_path: Any) -> None:
    """Multi-level with S3 as the persistent tier: versions land on local scratch, are flushed
    to the bucket (commit object last), and restore from the bucket once scratch is wiped."""
    import shutil

    scratch = tmp_path / "scratch"
    url, options = s3_bucket.url("tiered"), s3_bucket.storage_options
    states = [make_state(seed) for seed in range(3)]
    with cryosnap.Checkpointer(url, scratch=scratch, storage_options=options) as ckpt:
        infos = [ckpt.save(s, st).result(timeout=60) for s, st in enumerate(states, start=1)]
        assert infos[-1].tiers == ("scratch", "persistent")
        assert ckpt.status().steps["persistent"] == (1, 2, 3)
    shutil.rmtree(scratch)
    with cryosnap.Checkpointer(url, scratch=scratch, storage_options=options) as ckpt:
        assert ckpt.steps() == [1, 2, 3]
        assert_same(states[2], ckpt.restore())
        assert_same(states[1], ckpt.restore(step=2))
    assert_same(states[2], cryosnap.load(open_store(url, **options)))


@pytest.mark.parametrize("route", ["flush", "direct"])
def test_s3_with_codec(s3_bucket: S3Bucket, tmp_path: Any, route: str) -> None:
    """codec="zstd" with S3 as the persistent level, reached by the flush from scratch or
    written directly (no scratch): coded data objects (fewer bytes in the bucket than their
    plain bytes), incremental versions read the coded objects of their bases, and a restore
    from the bucket alone gets every byte back, verified; a damaged coded object is found by
    verify."""
    import shutil

    from cryosnap.storage import read_index

    scratch = tmp_path / "scratch"
    url, options = s3_bucket.url(f"coded-{route}"), s3_bucket.storage_options
    rng = np.random.default_rng(5)
    state = {"w": torch.from_numpy((rng.standard_normal(300_000) * 1e-3).astype(np.float32))}
    states = []
    with cryosnap.Checkpointer(
        url,
        scratch=scratch if route == "flush" else None,
        storage_options=options,
        codec="zstd",
        chunk_bytes=1 << 16,
    ) as ckpt:
        for step in (1, 2, 3):
            state["w"][step * 1000 : step * 1000 + 10] += 1.0
            states.append({"w": state["w"].clone()})
            info = ckpt.save(step, state).result(timeout=60)
            assert info.incremental == (step > 1)
    store = open_store(url, **options)
    coded = plain = 0
    for step in (1, 2, 3):
        manifest = Manifest.from_json(store.read(manifest_key(step, 0)), "m")
        assert manifest.format_version == 8 and manifest.coded == set(manifest.data_files)
        coded += sum(store.size(k) for k in manifest.coded)
        plain += sum(read_index(store, k).plain_size for k in manifest.coded)
    assert coded < 0.95 * plain  # the bucket holds frames: fewer bytes than the plain files
    shutil.rmtree(scratch, ignore_errors=True)
    for step, expected in enumerate(states, start=1):
        assert_same(expected, cryosnap.load(store, step=step))
    assert cryosnap.Run(store).verify().ok
    (key,) = Manifest.from_json(store.read(manifest_key(1, 0)), "m").coded
    raw = bytearray(store.read(key))
    raw[100] ^= 0x10
    store.write(key, bytes(raw))
    report = cryosnap.Run(store).verify()
    assert {v.step for v in report.versions if v.damage} == {1, 2, 3}


# ---------------------------------------------------------------------------------------------
# An endpoint that accepts connections and never answers


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP server on loopback that accepts every connection and never sends a byte."""
    import socket
    import threading

    import s3fs

    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)  # kept open, never read from or written to

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    s3fs.S3FileSystem.clear_instance_cache()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()
    s3fs.S3FileSystem.clear_instance_cache()


SILENT_URL = "s3://cryosnap-silent/run"


def silent_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": "x", "secret": "y"}


@pytest.mark.timeout(60)
def test_opening_a_run_on_an_endpoint_that_never_answers(silent_endpoint: str) -> None:
    """Opening a run fails with a StorageError within the per-call timeout instead of waiting
    on the endpoint for minutes (s3fs and botocore retry a read timeout)."""
    with pytest.raises(cryosnap.StorageError, match=SILENT_URL) as info:
        cryosnap.Checkpointer(
            SILENT_URL, storage_options=silent_options(silent_endpoint), storage_timeout_seconds=2
        )
    assert isinstance(info.value, cryosnap.StorageTimeoutError), info.value


@pytest.mark.timeout(60)
def test_loading_from_an_endpoint_that_never_answers(silent_endpoint: str) -> None:
    store = open_store(SILENT_URL, timeout_seconds=2, **silent_options(silent_endpoint))
    with pytest.raises(cryosnap.StorageError, match=SILENT_URL) as info:
        cryosnap.load(store)
    assert isinstance(info.value, cryosnap.StorageTimeoutError), info.value
    assert "did not return within 2 s" in str(info.value)


@pytest.mark.timeout(60)
def test_silent_endpoint_fails_in_the_backend_with_bounded_requests(silent_endpoint: str) -> None:
    """Without the per-call timeout, short request timeouts make s3fs itself give up: the
    defaults bound every request, and the caller's config_kwargs override them."""
    store = open_store(
        "s3://cryosnap-silent/run",
        timeout_seconds=None,
        endpoint_url=silent_endpoint,
        key="x",
        secret="y",
        config_kwargs={"connect_timeout": 1, "read_timeout": 0.5},
    )
    assert isinstance(store, FsspecStore)
    config = store.fs.config_kwargs
    assert config["read_timeout"] == 0.5 and config["retries"]["total_max_attempts"] == 2
    with pytest.raises(cryosnap.StorageError, match="s3://cryosnap-silent/run") as info:
        store.exists("k")
    assert not isinstance(info.value, cryosnap.StorageTimeoutError)
    assert info.value.__cause__ is not None


def test_object_store_has_no_incomplete_files(s3_bucket: S3Bucket) -> None:
    store = make_store(s3_bucket)
    w = store.open_writer("data/x.dat")
    w.write([b"never committed"])
    assert store.remove_incomplete() == [] and store.remove_incomplete("data") == []
    assert store.list() == []
    w.abort()
    # Through open_store's TimeoutStore too.
    bounded = open_store(s3_bucket.url("run"), **s3_bucket.storage_options)
    assert bounded.remove_incomplete("data") == []


def test_run_handle_over_s3(s3_bucket: S3Bucket) -> None:
    """cryosnap.Run over an s3:// URL with storage_options: read, verify, remove a base version
    (its successor still restores), refused while a Checkpointer holds the object lock."""
    states = [make_state(0), make_state(0)]
    states[1]["data"]["x"][:10] = 0.0  # the second version changes one chunk of the first
    with cryosnap.Checkpointer(make_store(s3_bucket), keep=None, chunk_bytes=4096) as ckpt:
        for step, state in enumerate(states):
            ckpt.save(step, state).result()
    run = cryosnap.Run(s3_bucket.url(), storage_options=s3_bucket.storage_options)
    assert run.steps() == [0, 1] and run.info().base_step == 0 and run.verify().ok
    with cryosnap.Checkpointer(make_store(s3_bucket)), pytest.raises(cryosnap.RunLockedError):
        run.remove(0)
    assert run.remove(0).removed == (0,) and run.steps() == [1]
    assert_same(states[1], run.load())
    with pytest.raises(cryosnap.CheckpointNotFoundError, match="no checkpoint at"):
        cryosnap.Run(s3_bucket.url("none"), storage_options=s3_bucket.storage_options)


def test_a_fork_onto_s3_copies_only_what_the_version_reads(
    s3_bucket: S3Bucket, tmp_path: Any
) -> None:
    """A local run forked into a bucket: a full version of its own there, each chunk the
    version reads copied once (less than the ancestor's files hold: an incremental chain)."""
    anc = tmp_path / "anc"
    w = np.arange(200_000, dtype=np.float64)
    with cryosnap.Checkpointer(anc, chunk_bytes=64 << 10) as ckpt:
        for s in range(1, 5):
            w[: s * 10_000] += 1.0
            ckpt.save(s, {"w": w, "step": s}).result()
    url, options = s3_bucket.url("fork"), s3_bucket.storage_options
    fork = cryosnap.Run(anc).fork(4, url, storage_options=options)
    got = fork.load()
    assert got["step"] == 4 and got["w"].tobytes() == w.tobytes()
    assert fork.lineage().step == 4 and fork.lineage().ancestors == ()
    summary = fork.summary(4)
    reads = cryosnap.Run(anc).info(4)
    held = sum(p.stat().st_size for p in (anc / "data").iterdir())
    assert summary.data_files == 1 and reads.base_step is not None
    assert summary.written_bytes <= summary.logical_bytes < held
    assert fork.verify().ok
