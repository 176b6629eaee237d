"""S3ConditionalWrites: compare-and-swap on the keys of an S3 FsspecStore (s3fs).

PUT with ``If-None-Match: *`` or ``If-Match``, DELETE with ``If-Match``, each bounded by the
caller's ``timeout``. Runs on the calling thread; the requests themselves run on s3fs's event
loop thread. docs/design/storage.md has the fallbacks.
"""

from __future__ import annotations

from typing import Any

from cryosnap.errors import StorageError, StorageTimeoutError
from cryosnap.storage.base import ConditionalWritesUnsupported

__all__ = ["S3ConditionalWrites", "s3_conditional_writes"]

# The error codes S3 (and moto, MinIO) answer a failed precondition with.
_PRECONDITION_FAILED = ("PreconditionFailed", "ConditionalRequestConflict")


def s3_conditional_writes(fs: Any, root: str, url: str) -> S3ConditionalWrites | None:
    """The conditional writes of a store rooted at ``root`` in ``fs``; None unless ``fs`` is
    s3fs's file system (only it exposes the client the requests need)."""
    protocols = fs.protocol
    protocols = {protocols} if isinstance(protocols, str) else set(protocols)
    if not protocols & {"s3", "s3a"} or not hasattr(fs, "_call_s3"):
        return None
    return S3ConditionalWrites(fs, root, url)


def _error_code(exc: BaseException) -> str | None:
    for e in (exc, exc.__cause__):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            return str(code) if code is not None else None
    return None


def _storage_error(what: str, exc: BaseException, timeout: float) -> StorageError:
    if isinstance(exc, TimeoutError):
        return StorageTimeoutError(f"{what} did not return within {timeout:g} s")
    return StorageError(f"{what} failed: {exc}")


class S3ConditionalWrites:
    """Conditional requests on the keys under ``root`` (``bucket/prefix``) of s3fs's ``fs``."""

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root
        self.url = url

    def __repr__(self) -> str:
        return f"S3ConditionalWrites({self.url!r})"

    def _where(self, key: str) -> tuple[str, str]:
        bucket, path, _ = self.fs.split_path(f"{self.root}/{key}")
        return str(bucket), str(path)

    def _call(self, method: str, key: str, timeout: float, **kwargs: Any) -> Any:
        import fsspec.asyn

        bucket, path = self._where(key)
        try:
            return fsspec.asyn.sync(
                self.fs.loop,
                self.fs._call_s3,
                method,
                Bucket=bucket,
                Key=path,
                timeout=timeout,
                **kwargs,
            )
        except (FileExistsError, FileNotFoundError):
            raise  # s3fs's translation of a failed precondition or a missing key
        except Exception as exc:
            code = _error_code(exc)
            if code in _PRECONDITION_FAILED:
                raise FileExistsError(str(exc)) from exc
            if code == "NotImplemented":
                raise ConditionalWritesUnsupported(
                    f"{method} of {key} in {self.url}: the server refuses conditional requests"
                ) from exc
            raise _storage_error(f"{method} of {key} in {self.url}", exc, timeout) from exc

    def get(self, key: str, *, timeout: float) -> tuple[bytes, str] | None:
        import fsspec.asyn

        bucket, path = self._where(key)

        async def call() -> tuple[bytes, str]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=path)
            try:
                return bytes(await resp["Body"].read()), str(resp["ETag"])
            finally:
                resp["Body"].close()

        try:
            got: tuple[bytes, str] = fsspec.asyn.sync(self.fs.loop, call, timeout=timeout)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise _storage_error(f"reading {key} in {self.url}", exc, timeout) from exc
        return got

    def _put(self, key: str, data: bytes, timeout: float, **condition: str) -> str | None:
        """The new ETag, or None when the condition failed. A retried PUT whose first attempt
        landed fails its own condition: the object then holds exactly ``data``, which is ours."""
        try:
            out = self._call("put_object", key, timeout, Body=data, **condition)
        except (FileExistsError, FileNotFoundError):
            got = self.get(key, timeout=timeout)
            return got[1] if got is not None and got[0] == data else None
        return str(out["ETag"])

    def create(self, key: str, data: bytes, *, timeout: float) -> str | None:
        return self._put(key, data, timeout, IfNoneMatch="*")

    def replace(self, key: str, data: bytes, tag: str, *, timeout: float) -> str | None:
        return self._put(key, data, timeout, IfMatch=tag)

    def delete(self, key: str, tag: str | None, *, timeout: float) -> None:
        condition = {} if tag is None else {"IfMatch": tag}
        try:
            self._call("delete_object", key, timeout, **condition)
        except (FileExistsError, FileNotFoundError):
            pass  # changed meanwhile: someone else's now
        except ConditionalWritesUnsupported:
            got = self.get(key, timeout=timeout)  # no conditional delete here
            if got is not None and got[1] == tag:
                self._call("delete_object", key, timeout)
