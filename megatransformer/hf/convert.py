"""The families, and whole ``transformers`` model directories written and read through them."""

from __future__ import annotations

import json
import shutil
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
    state: dict[str, torch.Tensor],
    tokenizer_json: Path | None = None,
    special_ids: dict[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
    family: Family | None = None,
) -> Family:
    """Write a ``transformers`` model directory (config.json, model.safetensors, tokenizer files) that loads with
    no custom code, for ``family`` (default: the first one ``cfg`` maps onto). Written to a temporary directory,
    renamed when complete."""
    from megatransformer.checkpoint import save_safetensors

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
    tensors = {k: v.detach().to(dtype).contiguous().clone() for k, v in family.to_hf(state, cfg).items()}
    save_safetensors(tensors, tmp / "model.safetensors")
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
