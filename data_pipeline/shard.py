"""Tokenize documents in parallel and write WebDataset shards plus a manifest.

Layout of a shard directory::

    train-000000.tar ...   samples {"__key__": "<doc id>", "ids.npy": uint16|uint32 token ids}; instruction
                           examples also carry "prompt_len": the first prompt_len ids are the prompt
    valid-000000.tar ...   the held-out split (deterministic: every N-th document, see ``held_out``)
    manifest.json          per-shard samples, tokens and sha256; tokenizer hash, dtype, vocab size

A part of the input (``part``) is written to a subdirectory and finished by a part record instead of the
manifest; ``data_pipeline.merge`` joins the parts (see ``data_pipeline.parts``).

Each shard is written under a temporary name and renamed when complete; the manifest is written last,
so a directory without a manifest (or a shard not listed in it) is never mistaken for data.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from data_pipeline import STORAGE_ERRNOS, DataError, write_failed
from data_pipeline.documents import DecodeStats, Document, read_documents
from data_pipeline.parts import PART_RECORD, input_fingerprint, part_name, part_pieces, save_part
from data_pipeline.remote import Retry, is_remote, join, read_bytes
from data_pipeline.tokenizer import TokenizerInfo, load_tokenizer

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
TEXT, INSTRUCTIONS = "text", "prompt_completion"  # Manifest.kind


@dataclass
class ShardInfo:
    file: str
    samples: int
    tokens: int
    sha256: str


@dataclass
class Manifest:
    tokenizer_sha256: str
    vocab_size: int
    dtype: str
    eos_id: int | None
    splits: dict[str, list[ShardInfo]] = field(default_factory=dict)
    version: int = FORMAT_VERSION
    documents: int = 0
    replaced_lines: int = 0  # input lines whose undecodable bytes were replaced
    kind: str = TEXT  # TEXT documents or INSTRUCTIONS (prompt, completion) examples

    def save(self, directory: Path) -> None:
        tmp = directory / f".{MANIFEST}.tmp"
        try:
            tmp.write_text(json.dumps(asdict(self), indent=2))
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
                raise missing
            data = path.read_bytes()
        try:
            raw = json.loads(data)  # (bytes that are not UTF-8 raise UnicodeDecodeError, a ValueError)
            if raw.get("version") != FORMAT_VERSION:
                raise DataError(f"{path} has format version {raw.get('version')}, this code reads {FORMAT_VERSION}")
            splits = {name: [ShardInfo(**s) for s in shards] for name, shards in raw.pop("splits").items()}
            for info in (info for shards in splits.values() for info in shards):
                if not _is_inside(info.file):
                    raise DataError(
                        f"{path} lists shard {info.file!r}, which is not a path inside the shard directory "
                        "(refused: a manifest names only its own shards); re-create the directory with "
                        "`megatransformer data shard`"
                    )
            return cls(splits=splits, **raw)
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            if isinstance(err, DataError):
                raise
            raise DataError(
                f"{path} is not a valid shard manifest ({type(err).__name__}: {err}); "
                "re-create the directory with `megatransformer data shard`"
            ) from None

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.splits.get(split, []))


def _is_inside(name: object) -> bool:
    """Whether a manifest's shard entry stays inside the shard directory, local or remote: a relative path of
    plain names (a merged dataset lists ``part-00001-of-00002/train-000000.tar``), never ``..``, absolute or
    with backslashes."""
    if not isinstance(name, str) or not name or name.startswith("/") or any(c in name for c in "\\\0"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def encode_sample(key: str, ids: np.ndarray, prompt_len: int | None = None) -> dict:
    buffer = io.BytesIO()
    np.save(buffer, ids, allow_pickle=False)
    sample = {"__key__": key, "ids.npy": buffer.getvalue()}
    if prompt_len is not None:
        sample["prompt_len"] = str(prompt_len).encode()
    return sample


def decode_ids(data: bytes) -> np.ndarray:
    """The token ids of a sample's ``ids.npy``; the common case (our own 1-D uint16/uint32 arrays) without
    numpy's header parser, which dominates the cost for short documents."""
    if data[:8] == b"\x93NUMPY\x01\x00":
        header_len = int.from_bytes(data[8:10], "little")
        header = data[10 : 10 + header_len]
        for descr in (b"<u2", b"<u4"):
            if header.startswith(b"{'descr': '" + descr + b"', 'fortran_order': False, 'shape': ("):
                return np.frombuffer(data, dtype=descr.decode(), offset=10 + header_len)
    return np.load(io.BytesIO(data), allow_pickle=False)


class ShardWriter:
    """Rolls over to a new tar once ``max_bytes`` is reached; each tar appears only when closed."""

    def __init__(self, directory: Path, prefix: str, max_bytes: int) -> None:
        self.directory, self.prefix, self.max_bytes = directory, prefix, max_bytes
        self.shards: list[ShardInfo] = []
        self._tar = None

    def write(self, key: str, ids: np.ndarray, prompt_len: int | None = None) -> None:
        if self._tar is None:
            self._open()
        self._tar.write(encode_sample(key, ids, prompt_len))
        self._samples += 1
        self._tokens += len(ids)
        self._bytes += ids.nbytes + 1024
        if self._bytes >= self.max_bytes:
            self.close()

    def _open(self) -> None:
        import webdataset as wds

        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._final, self._tmp = self.directory / name, self.directory / f".{name}.tmp"
        self._stream = open(self._tmp, "wb")
        self._tar = wds.TarWriter(self._stream, mtime=0)  # fixed mtime: same input, same bytes, same sha256
        self._samples = self._tokens = self._bytes = 0

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
        self.shards = []

    def close(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._stream.close()
        self._tmp.replace(self._final)
        self.shards.append(ShardInfo(self._final.name, self._samples, self._tokens, _sha256(self._final)))
        self._tar = None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_worker_tokenizer: TokenizerInfo | None = None
_worker_dtype = np.dtype(np.uint32)


def _init_worker(path: str, dtype: str) -> None:
    global _worker_tokenizer, _worker_dtype
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the processes are the parallelism
    _worker_tokenizer, _worker_dtype = load_tokenizer(path), np.dtype(dtype)


def _tokenize(batch: tuple[list[int], list[str]]) -> tuple[list[int], list[np.ndarray]]:
    """Compact arrays travel back to the writer faster than lists of ints."""
    numbers, texts = batch
    return numbers, [np.asarray(ids, dtype=_worker_dtype) for ids in _worker_tokenizer.encode_batch(texts)]


def _batches(docs: Iterator[Document], size: int) -> Iterator[tuple[list[int], list[str]]]:
    """The documents' numbers and the texts to tokenize, ``size`` texts at a time; an instruction example is
    its prompt, then its completion (tokenized apart, so the boundary between them is a token boundary)."""
    numbers: list[int] = []
    batch: list[str] = []
    for doc in docs:
        numbers.append(doc.number)
        batch += [doc.text] if doc.prompt is None else [doc.prompt, doc.text]
        if len(batch) >= size:
            yield numbers, batch
            numbers, batch = [], []
    if batch:
        yield numbers, batch


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


def held_out(n: int, valid_every: int | None) -> bool:
    """Whether document number ``n`` (``Document.number``; in one file, its index from 0) goes to the
    validation split: every ``valid_every``-th (0: none); by default (None) every 10th of the first 1,000
    and every 100th after, so that small inputs (a few hundred examples) still get a validation split of some
    batches."""
    if valid_every is None:
        valid_every = 10 if n < SMALL_INPUT else 100
    return valid_every > 0 and n % valid_every == valid_every - 1


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
) -> Manifest:
    """Tokenize ``files`` into ``out``; documents chosen by :func:`held_out` go to the validation split.
    ``workers`` tokenizer processes (default: all cores; 1: in this process). With
    ``prompt_field``, the .jsonl records are (prompt, completion) examples, the completion in ``text_field``.
    With ``part`` (K, N): only the K-th of N parts of ``files``, into ``out``'s part directory (see
    ``data_pipeline.parts``)."""
    if shard_mb <= 0:
        raise DataError(f"--shard-mb must be positive, got {shard_mb}")
    if valid_every is not None and (valid_every < 0 or valid_every == 1):
        raise DataError(f"--valid-every must be 0 (no validation split) or >= 2, got {valid_every}")
    out = Path(out)
    tokenizer = load_tokenizer(tokenizer_path)
    for name in files:  # fail before touching --out
        if not Path(name).is_file():
            raise DataError(f"input file {name} does not exist")
    inputs = files
    if part is not None:
        files = part_pieces(inputs, part)
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
    writers = {split: ShardWriter(out, split, int(shard_mb * 2**20)) for split in ("train", "valid")}
    stats = DecodeStats()
    docs = read_documents(files, text_field, doc_per, on_decode_error, stats, prompt_field)
    paired = prompt_field is not None
    try:
        n_docs = _write_documents(
            docs, paired, tokenizer, tokenizer_path, writers, dtype, valid_every, workers, progress
        )
        if n_docs == 0 and part is None:  # (a part may be empty: merge checks the whole)
            raise DataError(f"no documents in {', '.join(map(str, files))} (empty inputs?)")
        for writer in writers.values():
            writer.close()
    except BaseException as err:
        for writer in writers.values():
            writer.abort()
        if _failed_writing(err, out):
            raise write_failed(f"writing shards to {out}", out, err, "none of them is left") from None
        raise
    if stats.replaced_lines:
        print(
            f"warning: {stats.replaced_lines} input lines were not valid UTF-8; their bad bytes were replaced "
            "(--on-decode-error fail stops at the first one instead)",
            file=sys.stderr,
        )
    manifest = Manifest(
        tokenizer.sha256,
        tokenizer.vocab_size,
        dtype.name,
        tokenizer.eos_id,
        {split: w.shards for split, w in writers.items() if w.shards},
        documents=n_docs,
        replaced_lines=stats.replaced_lines,
        kind=INSTRUCTIONS if paired else TEXT,
    )
    # last: the directory is a dataset (or a finished part) from this moment on
    try:
        if part is None:
            manifest.save(out)
        else:
            settings = dict(text_field=text_field, doc_per=doc_per, prompt_field=prompt_field, valid_every=valid_every)
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
    paired: bool,
    tokenizer: TokenizerInfo,
    tokenizer_path: str,
    writers: dict[str, ShardWriter],
    dtype: np.dtype,
    valid_every: int | None,
    workers: int | None,
    progress: bool,
) -> int:
    from tqdm import tqdm

    workers = workers or max(1, (os.cpu_count() or 1) - 1)  # the main process reads and writes
    bar = tqdm(unit=" docs", disable=not progress, desc="sharding", file=sys.stderr)
    n_docs = n_tokens = 0
    started = time.perf_counter()
    with _tokenize_pool(workers, tokenizer, tokenizer_path, dtype) as tokenize:
        for numbers, batch in tokenize(_batches(docs, 256)):
            examples = zip(batch[::2], batch[1::2]) if paired else ((None, ids) for ids in batch)
            before = n_docs
            for number, (prompt, ids) in zip(numbers, examples):
                split = "valid" if held_out(number, valid_every) else "train"
                ids = np.asarray(ids, dtype=dtype)
                if prompt is not None:
                    ids = np.concatenate([np.asarray(prompt, dtype=dtype), ids])
                writers[split].write(f"{n_docs:012d}", ids, None if prompt is None else len(prompt))
                n_docs += 1
                n_tokens += len(ids)
            bar.update(n_docs - before)
            bar.set_postfix_str(f"{n_tokens / max(time.perf_counter() - started, 1e-9):,.0f} tokens/s")
    bar.close()
    return n_docs


@contextlib.contextmanager
def _tokenize_pool(workers: int, tokenizer: TokenizerInfo, tokenizer_path: str, dtype: np.dtype):
    """A function mapping batches of texts to token ids: in worker processes, or here when workers == 1
    (where ``tokenizers`` still spreads a batch over threads)."""
    if workers == 1:
        yield lambda batches: ((numbers, tokenizer.encode_batch(texts)) for numbers, texts in batches)
        return
    with mp.get_context("spawn").Pool(workers, _init_worker, (tokenizer_path, dtype.name)) as pool:
        yield lambda batches: pool.imap(_tokenize, batches)
