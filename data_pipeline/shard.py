"""Tokenize documents in parallel and write WebDataset shards plus a manifest.

Layout of a shard directory (format 2; docs/data.md shows a reader)::

    train-000000.tar ...   samples of whole documents, ~1 MiB each: "ids.npy" (uint16|uint32) their token ids
                           concatenated, "offsets.npy" (uint32, n + 1) where document i is ids[offsets[i] :
                           offsets[i + 1]]; instruction examples also "prompt_lens.npy" (uint32, n): the first
                           prompt_lens[i] ids of example i are its prompt
    valid-000000.tar ...   the held-out split (deterministic: every N-th document, see ``held_out``)
    manifest.json          format version; per shard its samples, documents, tokens, bytes and sha256;
                           tokenizer hash, dtype, vocab size, compression

With ``compression="zstd"`` every member of a sample is zstd-compressed and named ``<member>.zst``
(``ids.npy.zst``, ...); the tars themselves stay plain.

Format 1 (still read) held one document per sample ("ids.npy", and "prompt_len" as text for instructions).
Every segment of the input (``data_pipeline.parts.segments``) starts a new shard, so that a shard's documents
do not depend on how the input is split into parts. A part of the input (``part``: whole segments) is written to
a subdirectory and finished by a part record instead of the manifest; ``data_pipeline.merge`` joins the parts
into the shards one run writes.

Each shard is written under a temporary name and renamed when complete; the manifest is written last,
so a directory without a manifest (or a shard not listed in it) is never mistaken for data.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import multiprocessing as mp
import os
import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from operator import attrgetter
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as validated_dataclass

from data_pipeline import STORAGE_ERRNOS, DataError, schema_error, write_failed
from data_pipeline.documents import INPUT_SUFFIXES, DecodeStats, Document, read_documents
from data_pipeline.documents import Reading as _Reading
from data_pipeline.parts import PART_RECORD, input_fingerprint, part_name, part_segments, save_part, segments
from data_pipeline.remote import Retry, is_remote, join, read_bytes
from data_pipeline.tokenizer import TokenizerInfo, load_tokenizer

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # written; format 1 (a sample per document) is still read
READABLE_VERSIONS = (1, 2)
BLOCK_BYTES = 1 << 20  # token ids per sample (format 2): large next to its headers, small for the shuffle
TEXT, INSTRUCTIONS = "text", "prompt_completion"  # Manifest.kind
COMPRESSIONS = ("zstd",)  # Manifest.compression, besides None: each member of a sample compressed
ZSTD_LEVEL = 3  # most of level 19's saving at ~100x its speed (BENCHMARKS.md 5t)
SEGMENT_SHARDS = 8  # a segment of the input holds this many --shard-mb of text (~4 shards of uint16 ids)


RECORD = ConfigDict(extra="forbid", strict=True)
"""Manifests are validated by type, field by field: unknown fields and values of another type are errors."""
Count = Annotated[int, Field(ge=0)]


@validated_dataclass(config=RECORD)
class ShardInfo:
    file: str
    samples: Count  # tar samples: blocks of documents (format 1: one per document)
    tokens: Count
    sha256: Annotated[str, Field(pattern="^[0-9a-f]{64}$")]
    documents: Count | None = None  # (None in format-1 manifests: as many as samples)
    bytes: Count | None = None  # the file's size (None in format-1 manifests)

    def __post_init__(self) -> None:
        if self.documents is None:
            self.documents = self.samples


@validated_dataclass(config=RECORD)
class Manifest:
    tokenizer_sha256: str
    vocab_size: Annotated[int, Field(gt=0)]
    dtype: Literal["uint16", "uint32"]
    eos_id: Count | None
    splits: dict[str, list[ShardInfo]] = Field(default_factory=dict)
    version: Literal[READABLE_VERSIONS] = FORMAT_VERSION
    documents: Count = 0
    replaced_lines: Count = 0  # input lines whose undecodable bytes were replaced
    kind: Literal[TEXT, INSTRUCTIONS] = TEXT  # text documents or (prompt, completion) examples
    compression: Literal[COMPRESSIONS] | None = None  # None: the samples' members as they are

    def save(self, directory: Path) -> None:
        tmp = directory / f".{MANIFEST}.tmp"
        try:
            fields = asdict(self)
            if self.compression is None:  # (a plain dataset stays readable by versions without compression)
                del fields["compression"]
            tmp.write_text(json.dumps(fields, indent=2))
            tmp.replace(directory / MANIFEST)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, directory: str | Path, retry: Retry | None = None) -> Manifest:
        """The manifest of a shard directory: a local path or a URL (see data_pipeline.remote)."""
        missing = DataError(
            f"{directory} has no {MANIFEST}: not a complete shard directory "
            "(write one with `megatransformer data shard`)"
        )
        if is_remote(str(directory)):
            path = join(str(directory), MANIFEST)
            try:
                data = read_bytes(path, retry or Retry())
            except FileNotFoundError:
                raise missing from None
        else:
            path = Path(directory) / MANIFEST
            if not Path(directory).exists():
                raise DataError(
                    f"{directory} does not exist; give a shard directory written by `megatransformer data shard`"
                )
            if not path.is_file():
                if any(p.is_dir() for p in Path(directory).glob("part-*-of-*")):
                    raise DataError(
                        f"{directory} has no {MANIFEST} yet, only parts of `megatransformer data shard --part K/N`: "
                        f"join them with `megatransformer data merge --out {directory}` once all are finished"
                    )
                raise missing
            data = path.read_bytes()
        invalid = f"{path} is not a valid shard manifest"
        redo = "re-create the directory with `megatransformer data shard`"
        try:
            raw = json.loads(data)  # (bytes that are not UTF-8 raise UnicodeDecodeError, a ValueError)
        except ValueError as err:
            raise DataError(f"{invalid} ({type(err).__name__}: {err}); {redo}") from None
        if not isinstance(raw, dict):
            raise DataError(f"{invalid} (a JSON {type(raw).__name__}, not an object); {redo}")
        if raw.get("version") not in READABLE_VERSIONS:
            raise DataError(
                f"{path} has format version {raw.get('version')}, this code reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; re-create it with `megatransformer data shard`"
            )
        if raw.get("compression") not in (None, *COMPRESSIONS):
            raise DataError(
                f"{path} lists shards compressed with {raw.get('compression')!r}, this code reads "
                f"{', '.join(COMPRESSIONS)} or uncompressed ones; re-create it with `megatransformer data shard`"
            )
        try:
            manifest = _MANIFEST.validate_json(data)
        except ValidationError as err:
            raise DataError(f"{invalid} ({schema_error(err)}); {redo}") from None
        for info in (info for shards in manifest.splits.values() for info in shards):
            if not _is_inside(info.file):
                raise DataError(
                    f"{path} lists shard {info.file!r}, which is not a path inside the shard directory "
                    f"(refused: a manifest names only its own shards); {redo}"
                )
        return manifest

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.splits.get(split, []))

    def bytes_per_token(self, split: str | None = None) -> float | None:
        """Shard bytes per token of ``split`` (None: all splits); None for manifests without the sizes."""
        shards = [s for name, shards in self.splits.items() if split in (None, name) for s in shards]
        if any(s.bytes is None for s in shards):
            return None
        return sum(s.bytes for s in shards) / max(1, sum(s.tokens for s in shards))


_MANIFEST = TypeAdapter(Manifest)


def _is_inside(name: object) -> bool:
    """Whether a manifest's shard entry stays inside the shard directory, local or remote: a relative path of
    plain names (a merged dataset lists ``part-00001-of-00002/train-000000.tar``), never ``..``, absolute or
    with backslashes."""
    if not isinstance(name, str) or not name or name.startswith("/") or any(c in name for c in "\\\0"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def decode_ids(data: bytes) -> np.ndarray:
    """The array of an ``.npy`` member; the common case (our own 1-D uint16/uint32 arrays) without numpy's
    header parser."""
    if data[:8] == b"\x93NUMPY\x01\x00":
        header_len = int.from_bytes(data[8:10], "little")
        header = data[10 : 10 + header_len]
        for descr in (b"<u2", b"<u4"):
            if header.startswith(b"{'descr': '" + descr + b"', 'fortran_order': False, 'shape': ("):
                return np.frombuffer(data, dtype=descr.decode(), offset=10 + header_len)
    return np.load(io.BytesIO(data), allow_pickle=False)


NPY_HEADER = 1 << 12  # bytes: room for an .npy member's header (numpy writes 128 for a 1-D array)


@dataclass(frozen=True)
class Expected:
    """What the samples still to be read of a shard may hold, by its manifest (its tokens and documents not
    yet read), and what each of them must be: ids of ``dtype`` below ``vocab_size``, no empty document, and
    prompt lengths, within their examples, in a shard of instruction examples only."""

    tokens: int
    documents: int
    dtype: str
    vocab_size: int
    kind: str = TEXT

    def member_bytes(self, name: str) -> int:
        """The most bytes the member ``name`` (decompressed, without ``.zst``) may hold."""
        if name == "ids.npy":
            return NPY_HEADER + self.tokens * np.dtype(self.dtype).itemsize
        if name in ("offsets.npy", "prompt_lens.npy"):
            return NPY_HEADER + (self.documents + 1) * 8
        return 64  # format 1's prompt_len: a number as text

    def check(self, block: Block) -> None:
        """DataError naming what is wrong with ``block`` (its counts are checked against the shard's by the
        reader)."""
        ids, lengths = block.ids, np.diff(block.offsets)
        if ids.dtype != np.dtype(self.dtype):
            raise DataError(f"a sample holds {ids.dtype} token ids, its manifest says {self.dtype}")
        if len(ids) and ids.max() >= self.vocab_size:
            raise DataError(
                f"token id {ids.max()} of a sample is outside the vocabulary (vocab_size {self.vocab_size} in its "
                "manifest and tokenizer)"
            )
        empty = int((lengths == 0).sum())
        if empty:
            raise DataError(f"a sample holds {empty} empty documents (of {len(lengths)}), which train on nothing")
        if self.kind == TEXT and block.prompt_lens is not None:
            raise DataError(f"a sample holds prompt lengths in a shard of {TEXT} (its manifest's kind)")
        if self.kind == INSTRUCTIONS and block.prompt_lens is None:
            raise DataError(f"a sample holds no prompt lengths in a shard of {INSTRUCTIONS} (its manifest's kind)")
        if block.prompt_lens is not None and (block.prompt_lens > lengths).any():
            raise DataError("a sample holds prompt lengths longer than their examples")


def _member(sample: dict[str, bytes], name: str, expected: Expected | None) -> bytes | None:
    """The member ``name`` of a sample (decompressed if the sample holds ``name.zst``), None if absent; at most
    what ``expected`` allows it, else DataError."""
    limit = None if expected is None else expected.member_bytes(name)
    if name in sample:
        data = sample[name]
    elif f"{name}.zst" in sample:
        data = _decompressed(f"{name}.zst", sample[f"{name}.zst"], limit)
    else:
        return None
    if limit is not None and len(data) > limit:
        raise DataError(f"a sample's {name} holds {len(data):,} bytes, more than the {limit:,} its shard's rest holds")
    return data


def _decompressed(name: str, data: bytes, limit: int | None) -> bytes:
    """A zstd member, decompressed no further than ``limit`` bytes (None: no limit); a frame need not say its
    content size (streaming compressors leave it out)."""
    import zstandard  # (only compressed shards need it: the GPU image lacks it, bench/gpu_wheels.sh brings it)

    try:
        size = zstandard.frame_content_size(data)
        if limit is not None and size > limit:
            raise DataError(f"a sample's {name} claims {size:,} bytes, more than the {limit:,} its shard's rest holds")
        if size >= 0:
            return zstandard.ZstdDecompressor().decompress(data)
        chunks, total = [], 0
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            while chunk := reader.read(1 << 20):
                total += len(chunk)
                if limit is not None and total > limit:
                    raise DataError(
                        f"a sample's {name} decompresses to more than the {limit:,} bytes its shard's rest holds"
                    )
                chunks.append(chunk)
        return b"".join(chunks)
    except zstandard.ZstdError as err:
        raise DataError(f"a sample's {name} is not valid zstd ({err})") from None


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


@dataclass
class Block:
    """Whole documents of one tar sample: document i is ``ids[offsets[i] : offsets[i + 1]]``, and for
    instruction examples its first ``prompt_lens[i]`` ids are the prompt."""

    ids: np.ndarray
    offsets: np.ndarray  # n + 1 ascending, from 0 to len(ids)
    prompt_lens: np.ndarray | None = None

    MEMBERS: ClassVar[tuple[str, ...]] = ("ids.npy", "offsets.npy", "prompt_lens.npy", "prompt_len")

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sample(self, key: str, version: int = FORMAT_VERSION, compression: str | None = None) -> dict[str, bytes]:
        """The block as a WebDataset sample (format 1: a block must hold one document), its members
        compressed with ``compression`` (format 2 only)."""
        sample = {"ids.npy": _npy(self.ids)}
        if version == 1:
            if self.prompt_lens is not None:
                sample["prompt_len"] = str(int(self.prompt_lens[0])).encode()
            return {"__key__": key, **sample}
        sample["offsets.npy"] = _npy(self.offsets.astype(np.uint32))
        if self.prompt_lens is not None:
            sample["prompt_lens.npy"] = _npy(self.prompt_lens.astype(np.uint32))
        if compression is not None:
            if compression not in COMPRESSIONS:
                raise DataError(f"unknown compression {compression!r} (known: {', '.join(COMPRESSIONS)})")
            import zstandard

            compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
            sample = {f"{name}.zst": compressor.compress(data) for name, data in sample.items()}
        return {"__key__": key, **sample}

    @classmethod
    def from_sample(cls, sample: dict[str, bytes], expected: Expected | None = None) -> Block:
        """A sample of either format, compressed or not (format 1: a block of one document); DataError if it
        is malformed or, with ``expected``, not what its shard's manifest says."""
        ids_data, offsets_data = _member(sample, "ids.npy", expected), _member(sample, "offsets.npy", expected)
        prompts_data = _member(sample, "prompt_lens.npy", expected)
        try:
            if ids_data is None:
                raise KeyError("ids.npy")
            ids = decode_ids(ids_data)
            if offsets_data is None:  # format 1
                prompt = _member(sample, "prompt_len", expected)
                block = cls(ids, np.array([0, len(ids)]), None if prompt is None else np.array([int(prompt)]))
            else:
                offsets = decode_ids(offsets_data).astype(np.int64)
                block = cls(ids, offsets, None if prompts_data is None else decode_ids(prompts_data))
        except (KeyError, ValueError, EOFError) as err:
            raise DataError(f"a sample is malformed ({type(err).__name__}: {err})") from None
        offsets, prompt_lens = block.offsets, block.prompt_lens
        if (
            ids.ndim != 1
            or offsets.ndim != 1
            or len(offsets) < 2
            or offsets[0] != 0
            or offsets[-1] != len(ids)
            or (np.diff(offsets) < 0).any()
            or (prompt_lens is not None and (prompt_lens.ndim != 1 or len(prompt_lens) != len(offsets) - 1))
        ):
            raise DataError("a sample's offsets or prompt lengths do not match its token ids")
        if expected is not None:
            expected.check(block)
        return block

    @staticmethod
    def counts(sample: dict[str, bytes], expected: Expected | None = None) -> tuple[int, int]:
        """The documents and tokens of a sample of either format, from its offsets alone (format 2: its ids
        neither decompressed nor decoded)."""
        offsets = _member(sample, "offsets.npy", expected)
        try:
            if offsets is None:  # format 1
                ids = _member(sample, "ids.npy", expected)
                if ids is None:
                    raise KeyError("ids.npy")
                return 1, len(decode_ids(ids))
            offsets = decode_ids(offsets)
            return len(offsets) - 1, int(offsets[-1]) if len(offsets) else 0
        except (KeyError, ValueError, EOFError) as err:
            raise DataError(f"a sample is malformed ({type(err).__name__}: {err})") from None

    @staticmethod
    def documents_in(sample: dict[str, bytes], expected: Expected | None = None) -> int:
        """The documents of a sample of either format, from its offsets alone."""
        return Block.counts(sample, expected)[0]


class ShardWriter:
    """Packs documents into blocks of whole documents (the first ones whose ids reach ``block_bytes``) and
    blocks into tars, rolling over to a new tar once one reaches ``max_bytes`` or when told (``end_shard``, at
    every segment of the input); each tar appears only when closed. The cuts depend on the documents alone, not
    on how they arrive."""

    def __init__(
        self,
        directory: Path,
        prefix: str,
        max_bytes: int,
        block_bytes: int = BLOCK_BYTES,
        version: int = FORMAT_VERSION,
        compression: str | None = None,
    ) -> None:
        self.directory, self.prefix, self.max_bytes, self.version = directory, prefix, max_bytes, version
        self.compression = compression
        self.block_bytes = min(block_bytes, max_bytes)
        self.shards: list[ShardInfo] = []
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = []
        self._pending_bytes = 0
        self._tar = None

    def write(
        self, ids: np.ndarray, lengths: np.ndarray, numbers: np.ndarray, prompt_lens: np.ndarray | None = None
    ) -> None:
        """Documents: their ids concatenated, their lengths, their numbers in the input (for the sample keys)
        and, for instruction examples, their prompt lengths."""
        if not len(lengths):
            return
        self._pending.append((ids, lengths, numbers, prompt_lens))
        self._pending_bytes += ids.nbytes
        if self._pending_bytes >= self.block_bytes or self.version == 1:
            self._write_blocks(final=False)

    def _write_blocks(self, final: bool) -> None:
        ids, lengths, numbers = (np.concatenate([p[i] for p in self._pending]) for i in range(3))
        prompts = None if self._pending[0][3] is None else np.concatenate([p[3] for p in self._pending])
        ends = np.cumsum(lengths)
        block_tokens = -(-self.block_bytes // ids.itemsize)
        first = 0
        while first < len(lengths):
            start = ends[first - 1] if first else 0
            # the block: documents first .. stop - 1, the fewest whose tokens reach block_tokens
            stop = first + 1 if self.version == 1 else int(np.searchsorted(ends, start + block_tokens)) + 1
            if stop > len(lengths):
                if not final:
                    break
                stop = len(lengths)
            offsets = np.concatenate([[0], ends[first:stop] - start])
            block = Block(ids[start : ends[stop - 1]], offsets, None if prompts is None else prompts[first:stop])
            self._write_block(f"{numbers[first]:012d}", block)
            first = stop
        rest = ends[first - 1] if first else 0
        self._pending = (
            [(ids[rest:], lengths[first:], numbers[first:], None if prompts is None else prompts[first:])]
            if first < len(lengths)
            else []
        )
        self._pending_bytes = ids[rest:].nbytes

    def _write_block(self, key: str, block: Block) -> None:
        if self._tar is None:
            self._open()
        self._tar.write(block.sample(key, self.version, self.compression))
        self._samples += 1
        self._documents += len(block)
        self._tokens += len(block.ids)
        if self._stream.tell() >= self.max_bytes:
            self._close_tar()

    def _open(self) -> None:
        import webdataset as wds

        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._final, self._tmp = self.directory / name, self.directory / f".{name}.tmp"
        self._stream = open(self._tmp, "wb")
        self._tar = wds.TarWriter(self._stream, mtime=0)  # fixed mtime: same input, same bytes, same sha256
        self._samples = self._documents = self._tokens = 0

    def abort(self) -> None:
        """Remove everything this writer wrote (a failed run leaves nothing that looks like data)."""
        if self._tar is not None:
            with contextlib.suppress(OSError):  # (the disk that failed a write may fail the last flush too)
                self._tar.close()
            with contextlib.suppress(OSError):
                self._stream.close()
            self._tmp.unlink(missing_ok=True)
            self._tar = None
        for shard in self.shards:
            (self.directory / shard.file).unlink(missing_ok=True)
        self.shards, self._pending = [], []

    def end_shard(self) -> None:
        """Write the documents still pending and close the tar: the next document starts a new shard."""
        if self._pending:
            self._write_blocks(final=True)
        self._close_tar()

    def close(self) -> None:
        """End the last shard."""
        self.end_shard()

    def _close_tar(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._stream.close()
        self._tmp.replace(self._final)
        self.shards.append(
            ShardInfo(
                self._final.name,
                self._samples,
                self._tokens,
                _sha256(self._final),
                self._documents,
                self._final.stat().st_size,
            )
        )
        self._tar = None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Tokenized:
    """Documents as arrays: their token ids concatenated, each one's length and (instruction examples) prompt
    length."""

    ids: np.ndarray
    lengths: np.ndarray
    prompt_lens: np.ndarray | None = None

    def select(self, keep: np.ndarray) -> Tokenized:
        """The documents where ``keep`` (a boolean per document) is true."""
        if keep.all():
            return self
        ids = self.ids[np.repeat(keep, self.lengths)]
        return Tokenized(ids, self.lengths[keep], None if self.prompt_lens is None else self.prompt_lens[keep])


def encode(tokenizer: TokenizerInfo, texts: list[str], dtype: np.dtype, paired: bool) -> Tokenized:
    """``texts`` tokenized in one batch, the id lists moved into numpy without a Python loop over the
    documents. ``paired``: the texts alternate prompt and completion of instruction examples (tokenized
    apart, so the boundary between them is a token boundary). A text longer than PIECE_CHARS is tokenized a
    piece at a time (see ``_pieces``), its pieces' ids joined, so that one long document does not hold the
    tokenizer's working memory for all of its characters at once."""
    if max(map(len, texts), default=0) <= PIECE_CHARS:
        ids, lengths = _encoded(tokenizer, texts, dtype)
    else:
        cut = [_pieces(text) for text in texts]
        parts = [_encoded(tokenizer, group, dtype) for group in _groups([p for pieces in cut for p in pieces])]
        ids = np.concatenate([part[0] for part in parts])
        starts = np.cumsum([0] + [len(pieces) for pieces in cut[:-1]])
        lengths = np.add.reduceat(np.concatenate([part[1] for part in parts]), starts)
    if not paired:
        return Tokenized(ids, lengths)
    return Tokenized(ids, lengths[0::2] + lengths[1::2], lengths[0::2])


PIECE_CHARS = 1 << 16  # characters of one text the tokenizer is given at a time


def _encoded(tokenizer: TokenizerInfo, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The texts' ids concatenated, and their lengths."""
    encodings = tokenizer.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    lists = list(map(attrgetter("ids"), encodings))
    lengths = np.fromiter(map(len, lists), np.int64, len(lists))
    return np.fromiter(itertools.chain.from_iterable(lists), dtype, int(lengths.sum())), lengths


def _pieces(text: str) -> list[str]:
    """``text`` cut into pieces of at most PIECE_CHARS characters, each cut before a space where the piece has
    one (so that a word and the space before it stay together, as a tokenizer's pre-tokenizer splits them)."""
    pieces, start = [], 0
    while len(text) - start > PIECE_CHARS:
        cut = text.rfind(" ", start + 1, start + PIECE_CHARS + 1)
        cut = cut if cut > start else start + PIECE_CHARS
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _groups(pieces: list[str]) -> Iterator[list[str]]:
    """Consecutive pieces, a group at most BATCH_CHARS characters (or one piece)."""
    group: list[str] = []
    chars = 0
    for piece in pieces:
        if group and chars + len(piece) > BATCH_CHARS:
            yield group
            group, chars = [], 0
        group.append(piece)
        chars += len(piece)
    if group:
        yield group


_worker_tokenizer: TokenizerInfo | None = None
_worker_dtype = np.dtype(np.uint32)


def _init_worker(path: str, dtype: str) -> None:
    global _worker_tokenizer, _worker_dtype
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the processes are the parallelism
    _worker_tokenizer, _worker_dtype = load_tokenizer(path), np.dtype(dtype)


def _tokenize(job: tuple[int, np.ndarray, list[str], bool]) -> tuple[int, np.ndarray, Tokenized]:
    segment, numbers, texts, paired = job
    return segment, numbers, encode(_worker_tokenizer, texts, _worker_dtype, paired)


BATCH_TEXTS, BATCH_CHARS = 2048, 1 << 21  # a tokenizer batch: whichever is reached first


def _batches(docs: Iterator[tuple[int, Document]], reading: _Reading) -> Iterator[tuple[int, np.ndarray, list[str]]]:
    """(segment, the documents' numbers, the texts to tokenize) of (segment, document) pairs, a batch at a time,
    a batch never spanning segments; an instruction example is its prompt, then its completion."""
    numbers: list[int] = []
    batch: list[str] = []
    chars, current = 0, None
    for segment, doc in docs:
        if batch and segment != current:
            yield current, np.array(numbers, dtype=np.int64), batch
            numbers, batch, chars = [], [], 0
        current = segment
        reading.add(doc)
        numbers.append(doc.number)
        batch += [doc.text] if doc.prompt is None else [doc.prompt, doc.text]
        chars += len(doc.text)
        if len(batch) >= BATCH_TEXTS or chars >= BATCH_CHARS:
            yield current, np.array(numbers, dtype=np.int64), batch
            numbers, batch, chars = [], [], 0
    if batch:
        yield current, np.array(numbers, dtype=np.int64), batch


def prepare_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a directory")
    for stale in out.glob(".*.tmp") if out.exists() else []:  # left by a crashed run
        stale.unlink()
    existing = (
        sorted(
            (p for p in out.glob("*") if p.name in (MANIFEST, PART_RECORD) or p.suffix == ".tar"),
            key=lambda p: (p.name not in (MANIFEST, PART_RECORD), p.name),
        )
        if out.exists()
        else []
    )
    if existing and not overwrite:
        raise DataError(
            f"{out} already holds a dataset ({existing[0].name}); choose another --out or pass "
            "--overwrite to replace it"
        )
    out.mkdir(parents=True, exist_ok=True)
    for record in (MANIFEST, PART_RECORD):  # first, so a half-replaced directory never looks complete
        (out / record).unlink(missing_ok=True)
    for path in existing:
        path.unlink(missing_ok=True)


SMALL_INPUT = 1000  # documents: of the first ones, the default holds out a tenth


def held_out(n: int | np.ndarray, valid_every: int | None) -> bool | np.ndarray:
    """Whether document number ``n`` (``Document.number``; in one file, its index from 0; or each of an array
    of them) goes to the validation split: every ``valid_every``-th (0: none); by default (None) every 10th of
    the first 1,000 and every 100th after, so that small inputs (a few hundred examples) still get a
    validation split of some batches."""
    n = np.asarray(n)
    every = np.where(n < SMALL_INPUT, 10, 100) if valid_every is None else np.full(n.shape, valid_every)
    return (every > 0) & (n % np.maximum(every, 1) == every - 1)


def write_shards(
    files: list[str],
    tokenizer_path: str,
    out: str | Path,
    shard_mb: float = 256.0,
    valid_every: int | None = None,
    workers: int | None = None,
    text_field: str = "text",
    doc_per: str = "block",
    on_decode_error: str = "replace",
    overwrite: bool = False,
    progress: bool = True,
    prompt_field: str | None = None,
    part: tuple[int, int] | None = None,
    block_mb: float = BLOCK_BYTES / 2**20,
    version: int = FORMAT_VERSION,
    compression: str | None = None,
) -> Manifest:
    """Tokenize ``files`` into ``out``; documents chosen by :func:`held_out` go to the validation split.
    ``workers`` tokenizer processes (default: :func:`default_workers`; 1: in this process). With
    ``prompt_field``, the .jsonl records are (prompt, completion) examples, the completion in ``text_field``.
    With ``part`` (K, N): only the K-th of N parts of ``files``, into ``out``'s part directory (see
    ``data_pipeline.parts``). ``block_mb``: token ids per tar sample; ``version`` 1 writes the older format, a
    sample per document. ``compression``: one of COMPRESSIONS, each sample's members compressed (format 2)."""
    if shard_mb <= 0 or block_mb <= 0:
        raise DataError(f"--shard-mb and the block size must be positive, got {shard_mb} and {block_mb}")
    if version not in READABLE_VERSIONS:
        raise DataError(f"shard format version {version} does not exist (versions: {READABLE_VERSIONS})")
    if compression not in (None, *COMPRESSIONS):
        raise DataError(
            f"--compress {compression} is not a compression this code writes (none, {', '.join(COMPRESSIONS)})"
        )
    if compression and version == 1:
        raise DataError("compressed shards are format 2; format 1 is written uncompressed only")
    if valid_every is not None and (valid_every < 0 or valid_every == 1):
        raise DataError(f"--valid-every must be 0 (no validation split) or >= 2, got {valid_every}")
    out = Path(out)
    tokenizer = load_tokenizer(tokenizer_path)
    for name in files:  # fail before touching --out
        if not Path(name).is_file():
            raise DataError(f"input file {name} does not exist")
    inputs = files
    chosen = segments(inputs, int(SEGMENT_SHARDS * shard_mb * 2**20))
    if part is not None:
        chosen = part_segments(chosen, part)
        if out.is_dir() and any(out.glob("*.tar")):
            raise DataError(f"{out} holds the shards of a dataset written in one run; give the parts another --out")
        if (out / MANIFEST).exists() and not overwrite:
            raise DataError(
                f"{out} already holds a dataset ({MANIFEST}); pass --overwrite to re-make part "
                f"{part[0]}/{part[1]} (then merge the parts again)"
            )
        prepare_output(out / part_name(part), overwrite)
        (out / MANIFEST).unlink(missing_ok=True)  # its parts are about to change
        out = out / part_name(part)
    else:
        prepare_output(out, overwrite)
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {
        split: ShardWriter(out, split, int(shard_mb * 2**20), int(block_mb * 2**20), version, compression)
        for split in ("train", "valid")
    }
    stats = DecodeStats()
    docs = (
        (index, doc)
        for index, segment in enumerate(chosen)
        for doc in read_documents(segment.pieces, text_field, doc_per, on_decode_error, stats, prompt_field)
    )
    paired = prompt_field is not None
    try:
        n_docs = _write_documents(
            docs,
            _Reading([piece for segment in chosen for piece in segment.pieces]),
            paired,
            tokenizer,
            tokenizer_path,
            writers,
            dtype,
            valid_every,
            workers,
            progress,
            stats,
        )
        if n_docs == 0 and part is None:  # (a part may be empty: merge checks the whole)
            raise DataError(f"no documents in {', '.join(map(str, inputs))} (empty inputs?)")
        for writer in writers.values():
            writer.close()
    except BaseException as err:
        for writer in writers.values():
            writer.abort()
        if _failed_writing(err, out):
            raise write_failed(f"writing shards to {out}", out, err, "none of them is left") from None
        raise
    for line in stats.notes():
        print(line, file=sys.stderr)
    manifest = Manifest(
        tokenizer.sha256,
        tokenizer.vocab_size,
        dtype.name,
        tokenizer.eos_id,
        {split: w.shards for split, w in writers.items() if w.shards},
        version=version,
        documents=n_docs,
        replaced_lines=stats.replaced_lines,
        kind=INSTRUCTIONS if paired else TEXT,
        compression=compression,
    )
    # last: the directory is a dataset (or a finished part) from this moment on
    try:
        if part is None:
            manifest.save(out)
        else:
            settings = dict(
                text_field=text_field,
                doc_per=doc_per,
                prompt_field=prompt_field,
                valid_every=valid_every,
                shard_mb=shard_mb,
                block_mb=block_mb,
            )
            save_part(out, part, asdict(manifest), input_fingerprint(inputs), settings)
    except OSError as err:
        for writer in writers.values():
            writer.abort()
        record = MANIFEST if part is None else PART_RECORD
        raise write_failed(f"writing {out / record}", out, err, "none of the shards is left") from None
    return manifest


def _failed_writing(err: BaseException, out: Path) -> bool:
    """Whether ``err`` is a failed write under ``out`` (a full disk), not a failure to read the input."""
    if not isinstance(err, OSError):
        return False
    return err.errno in STORAGE_ERRNOS or (err.filename is not None and Path(err.filename).is_relative_to(out))


def _write_documents(
    docs: Iterator[Document],
    reading: _Reading,
    paired: bool,
    tokenizer: TokenizerInfo,
    tokenizer_path: str,
    writers: dict[str, ShardWriter],
    dtype: np.dtype,
    valid_every: int | None,
    workers: int | None,
    progress: bool,
    stats: DecodeStats,
) -> int:
    from tqdm import tqdm

    workers = workers or default_workers(reading)
    bar = tqdm(total=reading.total, unit="B", unit_scale=True, disable=not progress, desc="sharding", file=sys.stderr)
    n_docs = n_tokens = 0
    current = None
    with _tokenize_pool(workers, tokenizer, tokenizer_path, dtype) as tokenize:
        jobs = ((segment, numbers, texts, paired) for segment, numbers, texts in _batches(docs, reading))
        for segment, numbers, batch in tokenize(jobs):
            if segment != current:  # a segment's documents start a shard of their own
                for writer in writers.values():
                    writer.end_shard()
                current = segment
            valid, tokens = held_out(numbers, valid_every), batch.lengths > 0  # (a text of no tokens: dropped)
            for split, keep in (("train", ~valid & tokens), ("valid", valid & tokens)):
                if keep.any():
                    part = batch.select(keep)
                    writers[split].write(part.ids, part.lengths, numbers[keep], part.prompt_lens)
            stats.no_tokens += int((~tokens).sum())
            n_docs, n_tokens = n_docs + int(tokens.sum()), n_tokens + len(batch.ids)
            bar.update(reading.position - bar.n)
            bar.set_postfix_str(f"{n_docs:,} documents, {n_tokens:,} tokens", refresh=False)
    bar.update(reading.total - bar.n)
    bar.close()
    return n_docs


def default_workers(reading: _Reading) -> int:
    """Tokenizer processes: one a core but the main one's (it reads and writes), no more than a plain-text input
    has batches of :data:`BATCH_CHARS`: an input of one batch is tokenized in this process, where starting
    processes that would import the tokenizer and wait took longer than its text (15 of them on a 16-core GPU
    machine, for a 1.4 MB corpus). A compressed or parquet input's bytes say less than its text: every core."""
    cores = max(1, (os.cpu_count() or 1) - 1)
    if not all(Path(path).suffix in INPUT_SUFFIXES for path in reading.sizes):  # (not .gz, .zst, .parquet)
        return cores
    return max(1, min(cores, -(-reading.total // BATCH_CHARS)))


@contextlib.contextmanager
def _tokenize_pool(workers: int, tokenizer: TokenizerInfo, tokenizer_path: str, dtype: np.dtype):
    """A function mapping (segment, numbers, texts, paired) jobs to (segment, numbers, Tokenized), in order: in
    worker processes (a few batches, or their characters, ahead, so that the input is read as fast as it is
    tokenized, not all at once), or here when workers == 1 (where ``tokenizers`` still spreads a batch over
    threads)."""
    if workers == 1:
        yield lambda jobs: (
            (segment, numbers, encode(tokenizer, texts, dtype, paired)) for segment, numbers, texts, paired in jobs
        )
        return

    def tokenize(jobs):
        pending: deque = deque()  # (result, characters of its texts)
        chars, most = 0, 2 * workers * BATCH_CHARS  # (a batch of long documents counts for more than one)
        for job in jobs:
            pending.append((pool.apply_async(_tokenize, (job,)), sum(map(len, job[2]))))
            chars += pending[-1][1]
            while len(pending) > 2 * workers or (len(pending) > 1 and chars > most):
                result, size = pending.popleft()
                chars -= size
                yield result.get()
        while pending:
            yield pending.popleft()[0].get()

    with mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_path, dtype.name)) as pool:
        yield tokenize
