"""The Store conformance suite: every backend's test class subclasses :class:`StoreTests`.

A subclass provides the ``store`` fixture (an empty store); docs/design/storage.md has an
example. Test code only: it imports pytest, hypothesis and numpy at module level (``import
cryosnap.testing`` does not import this module). Runs on pytest's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from cryosnap.errors import CheckpointNotFoundError
from cryosnap.storage import Store, StoreCapabilities, TruncatedError
from cryosnap.storage.base import BytesLike

__all__ = ["INVALID_KEYS", "StoreTests"]

INVALID_KEYS = ["../x", "/abs", "a//b", "a/./b", "a/..", "", "a/", "a b", "a\\b", "a/\x00"]

PAYLOAD = bytes(range(256)) * 40  # 10240 bytes, every byte value at known offsets
# The timeout of each conditional request in the tests (a bound, not an expected duration).
_CAS_TIMEOUT = 30.0


def _buffers(sizes: list[int]) -> list[memoryview]:
    """Writable buffers of several kinds: bytearray, numpy array, slice of a larger buffer."""
    out: list[memoryview] = []
    for i, n in enumerate(sizes):
        if i % 3 == 0:
            out.append(memoryview(bytearray(n)))
        elif i % 3 == 1:
            out.append(np.zeros(n, np.uint8).data)
        else:
            out.append(memoryview(bytearray(n + 10))[5 : 5 + n])
    return out


class _ReadWriteTests:
    """Small writes and every way of reading them back (``store``: the fixture of
    :class:`StoreTests`)."""

    # -- write / read ------------------------------------------------------------------------

    def test_is_a_store(self, store: Store) -> None:
        assert isinstance(store, Store)
        assert isinstance(store.url, str) and store.url

    def test_write_then_read(self, store: Store) -> None:
        store.write("a.bin", b"hello")
        assert store.read("a.bin") == b"hello"
        assert store.exists("a.bin")
        assert store.size("a.bin") == 5

    def test_write_accepts_buffers(self, store: Store) -> None:
        store.write("b1", bytearray(b"ab"))
        store.write("b2", memoryview(b"xyz")[1:])
        assert store.read("b1") == b"ab" and store.read("b2") == b"yz"

    def test_empty_file(self, store: Store) -> None:
        store.write("empty", b"")
        assert store.exists("empty")
        assert store.read("empty") == b""
        assert store.size("empty") == 0
        store.read_into("empty", 0, [memoryview(bytearray())])

    def test_write_replaces_atomically(self, store: Store) -> None:
        store.write("k", PAYLOAD)
        store.write("k", b"short")
        assert store.read("k") == b"short"  # no tail of the old content
        store.write("k", PAYLOAD[::-1])
        assert store.read("k") == PAYLOAD[::-1]
        assert store.list() == ["k"]  # no temporary left behind

    def test_nested_keys(self, store: Store) -> None:
        store.write("versions/000000000001/COMMIT.json", b"{}")
        store.write("data/x-y_z.1.dat", b"d")
        assert store.read("versions/000000000001/COMMIT.json") == b"{}"
        assert store.read("data/x-y_z.1.dat") == b"d"

    # -- read_into ---------------------------------------------------------------------------

    def test_read_into_several_buffers_at_an_offset(self, store: Store) -> None:
        store.write("p", PAYLOAD)
        bufs = _buffers([1, 300, 0, 4096, 7])
        store.read_into("p", 1000, bufs)
        assert b"".join(bytes(b) for b in bufs) == PAYLOAD[1000 : 1000 + 1 + 300 + 4096 + 7]

    def test_read_ranges_of_one_file(self, store: Store) -> None:
        data = bytes(range(256)) * 4
        store.write("r", data)
        a, b, c = bytearray(3), bytearray(5), bytearray(2)
        store.read_ranges("r", [(10, [memoryview(a), memoryview(b)]), (1000, [memoryview(c)])])
        assert bytes(a) + bytes(b) == data[10:18] and bytes(c) == data[1000:1002]
        with pytest.raises(TruncatedError):
            store.read_ranges("r", [(0, [memoryview(a)]), (1023, [memoryview(bytearray(2))])])

    def test_read_into_up_to_the_last_byte(self, store: Store) -> None:
        store.write("p", PAYLOAD)
        bufs = _buffers([10, 6])
        store.read_into("p", len(PAYLOAD) - 16, bufs)
        assert b"".join(bytes(b) for b in bufs) == PAYLOAD[-16:]

    def test_read_into_any_range(self, store: Store) -> None:
        store.write("p", PAYLOAD)

        @settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(st.integers(0, len(PAYLOAD)), st.lists(st.integers(0, 3000), max_size=5))
        def check(offset: int, sizes: list[int]) -> None:
            bufs = _buffers(sizes)
            if offset + sum(sizes) <= len(PAYLOAD):
                store.read_into("p", offset, bufs)
                assert b"".join(bytes(b) for b in bufs) == PAYLOAD[offset : offset + sum(sizes)]
            else:
                with pytest.raises(TruncatedError):
                    store.read_into("p", offset, bufs)

        check()

    @pytest.mark.parametrize(
        ("offset", "size"), [(0, 10241), (10000, 241), (10240, 1), (1 << 20, 1)]
    )
    def test_read_past_the_end_is_truncated(self, store: Store, offset: int, size: int) -> None:
        store.write("p", PAYLOAD)
        with pytest.raises(TruncatedError, match="p"):
            store.read_into("p", offset, _buffers([size]))

    # -- missing keys ------------------------------------------------------------------------

    @pytest.mark.parametrize("op", ["read", "read_into", "size"])
    def test_missing_key(self, store: Store, op: str) -> None:
        store.write("other/present", b"x")
        calls: dict[str, Callable[[str], Any]] = {
            "read": store.read,
            "read_into": lambda k: store.read_into(k, 0, [memoryview(bytearray(1))]),
            "size": store.size,
        }
        for key in ["absent", "other/absent", "no/such/dir/absent"]:
            with pytest.raises(CheckpointNotFoundError, match="absent") as info:
                calls[op](key)
            assert isinstance(info.value, FileNotFoundError)
        assert not store.exists("absent")

    def test_directory_is_not_a_file(self, store: Store) -> None:
        store.write("dir/file", b"x")
        assert not store.exists("dir")


class _WriterTests:
    """Streaming writers: invisible until commit, nothing left by abort."""

    # -- open_writer -------------------------------------------------------------------------

    def test_writer_streams_buffers(self, store: Store) -> None:
        w = store.open_writer("data/big.dat")
        assert w.key == "data/big.dat"
        parts: list[BytesLike] = [
            PAYLOAD[:100],
            memoryview(PAYLOAD)[100:5000],
            np.frombuffer(PAYLOAD[5000:], "u1").data,
        ]
        w.write(parts[:2])
        assert w.tell() == 5000
        w.write([b""])
        w.write(parts[2:])
        assert w.tell() == len(PAYLOAD)
        w.commit()
        assert store.read("data/big.dat") == PAYLOAD
        assert store.list() == ["data/big.dat"]

    def test_writer_is_invisible_until_commit(self, store: Store) -> None:
        w = store.open_writer("data/new.dat")
        w.write([b"partial content"])
        assert not store.exists("data/new.dat")
        assert store.list() == []
        assert store.list("data") == []
        with pytest.raises(CheckpointNotFoundError):
            store.read("data/new.dat")
        w.commit()
        assert store.exists("data/new.dat")
        assert store.list() == ["data/new.dat"]

    def test_writer_abort_leaves_nothing(self, store: Store) -> None:
        w = store.open_writer("data/gone.dat")
        w.write([PAYLOAD])
        w.abort()
        w.abort()  # twice is fine
        assert not store.exists("data/gone.dat")
        assert store.list() == []
        assert store.list("data") == []

    def test_writer_abort_without_writing(self, store: Store) -> None:
        store.open_writer("data/never.dat").abort()
        assert store.list() == []

    def test_writer_abort_keeps_an_existing_key(self, store: Store) -> None:
        store.write("data/keep.dat", b"old")
        w = store.open_writer("data/keep.dat")
        w.write([b"new content"])
        assert store.read("data/keep.dat") == b"old"
        w.abort()
        assert store.read("data/keep.dat") == b"old"

    def test_writer_closed_after_commit(self, store: Store) -> None:
        w = store.open_writer("data/c.dat")
        w.write([b"abc"])
        w.commit()
        with pytest.raises(ValueError, match="closed"):
            w.write([b"more"])
        with pytest.raises(ValueError, match="closed"):
            w.commit()
        assert store.read("data/c.dat") == b"abc"

    def test_writer_closed_after_abort(self, store: Store) -> None:
        w = store.open_writer("data/c.dat")
        w.abort()
        with pytest.raises(ValueError, match="closed"):
            w.write([b"more"])

    def test_two_writers(self, store: Store) -> None:
        a, b = store.open_writer("data/a.dat"), store.open_writer("data/b.dat")
        a.write([b"A" * 10])
        b.write([b"B" * 20])
        b.commit()
        a.abort()
        assert store.list() == ["data/b.dat"]
        assert store.read("data/b.dat") == b"B" * 20


class _ListDeleteKeyTests:
    """Listing, deleting, and the keys a store refuses."""

    # -- list --------------------------------------------------------------------------------

    def test_list_empty(self, store: Store) -> None:
        assert store.list() == []
        assert store.list("versions") == []

    def test_list_is_sorted_and_filtered_by_prefix(self, store: Store) -> None:
        keys = [
            "versions/000000000010/COMMIT.json",
            "versions/000000000002/rank-00000.json",
            "versions/000000000002/COMMIT.json",
            "data/z.dat",
            "data/a.dat",
            "top",
            "versionsX/file",
            "a/b/c/d",
        ]
        for k in keys:
            store.write(k, k.encode())
        assert store.list() == sorted(keys)
        assert store.list("versions") == sorted(k for k in keys if k.startswith("versions/"))
        assert store.list("versions/000000000002") == [
            "versions/000000000002/COMMIT.json",
            "versions/000000000002/rank-00000.json",
        ]
        assert store.list("data") == ["data/a.dat", "data/z.dat"]
        assert store.list("a/b") == ["a/b/c/d"]
        assert store.list("vers") == []  # a prefix is a directory, not a string prefix
        assert store.list("nothing/here") == []

    def test_list_of_a_file_key_is_empty(self, store: Store) -> None:
        store.write("dir/file", b"x")
        assert store.list("dir/file") == []

    def test_list_shows_every_valid_key(self, store: Store) -> None:
        # Names close to the stores' own temporaries are still valid keys and listed...
        keys = ["a.tmp", "data/.hidden", "data/x.dat.bak", "v/.k.tmp.1"]
        for k in keys:
            store.write(k, b"1")
        assert all(store.exists(k) for k in keys)
        assert store.list() == sorted(keys)
        # ...the reserved ones ("*.partial", ".*.tmp") are refused, never silently hidden.
        for k in ["b.partial", "data/x.dat.partial", "v/.k.1234abcd.tmp"]:
            with pytest.raises(ValueError, match="reserved"):
                store.write(k, b"1")

    # -- delete ------------------------------------------------------------------------------

    def test_delete(self, store: Store) -> None:
        store.write("d/x", b"1")
        store.write("d/y", b"2")
        store.delete("d/x")
        assert not store.exists("d/x")
        assert store.list() == ["d/y"]
        with pytest.raises(CheckpointNotFoundError):
            store.read("d/x")

    def test_delete_missing_is_fine(self, store: Store) -> None:
        store.delete("never")
        store.delete("no/such/dir/never")
        store.write("x", b"1")
        store.delete("x")
        store.delete("x")
        assert store.list() == []

    # -- keys --------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", INVALID_KEYS)
    def test_invalid_key_is_refused_by_writes(self, store: Store, key: str) -> None:
        with pytest.raises(ValueError, match="invalid storage key"):
            store.write(key, b"x")
        with pytest.raises(ValueError, match="invalid storage key"):
            store.open_writer(key)
        with pytest.raises(ValueError, match="invalid storage key"):
            store.delete(key)
        if key:  # "" is the root for list()
            with pytest.raises(ValueError, match="invalid storage key"):
                store.list(key)
        assert store.list() == []

    @pytest.mark.parametrize("key", INVALID_KEYS)
    def test_invalid_key_is_refused_by_reads(self, store: Store, key: str) -> None:
        with pytest.raises(ValueError, match="invalid storage key"):
            store.read(key)
        with pytest.raises(ValueError, match="invalid storage key"):
            store.read_into(key, 0, [memoryview(bytearray(1))])
        with pytest.raises(ValueError, match="invalid storage key"):
            store.exists(key)
        with pytest.raises(ValueError, match="invalid storage key"):
            store.size(key)


class _CapabilityTests:
    """What a store declares in ``capabilities`` is true of it."""

    # -- capabilities ------------------------------------------------------------------------

    def test_capabilities_are_declared(self, store: Store) -> None:
        caps = store.capabilities
        assert isinstance(caps, StoreCapabilities)
        store.write("k", b"1")
        assert store.capabilities == caps  # fixed for the store's lifetime

    def test_local_path_holds_every_key(self, store: Store) -> None:
        root = store.capabilities.local_path
        if root is None:
            pytest.skip("the store declares no local_path")
        assert isinstance(root, Path) and root.is_absolute()
        store.write("versions/000000000001/COMMIT.json", b"commit")
        w = store.open_writer("data/x.dat")
        w.write([PAYLOAD])
        w.commit()
        assert (root / "versions" / "000000000001" / "COMMIT.json").read_bytes() == b"commit"
        assert (root / "data" / "x.dat").read_bytes() == PAYLOAD
        # Both ways: a regular file put there is a key of the store.
        (root / "data" / "y.dat").write_bytes(b"put there")
        assert store.read("data/y.dat") == b"put there"
        assert store.list("data") == ["data/x.dat", "data/y.dat"]
        store.delete("data/x.dat")
        assert not (root / "data" / "x.dat").exists()

    def test_conditional_writes_compare_and_swap(self, store: Store) -> None:
        cas = store.capabilities.conditional_writes
        if cas is None:
            pytest.skip("the store declares no conditional_writes")
        t = _CAS_TIMEOUT
        assert cas.get("cas/k", timeout=t) is None
        tag = cas.create("cas/k", b"one", timeout=t)
        assert tag is not None
        assert cas.create("cas/k", b"two", timeout=t) is None  # exists: not overwritten
        assert cas.get("cas/k", timeout=t) == (b"one", tag)
        assert store.read("cas/k") == b"one"  # the very keys of the primitives
        assert cas.replace("cas/k", b"two", tag + "x", timeout=t) is None
        tag2 = cas.replace("cas/k", b"two", tag, timeout=t)
        assert tag2 is not None and tag2 != tag
        assert cas.replace("cas/k", b"three", tag, timeout=t) is None  # an outdated tag
        assert cas.get("cas/k", timeout=t) == (b"two", tag2)
        cas.delete("cas/k", tag, timeout=t)  # outdated: left alone
        assert store.read("cas/k") == b"two"
        cas.delete("cas/k", tag2, timeout=t)
        assert not store.exists("cas/k") and cas.get("cas/k", timeout=t) is None
        assert cas.replace("cas/k", b"four", tag2, timeout=t) is None  # gone
        cas.delete("cas/k", None, timeout=t)  # a missing key is no error
        assert store.list() == []


class StoreTests(_ReadWriteTests, _WriterTests, _ListDeleteKeyTests, _CapabilityTests):
    """The contract of :class:`cryosnap.storage.Store`, run against the ``store`` fixture a
    backend's test class provides (an empty store, cleaned up afterwards)."""

    @pytest.fixture
    def store(self) -> Store:
        raise NotImplementedError("a backend's test class provides an empty store")

    # -- a state machine against a dict model ------------------------------------------------

    def test_matches_a_dict_model(self, store: Store) -> None:
        keys = st.sampled_from(["a", "b", "d/a", "d/e/f", "x.dat"])
        contents = st.binary(max_size=64)

        class StoreMachine(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                for k in store.list():
                    store.delete(k)
                self.model: dict[str, bytes] = {}

            @rule(key=keys, data=contents)
            def write(self, key: str, data: bytes) -> None:
                if any(k.startswith(key + "/") or key.startswith(k + "/") for k in self.model):
                    return  # a key cannot be both a file and a directory
                store.write(key, data)
                self.model[key] = data

            @rule(key=keys, data=contents, commit=st.booleans())
            def stream(self, key: str, data: bytes, commit: bool) -> None:
                if key in self.model or any(
                    k.startswith(key + "/") or key.startswith(k + "/") for k in self.model
                ):
                    return
                w = store.open_writer(key)
                w.write([data[: len(data) // 2], data[len(data) // 2 :]])
                if commit:
                    w.commit()
                    self.model[key] = data
                else:
                    w.abort()

            @rule(key=keys)
            def delete(self, key: str) -> None:
                store.delete(key)
                self.model.pop(key, None)

            @rule(key=keys)
            def read(self, key: str) -> None:
                if key in self.model:
                    assert store.read(key) == self.model[key]
                    assert store.size(key) == len(self.model[key])
                else:
                    with pytest.raises(CheckpointNotFoundError):
                        store.read(key)

            @invariant()
            def listing(self) -> None:
                assert store.list() == sorted(self.model)
                assert store.list("d") == sorted(k for k in self.model if k.startswith("d/"))

        run_state_machine_as_test(
            StoreMachine,
            settings=settings(
                max_examples=15, stateful_step_count=15, deadline=None, database=None
            ),
        )
