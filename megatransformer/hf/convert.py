"""The families, and whole ``transformers`` model directories written and read through them."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from data_pipeline.tokenizer import load_tokenizer, write_transformers_files
from megatransformer.config import ModelConfig
from megatransformer.hf.deepseek import DEEPSEEK_V3
from megatransformer.hf.family import Family
from megatransformer.hf.gpt2 import GPT2
from megatransformer.hf.llama import LLAMA
from megatransformer.hf.mistral import MISTRAL
from megatransformer.hf.qwen3 import QWEN3

FAMILIES = (LLAMA, MISTRAL, GPT2, QWEN3, DEEPSEEK_V3)
SHARD_BYTES = 5 * 10**9  # the most a weights file holds (transformers' save_pretrained: max_shard_size="5GB")
LAYER = re.compile(r"\.layers\.(\d+)\.")
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
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        **family.config(cfg),
        # (rope_theta where older transformers read it)
        **({"rope_theta": cfg.rope_theta} if family in (LLAMA, MISTRAL, QWEN3, DEEPSEEK_V3) else {}),
        "bos_token_id": special_ids.get("bos"),
        "eos_token_id": special_ids.get("eos"),
        "pad_token_id": special_ids.get("pad"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_hf_weights(tmp, family, cfg, state, dtype, shard_bytes)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": special_ids.get("bos"),
                "eos_token_id": special_ids.get("eos"),
                "pad_token_id": special_ids.get("pad"),
            },
            indent=2,
        )
    )
    if tokenizer_json is not None:
        shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
        write_transformers_files(load_tokenizer(tmp / "tokenizer.json"), tmp, model_max_length=cfg.max_seq_len)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return family


def write_hf_weights(
    directory: Path,
    family: Family,
    cfg: ModelConfig,
    state: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    shard_bytes: int = SHARD_BYTES,
) -> None:
    """``family``'s tensors of ``state`` in ``dtype`` into ``directory``: model.safetensors, or where they take more
    than ``shard_bytes``, shards of at most that (a larger tensor alone) and their index, as ``save_pretrained``
    writes them. The family's conversion runs once for each layer and once for the rest, with that part's tensors
    read and the others' shapes alone (on the meta device), so one layer's tensors and one shard are held at once,
    never the model."""
    from megatransformer.checkpoint import save_safetensors
    from megatransformer.model.transformer import build_shapes

    shapes = build_shapes(cfg).state_dict(keep_vars=True)
    unknown = sorted(set(state) - set(shapes))
    if unknown:
        raise ValueError(f"the weights do not fit the model: unexpected {unknown[:3]}")
    expected = set(family.to_hf({name: shapes[name] for name in state}, cfg))
    shard: dict[str, torch.Tensor] = {}
    held = 0  # (the bytes of shard's tensors)
    files: list[tuple[list[str], int]] = []  # (the names and bytes of each shard written)

    def write_shard() -> None:
        nonlocal held
        save_safetensors(shard, directory / f"shard-{len(files)}.safetensors")
        files.append((list(shard), held))
        shard.clear()
        held = 0

    for part in _parts(state):
        view = {name: state[name] if name in part else shapes[name] for name in state}
        for name, tensor in family.to_hf(view, cfg).items():
            if tensor.is_meta:
                continue
            if name not in expected:
                raise RuntimeError(f"{family.name}'s conversion wrote {name} twice")
            expected.discard(name)
            tensor = tensor.detach().to(dtype).contiguous().clone()  # (safetensors refuses shared storage)
            if shard and held + tensor.nbytes > shard_bytes:
                write_shard()
            shard[name] = tensor
            held += tensor.nbytes
    if expected:
        raise RuntimeError(f"{family.name}'s conversion left {sorted(expected)[:3]} unwritten")
    write_shard()
    if len(files) == 1:
        (directory / "shard-0.safetensors").rename(directory / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for k, (names, _) in enumerate(files):
        file = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        (directory / f"shard-{k}.safetensors").rename(directory / file)
        weight_map |= dict.fromkeys(names, file)
    total = sum(size for _, size in files)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _parts(state: Mapping[str, torch.Tensor]) -> list[set[str]]:
    """``state``'s names, those outside the layers first, then each layer's (``...layers.<i>.``)."""
    parts: dict[int, set[str]] = {}
    for name in state:
        found = LAYER.search(name)
        parts.setdefault(-1 if found is None else int(found.group(1)), set()).add(name)
    return [parts[key] for key in sorted(parts)]


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Llama, Mistral, Qwen3, GPT-2 or DeepSeek-V3 directory (config.json + *.safetensors, possibly sharded)
    into our names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path = Path(path) / "config.json"
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
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors weights (convert .bin weights with transformers first)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file} is not a readable safetensors file ({err}); download it again") from None
    weights = family.from_hf(state, cfg, **family.weight_options(hf))
    _check_shapes(weights, cfg, path)
    return cfg, weights


def _check_shapes(weights: dict[str, torch.Tensor], cfg: ModelConfig, path: Path) -> None:
    """Weights of other shapes than the config describes are refused here, not when a run loads them."""
    from megatransformer.model.transformer import build_shapes

    expected = build_shapes(cfg).state_dict()
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{path}: weight {name} is {list(tensor.shape)}, its config.json describes {list(expected[name].shape)}"
            )
