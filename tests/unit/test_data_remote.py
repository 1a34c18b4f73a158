"""Shard directories over HTTP: a real http.server on loopback serves tiny_data's shards, also one that dies in
the middle of a shard (and comes back, or not) and one that serves a modified shard."""

from __future__ import annotations

import functools
import http.server
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from data_pipeline import DataError
from data_pipeline.loader import LoaderSettings, build_loader
from data_pipeline.shard import Manifest
from data_pipeline.tokenizer import load_tokenizer


class ShardServer:
    """http.server serving ``root`` on a fixed loopback port. ``die_in(name, after_bytes, back_after)``: the
    next response for ``name`` stops after ``after_bytes`` bytes, the whole server goes down with it and comes
    back on the same port ``back_after`` seconds later (None: never). ``refuse(name)``: 503 for ``name``."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, 0
        self.faults: dict[str, tuple[int, float | None]] = {}
        self.refused: set[str] = set()
        self.deaths, self.requests = 0, []
        self.server: http.server.ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> None:
        owner = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet tests
                pass

            def send_head(self):
                name = self.path.strip("/")
                if self.command == "GET":  # (fsspec may ask for the size with a HEAD first)
                    owner.requests.append(name)
                if name in owner.refused:
                    self.send_error(503, "unavailable")
                    return None
                return super().send_head()

            def copyfile(self, source, outputfile) -> None:
                fault = owner.faults.pop(self.path.strip("/"), None)
                if fault is None:
                    return super().copyfile(source, outputfile)
                after_bytes, back_after = fault
                outputfile.write(source.read(after_bytes))
                outputfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)  # the body ends early, then the server is gone
                threading.Thread(target=owner.die, args=(back_after,)).start()

        handler = functools.partial(Handler, directory=str(self.root))
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def die(self, back_after: float | None) -> None:
        self.deaths += 1
        self.server.shutdown()
        self.server.server_close()
        if back_after is not None:
            time.sleep(back_after)
            self.start()

    def die_in(self, name: str, after_bytes: int, back_after: float | None) -> None:
        self.faults[name] = (after_bytes, back_after)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def tok(tiny_data):
    return load_tokenizer(tiny_data.tokenizer)


@pytest.fixture()
def served(tmp_path, tiny_data):
    root = tmp_path / "served"
    shutil.copytree(tiny_data.shards, root)
    server = ShardServer(root)
    yield server
    server.stop()


def settings(train: str, **kw) -> LoaderSettings:
    return LoaderSettings(train=train, seq_len=32, objective="autoregressive", arch="decoder", vocab_size=512,
                          seed=3, **kw)


def take(loader, n):
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == n:
            return batches
    return batches


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def victim(root: Path) -> tuple[str, int]:
    """A train shard and its size."""
    info = Manifest.load(root).splits["train"][2]
    return info.file, (root / info.file).stat().st_size


@pytest.mark.parametrize("workers", [0, 2])
def test_http_shards_equal_local_shards(served, tiny_data, tok, workers):
    local = take(build_loader(settings(str(tiny_data.shards), num_workers=workers), "train", 8, 0, 1, tok), 12)
    remote = take(build_loader(settings(served.url, num_workers=workers), "train", 8, 0, 1, tok), 12)
    assert_same(remote, local)
    valid = list(build_loader(settings(served.url), "valid", 4, 0, 1, tok))
    assert_same(valid, list(build_loader(settings(str(tiny_data.shards)), "valid", 4, 0, 1, tok)))
    assert "manifest.json" in served.requests and any(r.endswith(".tar") for r in served.requests)


def test_server_dies_mid_shard_and_comes_back(served, tiny_data, tok):
    """The read is retried (the server is down for a while: connection refused), then continues where it
    broke; the batches are those of the local directory."""
    name, size = victim(served.root)
    local = take(build_loader(settings(str(tiny_data.shards)), "train", 8, 0, 1, tok), 12)
    served.die_in(name, size * 3 // 5, back_after=0.5)
    remote = take(build_loader(settings(served.url, retry_wait=0.2), "train", 8, 0, 1, tok), 12)
    assert served.deaths == 1 and name not in served.faults
    assert served.requests.count(name) >= 2  # asked again after the failure
    assert_same(remote, local)


def test_server_that_never_comes_back_names_the_shard(served, tok):
    name, size = victim(served.root)
    served.die_in(name, size // 2, back_after=None)
    loader = build_loader(settings(served.url, retries=2, retry_wait=0.05), "train", 8, 0, 1, tok)
    with pytest.raises(DataError, match=f"corrupt shard {served.url}{name}: shard .*{name} failed after 3 "
                                        "attempts.*on_corrupt=skip"):
        take(loader, 12)


def test_unavailable_shard_is_skipped_and_counted(served, tiny_data, tok):
    name, _ = victim(served.root)
    served.refused.add(name)
    loader = build_loader(settings(served.url, retries=1, retry_wait=0.05, on_corrupt="skip", streams=8), "train", 8,
                          0, 1, tok, epochs=1)
    with pytest.warns(UserWarning, match=f"{name} failed after 2 attempts.*skipping it"):
        batches = list(loader)
    assert loader.skipped_shards == [served.url + name]
    assert served.requests.count(name) == 2  # the first try and one retry; skipped from then on
    assert len(batches) > 20


def test_modified_shard_fails_its_checksum_while_streaming(served, tok):
    name, size = victim(served.root)
    data = bytearray((served.root / name).read_bytes())
    data[size // 2] ^= 1  # inside a sample's bytes: the tar still parses
    (served.root / name).write_bytes(bytes(data))
    loader = build_loader(settings(served.url, streams=8), "train", 8, 0, 1, tok, epochs=1)
    with pytest.raises(DataError, match=f"corrupt shard .*{name}.*sha256 differs"):
        list(loader)


def test_missing_manifest_or_shard_fails_at_once(served, tok):
    """A 404 is not retried: no manifest, or a shard the manifest lists that the server does not have."""
    with pytest.raises(DataError, match="no manifest.json"):
        build_loader(settings(served.url + "nothing/", retry_wait=60.0), "train", 8, 0, 1, tok)
    name, _ = victim(served.root)
    (served.root / name).unlink()
    loader = build_loader(settings(served.url, retry_wait=60.0), "train", 8, 0, 1, tok)
    with pytest.raises(DataError, match=f"missing shard {served.url}{name} \\(listed in the manifest\\)"):
        take(loader, 12)
    assert served.requests.count(name) == 1


def test_urls_with_credentials_are_refused(tok):
    for url in ("http://user:secret@127.0.0.1:1/shards/", "https://host/shards/?X-Amz-Signature=secret"):
        with pytest.raises(DataError, match="must not carry credentials") as err:
            build_loader(settings(url), "train", 8, 0, 1, tok)
        assert "secret" not in str(err.value)
