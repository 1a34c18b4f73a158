"""Shard directories anywhere fsspec reaches: a local path, ``http(s)://``, ``s3://`` (s3fs), ``gs://`` (gcsfs).

A remote shard is streamed, never written to disk: :class:`ShardStream` is a read-only file object that
hashes the bytes as the tar parser pulls them and, at the end, compares the sha256 with the manifest's. A
transient failure (connection reset, server gone, timeout, 5xx) reopens the file and continues at the byte
where it broke (seeking where the filesystem can, else reading past what was already used), waiting 1, 2, 4,
... times ``retry_wait`` seconds in between; after ``retries`` failed attempts in a row the shard is named in
a :class:`~data_pipeline.DataError`. A missing file (404) is not transient and fails at once.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any

from data_pipeline import DataError

REMOTE_SCHEMES = ("http://", "https://", "s3://", "gs://", "gcs://")
FETCH = 1 << 20  # bytes per remote read
HTTP_TIMEOUTS = {"sock_connect": 30.0, "sock_read": 60.0}  # seconds; a silent server is an error, not a hang


def is_remote(location: str) -> bool:
    return str(location).startswith(REMOTE_SCHEMES)


def check_location(location: str) -> None:
    """A URL must not carry credentials: it is written to the run's config.yaml, logs and checkpoints."""
    from urllib.parse import urlsplit

    if is_remote(location):
        parts = urlsplit(str(location))
        if "@" in parts.netloc or parts.query:
            raise DataError(
                f"{parts.scheme}://{parts.hostname}/...: a shard URL must not carry credentials (user:"
                "password@ or ?query): they would be written to config.yaml, logs and checkpoints; "
                "give them to fsspec through the environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, "
                "~/.netrc for http)"
            )


def join(directory: str, name: str) -> str:
    """``name`` inside the shard directory ``directory`` (a URL or a local path)."""
    return f"{str(directory).rstrip('/')}/{name}"


def filesystem(url: str):
    """The fsspec filesystem of ``url`` (one per process and protocol; fsspec caches it, also across forks)."""
    import fsspec

    protocol = url.split("://", 1)[0]
    if protocol in ("http", "https"):
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, **HTTP_TIMEOUTS)
        return fsspec.filesystem(protocol, client_kwargs={"timeout": timeout, "trust_env": True})  # proxies, netrc
    try:
        return fsspec.filesystem(protocol)
    except ImportError as err:
        extra = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}.get(protocol, protocol)
        raise DataError(f"{url}: reading {protocol}:// needs {extra} (pip install {extra}): {err}") from None


@dataclass
class Retry:
    """How often and how patiently a remote read is retried."""

    retries: int = 5  # attempts after the first failure, then the file is named in the error
    wait: float = 1.0  # seconds before the first retry; doubled each time

    def pause(self, attempt: int) -> None:
        time.sleep(self.wait * 2**attempt)


def _transient(err: BaseException) -> bool:
    """Worth retrying: network and server trouble (refused connections, resets, timeouts, 5xx, 408, 429), not a
    missing file, another 4xx or our own checks. (fsspec's http reports both a refused connection and a 404
    as FileNotFoundError, caused by the client's error.)"""
    status = getattr(err.__cause__, "status", None) or getattr(err, "status", None)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return False
    if isinstance(err, FileNotFoundError):
        return err.__cause__ is not None
    return not isinstance(err, (PermissionError, IsADirectoryError, DataError))


def _describe(err: BaseException) -> str:
    cause = err.__cause__ if isinstance(err, FileNotFoundError) and err.__cause__ is not None else err
    return f"{type(cause).__name__}: {cause}"


def read_bytes(url: str, retry: Retry) -> bytes:
    """The whole (small) file at ``url``, e.g. a manifest; raises FileNotFoundError when there is none."""
    for attempt in range(retry.retries + 1):
        try:
            with filesystem(url).open(url, "rb", **_stream_options(url)) as f:
                return f.read()
        except Exception as err:  # noqa: BLE001 - sorted by _transient
            if not _transient(err) or attempt == retry.retries:
                if not _transient(err):
                    raise
                raise DataError(f"could not read {url} after {retry.retries + 1} attempts ({_describe(err)})") from None
            retry.pause(attempt)
    raise AssertionError("unreachable")


def _streamed(url: str) -> bool:
    """http(s) files are read as one streamed GET (no range requests: plain servers need not support them);
    object stores' files are read in (seekable) blocks."""
    return url.startswith(("http://", "https://"))


def _stream_options(url: str) -> dict[str, Any]:
    return {"block_size": 0} if _streamed(url) else {}


class ShardStream:
    """A shard at ``url`` as a read-only file object: retried, and checked against ``sha256`` at its end."""

    def __init__(self, url: str, sha256: str, retry: Retry) -> None:
        self.url, self.expected, self.retry = url, sha256, retry
        self.digest = hashlib.sha256()
        self.offset = 0  # bytes fetched (and hashed) so far
        self.buffer, self.position = b"", 0  # fetched bytes; those before position were read
        self.file = None
        self.done = False

    def _open(self) -> None:
        fs = filesystem(self.url)
        self.file = fs.open(self.url, "rb", **_stream_options(self.url))
        if self.offset:
            if not _streamed(self.url):
                self.file.seek(self.offset)
            else:  # a streamed response: read past what was used before the failure
                left = self.offset
                while left:
                    chunk = self.file.read(min(left, 1 << 20))
                    if not chunk:
                        raise ConnectionError(f"the file ended after {self.offset - left} bytes on reopening")
                    left -= len(chunk)

    def _close_file(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped anyway
                pass
            self.file = None

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all that is left for -1), from a buffer filled FETCH bytes at a time: the tar
        parser asks for small pieces, each remote read is a round trip to the filesystem's event loop."""
        while (size < 0 or len(self.buffer) - self.position < size) and not self.done:
            chunk = self._fetch(FETCH)
            if not chunk:
                self._finish()
            self.buffer, self.position = self.buffer[self.position :] + chunk, 0
        end = len(self.buffer) if size < 0 else self.position + size
        data, self.position = self.buffer[self.position : end], min(end, len(self.buffer))
        return data

    def _fetch(self, size: int) -> bytes:
        """The next ``size`` bytes of the file (fewer at its end), retried; hashed on the way."""
        for attempt in range(self.retry.retries + 1):
            try:
                if self.file is None:
                    self._open()
                data = self.file.read(size)
                break
            except Exception as err:  # noqa: BLE001 - sorted by _transient
                self._close_file()
                if not _transient(err):
                    raise
                if attempt == self.retry.retries:
                    raise DataError(
                        f"shard {self.url} failed after {self.retry.retries + 1} attempts ({_describe(err)})"
                    ) from None
                self.retry.pause(attempt)
        self.digest.update(data)
        self.offset += len(data)
        return data

    def _finish(self) -> None:
        self._close_file()
        self.done = True
        if self.digest.hexdigest() != self.expected:
            raise DataError(
                f"shard {self.url}: its sha256 differs from the manifest's (modified or truncated after writing)"
            )

    def verify_rest(self) -> None:
        """Read to the end (the tar parser stops at the end-of-archive marker) and check the sha256."""
        while self.read(1 << 20):
            pass

    def close(self) -> None:
        self._close_file()
