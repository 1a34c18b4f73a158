"""Opening shards: checked against their manifest (size, checksum, counts) before (local) or while (remote)
their blocks are read."""

from __future__ import annotations

import hashlib
import tarfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from data_pipeline import DataError
from data_pipeline.loader.sources import ShardSet
from data_pipeline.remote import Retry, ShardStream
from data_pipeline.shard import Block, Expected, Manifest, ShardInfo


@dataclass(frozen=True)
class Share:
    """What one stream reads of one shard: documents [first, stop) (the whole shard unless split)."""

    shard: int  # index into ShardSet.shards
    first: int
    stop: int


_VERIFIED: set[tuple] = set()  # (path, size, mtime, its manifest's sha256 and counts) checked in this process


@dataclass
class ShardOpener:
    """Opens shards after (local) or while (remote) checking them against the manifest; a corrupt or
    unreachable one raises or, with on_corrupt=skip, is warned about, remembered (in the loader state) and
    skipped."""

    on_corrupt: str
    retry: Retry
    skipped: list[str] = field(default_factory=list)

    def blocks(self, shard_set: ShardSet, share: Share) -> Iterator[tuple[int, Block]]:
        """(index of its first document in the shard, block) of the blocks holding documents of ``share``, in
        shard order; nothing if the shard is (found) corrupt and skipped."""
        info = shard_set.shards[share.shard]
        where = shard_set.location(info)
        if where in self.skipped:
            return
        try:
            if shard_set.remote:
                stream = ShardStream(where, info.sha256, self.retry)
                try:
                    yield from _tar_blocks(stream, shard_set.manifest, info, share)
                    stream.verify_rest()
                finally:
                    stream.close()
            else:
                verify_shard(Path(where), shard_set.manifest, info)
                with open(where, "rb") as f:
                    yield from _tar_blocks(f, shard_set.manifest, info, share)
        except (OSError, DataError, tarfile.TarError) as err:
            message = (
                f"missing shard {where} (listed in the manifest)"
                if isinstance(err, FileNotFoundError)
                else f"corrupt shard {where}: {err}"
            )
            if self.on_corrupt == "error":
                raise DataError(message + " (set data.on_corrupt=skip to skip it)") from None
            warnings.warn(message + "; skipping it (data.on_corrupt=skip)", stacklevel=2)
            self.skipped.append(where)


def verify_shard(path: Path, manifest: Manifest, info: ShardInfo) -> None:
    """Size-and-checksum check against the manifest, then its samples, documents and tokens counted (from the
    offsets alone, the ids passed over) against the manifest's: before any of its documents is served (once
    per file version and process)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns, info.sha256, info.samples, info.documents, info.tokens)
    if key in _VERIFIED:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != info.sha256:
        raise DataError("its sha256 differs from the manifest's (truncated or modified after writing)")
    with tarfile.open(path, mode="r:") as tar:  # (random access: the members not read are seeked over)
        _check_counts_of(_counts(tar, manifest, info), info)
    _VERIFIED.add(key)


def _counts(tar: tarfile.TarFile, manifest: Manifest, info: ShardInfo) -> tuple[int, int, int]:
    """(samples, documents, tokens) of a shard, its ids left unread (format 2)."""
    samples = documents = tokens = 0
    wanted = ("offsets.npy", "offsets.npy.zst") if manifest.version > 1 else ("ids.npy",)
    for sample in _tar_samples(tar, lambda: _expected(manifest, info, tokens, documents), wanted):
        n, t = Block.counts(sample, _expected(manifest, info, tokens, documents))
        samples, documents, tokens = samples + 1, documents + n, tokens + t
        _check_counts_of((samples, documents, tokens), info, partial=True)
    return samples, documents, tokens


def _expected(manifest: Manifest, info: ShardInfo, tokens: int, documents: int) -> Expected:
    """What the rest of a shard may hold once ``tokens`` of its tokens and ``documents`` of its documents are
    read."""
    rest_tokens, rest_documents = max(info.tokens - tokens, 0), max(info.documents - documents, 0)
    return Expected(rest_tokens, rest_documents, manifest.dtype, manifest.vocab_size, manifest.kind)


def _check_counts_of(counted: tuple[int, int, int], info: ShardInfo, partial: bool = False) -> None:
    """DataError if the (samples, documents, tokens) read of a shard are not (``partial``: exceed) its
    manifest's."""
    listed = (info.samples, info.documents, info.tokens)
    if any(c > n for c, n in zip(counted, listed)) or (not partial and counted != listed):
        samples, documents, tokens = counted
        so_far = "at least " if partial else ""
        raise DataError(
            f"it holds {so_far}{samples} samples of {documents} documents ({tokens:,} tokens), its "
            f"manifest says {info.samples} of {info.documents} ({info.tokens:,} tokens); re-create the directory "
            "with `megatransformer data shard`"
        )


SAMPLE_MEMBERS = tuple(f"{name}{zst}" for name in Block.MEMBERS for zst in ("", ".zst"))


def _tar_blocks(fileobj: BinaryIO, manifest: Manifest, info: ShardInfo, share: Share) -> Iterator[tuple[int, Block]]:
    """(index of its first document, block) of the samples of a shard that hold documents [share.first,
    share.stop), read as a stream and checked against the manifest as they are; the samples after the share
    are left unread (remote: the caller checks the sha256)."""
    samples = documents = tokens = 0
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for sample in _tar_samples(tar, lambda: _expected(manifest, info, tokens, documents)):
            expected = _expected(manifest, info, tokens, documents)
            if documents < share.first:  # before the share: only counted (compressed ids stay compressed)
                count, in_ids = Block.counts(sample, expected)
                if documents + count <= share.first:
                    samples, documents, tokens = samples + 1, documents + count, tokens + in_ids
                    _check_counts_of((samples, documents, tokens), info, partial=True)
                    continue
            block = Block.from_sample(sample, expected)
            samples, documents, tokens = samples + 1, documents + len(block), tokens + len(block.ids)
            _check_counts_of((samples, documents, tokens), info, partial=True)
            yield documents - len(block), block
            if documents >= share.stop and share.stop < info.documents:
                return
    _check_counts_of((samples, documents, tokens), info)


def _tar_samples(
    tar: tarfile.TarFile, expected: Callable[[], Expected], wanted: tuple[str, ...] = SAMPLE_MEMBERS
) -> Iterator[dict[str, bytes]]:
    """The samples of a tar written by ShardWriter (a sample's files are consecutive members ``<key>.<ext>``)
    as {ext: bytes}: the members ``wanted`` (others are passed over), each read only if its size is within
    what ``expected()`` (the rest of the shard) allows it."""
    key, sample = None, {}
    for member in tar:
        name, _, ext = member.name.rpartition("/")[2].partition(".")
        if name != key and key is not None:
            yield sample
            sample = {}
        key = name
        if member.isfile() and ext in wanted:
            limit = expected().member_bytes(ext.removesuffix(".zst"))
            if member.size > limit + (limit >> 7) + 1024:  # (zstd adds a little to what it cannot compress)
                raise DataError(f"a sample's {ext} holds {member.size:,} bytes, more than its shard's rest holds")
            sample[ext] = tar.extractfile(member).read()
    if key is not None:
        yield sample
