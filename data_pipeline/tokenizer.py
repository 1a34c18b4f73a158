"""Byte-level BPE tokenizers (Hugging Face ``tokenizers``) and the special tokens every objective needs.

Special-token ids are always read from the tokenizer file, never assumed, so any ``tokenizer.json``
works; an objective that needs a token the tokenizer lacks (e.g. a mask token) says so at start.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from data_pipeline import DataError

PAD, BOS, EOS, UNK, MASK = "<pad>", "<s>", "</s>", "<unk>", "<mask>"
# Names other tokenizers use for the same roles, tried in order after ours.
ALIASES = {
    "pad": (PAD, "[PAD]", "<|pad|>", "<|padding|>"),
    "bos": (BOS, "[CLS]", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
    "eos": (EOS, "[SEP]", "<|end_of_text|>", "<|endoftext|>", "<eos>"),
    "unk": (UNK, "[UNK]", "<|unk|>"),
    "mask": (MASK, "[MASK]", "<|mask|>"),
}


def sentinel(i: int) -> str:
    return f"<extra_id_{i}>"


@dataclass
class TokenizerInfo:
    tokenizer: Tokenizer
    vocab_size: int
    pad_id: int | None
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    mask_id: int | None
    sentinel_ids: list[int]
    sha256: str
    path: str
    special_ids: set[int] = field(default_factory=set)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def require(self, role: str, why: str) -> int:
        """The id of a special token an objective cannot work without."""
        value = getattr(self, f"{role}_id")
        if value is None:
            raise DataError(
                f"tokenizer {self.path} has no {role} token, which {why} needs; "
                f"train one with `megatransformer data tokenizer`"
            )
        return value


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_tokenizer(path: str | Path) -> TokenizerInfo:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist; create it with `megatransformer data tokenizer`")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on malformed files
        raise DataError(f"{path} is not a Hugging Face tokenizer.json: {err}") from None
    ids = {
        role: next((tok.token_to_id(n) for n in names if tok.token_to_id(n) is not None), None)
        for role, names in ALIASES.items()
    }
    sentinels = []
    while tok.token_to_id(sentinel(len(sentinels))) is not None:
        sentinels.append(tok.token_to_id(sentinel(len(sentinels))))
    specials = {t.id if hasattr(t, "id") else i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return TokenizerInfo(
        tokenizer=tok,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        pad_id=ids["pad"],
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        unk_id=ids["unk"],
        mask_id=ids["mask"],
        sentinel_ids=sentinels,
        sha256=file_sha256(path),
        path=str(path),
        special_ids=specials | {i for i in ids.values() if i is not None} | set(sentinels),
    )


def write_transformers_files(info: TokenizerInfo, directory: str | Path, **settings) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` in ``directory`` (beside a ``tokenizer.json``):
    the special tokens' roles, so that ``PreTrainedTokenizerFast.from_pretrained(directory)`` has bos, eos, pad,
    unk and mask (and pads); ``settings`` (e.g. model_max_length) go into the config too."""
    roles = {
        f"{role}_token": info.tokenizer.id_to_token(token_id)
        for role in ALIASES
        for token_id in [getattr(info, f"{role}_id")]
        if token_id is not None
    }
    if info.sentinel_ids:
        roles["additional_special_tokens"] = [info.tokenizer.id_to_token(i) for i in info.sentinel_ids]
    directory = Path(directory)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **roles, **settings}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(roles, indent=2) + "\n")


def train_tokenizer(
    files: list[str],
    vocab_size: int,
    out: str | Path,
    n_sentinels: int = 100,
    text_field: str = "text",
    doc_per: str = "block",
    progress: bool = False,
) -> TokenizerInfo:
    """Train a byte-level BPE on text files (read with ``read_documents``), write it atomically, with the files
    that tell ``transformers`` the special tokens beside it; ``progress``: a byte bar of the reading on stderr
    (as data shard's), then a line when the merges are computed."""
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from tqdm import tqdm

    from data_pipeline.documents import Reading, read_documents

    specials = [PAD, BOS, EOS, UNK, MASK] + [sentinel(i) for i in range(n_sentinels)]
    if vocab_size < len(specials) + 256:
        raise DataError(
            f"--vocab-size {vocab_size} is too small: the 256 bytes and {len(specials)} special "
            f"tokens need at least {len(specials) + 256}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    seen = [0]
    reading = Reading(files)
    bar = tqdm(total=reading.total, unit="B", unit_scale=True, disable=not progress, desc="reading", file=sys.stderr)

    def texts():
        for doc in read_documents(files, text_field, doc_per):
            seen[0] += 1
            reading.add(doc)
            if seen[0] % 256 == 0:
                bar.update(reading.position - bar.n)
            yield doc.text
        bar.update(reading.total - bar.n)
        bar.close()
        if progress:
            print(f"read {seen[0]:,} documents: computing the merges", file=sys.stderr, flush=True)

    tok.train_from_iterator(texts(), trainer=trainer)
    if not seen[0]:
        raise DataError(f"no documents in {', '.join(map(str, files))} (empty inputs?)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tok.save(str(tmp))
    tmp.replace(out)
    info = load_tokenizer(out)
    write_transformers_files(info, out.parent)
    if info.vocab_size < vocab_size:  # BPE ran out of pairs to merge: say so, the number matters for model.vocab_size
        print(
            f"note: {out} has {info.vocab_size:,} tokens, fewer than the {vocab_size:,} asked: the corpus has "
            f"no more pairs to merge (model.vocab_size >= {info.vocab_size} covers it)",
            file=sys.stderr,
        )
    return info
