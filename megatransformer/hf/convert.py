"""The families, and whole ``transformers`` model directories written and read through them."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from data_pipeline.tokenizer import load_tokenizer, write_transformers_files
from megatransformer.checkpoint import SHARD_BYTES, is_weights_file, replaced_when_written, write_weights_files
from megatransformer.config import ModelConfig
from megatransformer.hf.deepseek import DEEPSEEK_V3
from megatransformer.hf.family import Family
from megatransformer.hf.gpt2 import GPT2
from megatransformer.hf.llama import LLAMA
from megatransformer.hf.mistral import MISTRAL
from megatransformer.hf.qwen3 import QWEN3

FAMILIES = (LLAMA, MISTRAL, GPT2, QWEN3, DEEPSEEK_V3)
# what a directory holds besides its weights' files
DIRECTORY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
# transformers families close to ours that our blocks cannot express, and why
UNEXPRESSIBLE = {
    "olmo2": "OLMo 2 normalises each sub-layer's output inside the residual (x + norm(f(x))) and its QK-norm spans "
    "all heads at once (one weight of heads x head_dim); our blocks normalise before (pre-LN) or after the sum "
    "(post-LN) and QK-norm per head as Qwen3 does (model.qk_norm exports as Qwen3ForCausalLM)",
}


def hf_incompatibility(cfg: ModelConfig) -> str | None:
    """None when some family can express ``cfg``, else each family's reason."""
    reasons = [reason for family in FAMILIES if (reason := family.incompatibility(cfg))]
    return "; ".join(reasons) if len(reasons) == len(FAMILIES) else None


def hf_family(cfg: ModelConfig) -> Family:
    for family in FAMILIES:
        if family.incompatibility(cfg) is None:
            return family
    raise ValueError(f"this model maps onto no transformers class: {hf_incompatibility(cfg)}")


def save_hf_dir(
    out: Path,
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    tokenizer_json: Path | None = None,
    special_ids: dict[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
    family: Family | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Family:
    """Write a ``transformers`` model directory (config.json, the weights, tokenizer files) that loads with no
    custom code, for ``family`` (default: the first one ``cfg`` maps onto), from ``state`` (our names; a mapping
    that reads each tensor when looked up, ``checkpoint.LazyWeights``, is read a layer at a time:
    :func:`write_hf_weights`). Written to a temporary directory, renamed when complete."""
    family = family or hf_family(cfg)
    special_ids = special_ids or {}
    tokens = {f"{kind}_token_id": special_ids.get(kind) for kind in ("bos", "eos", "pad")}
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        **family.config(cfg),
        # (rope_theta where older transformers read it)
        **({"rope_theta": cfg.rope_theta} if family in (LLAMA, MISTRAL, QWEN3, DEEPSEEK_V3) else {}),
        **tokens,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    with replaced_when_written(Path(out), lambda name: name in DIRECTORY_FILES or is_weights_file(name)) as tmp:
        write_hf_weights(tmp, family, cfg, state, dtype, shard_bytes)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(tokens, indent=2))
        if tokenizer_json is not None:
            shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
            write_transformers_files(load_tokenizer(tmp / "tokenizer.json"), tmp, model_max_length=cfg.max_seq_len)
    return family


def write_hf_weights(
    directory: Path,
    family: Family,
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
) -> None:
    """``family``'s tensors of ``state`` in ``dtype`` into ``directory`` as ``save_pretrained`` writes them
    (:func:`~megatransformer.checkpoint.write_weights_files`), converted a layer at a time
    (:func:`convert_by_layer`): one layer's tensors and one file are held at once, never the model."""
    from megatransformer.model.transformer import build_shapes

    shapes = build_shapes(cfg).state_dict(keep_vars=True)
    unknown = sorted(set(state) - set(shapes))
    if unknown:
        raise ValueError(f"the weights do not fit the model: unexpected {unknown[:3]}")
    converted = convert_by_layer(
        lambda part: family.to_hf(part, cfg), state, {name: shapes[name] for name in state}, family.name
    )
    write_weights_files(directory, ((name, tensor.to(dtype)) for name, tensor in converted), shard_bytes)


def convert_by_layer(
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    state: Mapping[str, torch.Tensor],
    shapes: Mapping[str, torch.Tensor],
    family: str,
) -> Iterator[tuple[str, torch.Tensor]]:
    """What ``convert`` makes of ``state`` (a mapping that may read each tensor when looked up), a part at a
    time: it runs once for the tensors outside the layers and once for each layer's, with that part's tensors
    read and the others' ``shapes`` alone (tensors on the meta device). A conversion that writes a tensor twice
    or leaves one unwritten is an error."""
    expected = set(convert(dict(shapes)))
    for part in _parts(state):
        view = {name: state[name] if name in part else shapes[name] for name in state}
        for name, tensor in convert(view).items():
            if tensor.is_meta:
                continue
            if name not in expected:
                raise RuntimeError(f"{family}'s conversion wrote {name} twice")
            expected.discard(name)
            yield name, tensor
    if expected:
        raise RuntimeError(f"{family}'s conversion left {sorted(expected)[:3]} unwritten")


def _parts(state: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """``state``'s names, those outside the layers first, then each layer's (``...layers.<i>.``, GPT-2's
    ``h.<i>.``)."""
    parts: dict[int, set[str]] = {}
    for name in state:
        found = LAYER.search(name)
        parts.setdefault(-1 if found is None else int(found.group(1)), set()).add(name)
    return [parts[key] for key in sorted(parts)]


def load_hf_dir(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The config of a Llama, Mistral, Qwen3, GPT-2 or DeepSeek-V3 directory (config.json + *.safetensors,
    possibly sharded) and its weights in our names, read and converted a layer at a time as they are taken
    (:func:`convert_by_layer`). The config, the tensors' names and their shapes are checked here; a tensor's
    values (a tied head that differs from its embedding) when it is read."""
    from megatransformer.checkpoint import WEIGHTS_INDEX, WeightsFiles, indexed_files

    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} has no config.json; expected a Hugging Face model directory")
    try:
        hf = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_path} is not JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path} holds a JSON {type(hf).__name__}; a model's config is a JSON object")
    if hf.get("model_type") in UNEXPRESSIBLE:
        raise ValueError(f"{path} holds model_type={hf['model_type']!r}: {UNEXPRESSIBLE[hf['model_type']]}")
    family = next((f for f in FAMILIES if f.model_type == hf.get("model_type")), None)
    if family is None:
        raise ValueError(
            f"{path} holds model_type={hf.get('model_type')!r}; only "
            f"{', '.join(repr(f.model_type) for f in FAMILIES)} can be imported"
        )
    reason = family.refusal(hf)
    if reason:
        raise ValueError(f"{path}: {reason}")
    try:
        cfg = family.model_config(hf)
    except KeyError as err:
        raise ValueError(f"{config_path} lacks {err.args[0]!r}, which a {family.name} config holds") from None
    # (the index, where there is one: a directory may hold other formats' files beside, Mistral's consolidated)
    if (path / WEIGHTS_INDEX).is_file():
        files = indexed_files(path)
    else:
        files = [file.name for file in sorted(path.glob("*.safetensors"))]
    if not files:
        raise ValueError(f"{path} has no .safetensors weights (convert .bin weights with transformers first)")
    theirs = WeightsFiles(path, files)
    shapes = {name: theirs.meta(name) for name in theirs}
    options = family.weight_options(hf)

    def convert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return family.from_hf(state, cfg, **options)

    _check_shapes(convert(shapes), cfg, path)
    return cfg, convert_by_layer(convert, theirs, shapes, family.name)


def _check_shapes(weights: dict[str, torch.Tensor], cfg: ModelConfig, path: Path) -> None:
    """Weights of other shapes than the config describes are refused here, not when a run loads them."""
    from megatransformer.model.transformer import build_shapes

    expected = build_shapes(cfg).state_dict()
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{path}: weight {name} is {list(tensor.shape)}, its config.json describes {list(expected[name].shape)}"
            )
