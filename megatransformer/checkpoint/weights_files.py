"""Weights as safetensors files in the layout transformers' ``save_pretrained`` writes: one model.safetensors, or
shards of a bounded size and model.safetensors.index.json naming each tensor's file. Written a tensor at a time
and read a tensor (or the rows of a slice) on lookup, so that neither side holds more than one shard."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from megatransformer.checkpoint.directory import WEIGHTS, default_file_mode

SHARD_BYTES = 5 * 10**9  # the most a weights file holds (transformers' save_pretrained: max_shard_size="5GB")
WEIGHTS_INDEX = "model.safetensors.index.json"
_PART = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def is_weights_file(name: str) -> bool:
    """A name :func:`write_weights_files` writes."""
    return name in (WEIGHTS, WEIGHTS_INDEX) or _PART.fullmatch(name) is not None


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``, but with the mode any other file gets (0644 under the usual umask):
    safetensors writes a private temporary file (0600) and renames it."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})
    os.chmod(path, default_file_mode())


def write_weights_files(
    directory: Path, tensors: Iterable[tuple[str, torch.Tensor]], shard_bytes: int = SHARD_BYTES
) -> None:
    """``tensors``, taken one at a time, into ``directory``: model.safetensors, or where they take more than
    ``shard_bytes``, files of at most that (a larger tensor alone) and their index. One file's tensors are held
    at once, never more."""
    shard: dict[str, torch.Tensor] = {}
    storages: set[int] = set()  # (safetensors stores no two tensors of one storage: tied weights, views)
    held = 0  # (the bytes of shard's tensors)
    files: list[tuple[list[str], int]] = []  # (the names and bytes of each file written)

    def write_shard() -> None:
        nonlocal held
        save_safetensors(shard, directory / f"shard-{len(files)}.safetensors")
        files.append((list(shard), held))
        shard.clear()
        storages.clear()
        held = 0

    for name, tensor in tensors:
        tensor = tensor.detach().contiguous()
        if shard and held + tensor.nbytes > shard_bytes:
            write_shard()
        if tensor.untyped_storage().data_ptr() in storages:
            tensor = tensor.clone(memory_format=torch.contiguous_format)  # (a plain clone keeps a view's strides)
        storages.add(tensor.untyped_storage().data_ptr())
        shard[name] = tensor
        held += tensor.nbytes
    write_shard()
    if len(files) == 1:
        (directory / "shard-0.safetensors").rename(directory / WEIGHTS)
        return
    weight_map: dict[str, str] = {}
    for k, (names, _) in enumerate(files):
        file = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"  # (as _PART)
        (directory / f"shard-{k}.safetensors").rename(directory / file)
        weight_map |= dict.fromkeys(names, file)
    index = {"metadata": {"total_size": sum(size for _, size in files)}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2))


def indexed_files(directory: Path) -> list[str]:
    """The files that ``directory``'s model.safetensors.index.json names (a ValueError names what is wrong)."""
    path = Path(directory) / WEIGHTS_INDEX
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # (UnicodeDecodeError is a ValueError)
        raise ValueError(f"{path} is not an index of safetensors files ({err.__class__.__name__}: {err})") from None
    unsafe = [file for file in files if not isinstance(file, str) or Path(file).name != file]
    if unsafe:
        raise ValueError(f"{path} names {unsafe[0]!r}, not a file beside it")
    return files


def weights_file_names(directory: Path) -> list[str]:
    """The files that hold the tensors :func:`write_weights_files` wrote: those the index names, or
    model.safetensors."""
    return indexed_files(directory) if (Path(directory) / WEIGHTS_INDEX).is_file() else [WEIGHTS]


class WeightsFiles(Mapping[str, torch.Tensor]):
    """The tensors of ``files`` in ``directory`` by name, each read as stored when looked up and not kept.
    A file safetensors cannot read, or a name in two files, is a ValueError naming it."""

    def __init__(self, directory: Path, files: Sequence[str]) -> None:
        self.directory = Path(directory)
        self.file_of: dict[str, str] = {}
        for file in files:
            with self._open(file) as f:
                for name in f.keys():
                    if name in self.file_of:
                        raise ValueError(f"{self.directory}: {name} is in both {self.file_of[name]} and {file}")
                    self.file_of[name] = file

    @contextmanager
    def _open(self, file: str) -> Iterator:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.directory / file), framework="pt") as f:
                yield f
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{self.directory / file} is not a readable safetensors file ({err})") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        with self._open(self.file_of[name]) as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)

    def meta(self, name: str) -> torch.Tensor:
        """A tensor of ``name``'s shape and dtype on the meta device, read from the file's header."""
        with self._open(self.file_of[name]) as f:
            part = f.get_slice(name)
            shape = part.get_shape()
            dtype = part[:0].dtype if shape else f.get_tensor(name).dtype  # (an empty slice reads no data)
        return torch.empty(shape, dtype=dtype, device="meta")

    def flat(
        self, name: str, start: int, stop: int, dim: int | None = None, index: int = 0, parts: int = 1
    ) -> torch.Tensor:
        """Elements ``start`` to ``stop`` (flattened) of part ``index`` of ``parts`` equal ones of tensor ``name``
        along ``dim`` (the whole tensor: None), reading only the rows that hold them."""
        with self._open(self.file_of[name]) as f:
            part = f.get_slice(name)
            shape = part.get_shape()
            if not shape:
                return f.get_tensor(name).reshape(-1)[start:stop]
            if dim is None:
                index, parts = 0, 1
            if dim == 0 and parts > 1:  # (a part of rows is a flat range of the whole)
                offset = index * math.prod(shape) // parts
                start, stop, index, parts = start + offset, stop + offset, 0, 1
            width = math.prod(shape[1:]) // parts  # (a row of the part)
            first = start // width
            where = [slice(first, -(-stop // width))] + [slice(None)] * (len(shape) - 1)
            if parts > 1:
                size = shape[dim] // parts
                where[dim] = slice(index * size, (index + 1) * size)
            rows = part[tuple(where)].reshape(-1)
            return rows[start - first * width : stop - first * width]
