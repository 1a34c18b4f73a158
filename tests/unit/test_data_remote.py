"""Shard directories over HTTP: a real http.server on loopback serves tiny_data's shards, also one that dies in
the middle of a shard (and comes back, or not) and one that serves a modified shard."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
from support.data import assert_same_batches, loader_settings, take
from support.shard_server import ShardServer

from data_pipeline import DataError
from data_pipeline.loader import build_loader
from data_pipeline.shard import Manifest


@pytest.fixture()
def served(tmp_path, tiny_data):
    root = tmp_path / "served"
    shutil.copytree(tiny_data.shards, root)
    server = ShardServer(root)
    yield server
    server.stop()


settings = functools.partial(loader_settings, seed=3)


def victim(root: Path) -> tuple[str, int]:
    """A train shard and its size."""
    info = Manifest.load(root).splits["train"][2]
    return info.file, (root / info.file).stat().st_size


@pytest.mark.parametrize("workers", [0, 2])
def test_http_shards_equal_local_shards(served, tiny_data, tok, workers):
    local = take(build_loader(settings(str(tiny_data.shards), num_workers=workers), "train", 8, 0, 1, tok), 12)
    remote = take(build_loader(settings(served.url, num_workers=workers), "train", 8, 0, 1, tok), 12)
    assert_same_batches(remote, local)
    valid = list(build_loader(settings(served.url), "valid", 4, 0, 1, tok))
    assert_same_batches(valid, list(build_loader(settings(str(tiny_data.shards)), "valid", 4, 0, 1, tok)))
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
    assert_same_batches(remote, local)


def test_server_that_never_comes_back_names_the_shard(served, tok):
    name, size = victim(served.root)
    served.die_in(name, size // 2, back_after=None)
    loader = build_loader(settings(served.url, retries=2, retry_wait=0.05), "train", 8, 0, 1, tok)
    with pytest.raises(
        DataError, match=f"corrupt shard {served.url}{name}: shard .*{name} failed after 3 attempts.*on_corrupt=skip"
    ):
        take(loader, 12)


def test_unavailable_shard_is_skipped_and_counted(served, tiny_data, tok):
    name, _ = victim(served.root)
    served.refused.add(name)
    loader = build_loader(
        settings(served.url, retries=1, retry_wait=0.05, on_corrupt="skip", streams=8), "train", 8, 0, 1, tok, epochs=1
    )
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
