"""Mapping between our decoder and Hugging Face ``LlamaForCausalLM`` (config and weight names).

A decoder with pre-LN, rmsnorm, rope and swiglu, without biases or absolute positions, is exactly a Llama
model; anything else is refused with the option that prevents the mapping.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from megatransformer.config import ModelConfig

# (our name, Llama name) templates; {i} is the layer index
_LAYER_NAMES = [
    ("decoder.layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("decoder.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("decoder.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("decoder.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("decoder.layers.{i}.self_attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("decoder.layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("decoder.layers.{i}.ffn.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("decoder.layers.{i}.ffn.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("decoder.layers.{i}.ffn.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
]
_GLOBAL_NAMES = [
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("decoder.norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]


def llama_incompatibility(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be a LlamaForCausalLM, or None when it can."""
    required = {
        "arch": "decoder", "norm_position": "pre", "norm": "rmsnorm", "position": "rope", "ffn": "swiglu",
        "bias": False, "scale_embeddings": False, "final_norm": True,
    }
    for field, value in required.items():
        if getattr(cfg, field) != value:
            return f"model.{field}={getattr(cfg, field)} (Llama needs {value})"
    return None


def llama_config(cfg: ModelConfig) -> dict:
    """``LlamaConfig`` keyword arguments equivalent to ``cfg``."""
    reason = llama_incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as LlamaForCausalLM: {reason}")
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=False, mlp_bias=False, hidden_act="silu",
        attention_dropout=cfg.attention_dropout,
    )


def model_config_from_llama(hf: dict) -> ModelConfig:
    """Our ModelConfig for a Llama ``config.json`` dict."""
    rope = hf.get("rope_parameters") or {}
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise ValueError(f"Llama head_dim={head_dim} x heads={heads} != hidden_size={hf['hidden_size']}")
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"Llama rope_type={rope['rope_type']} is not supported (only default rope)")
    return ModelConfig(
        arch="decoder", d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, d_ff=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), position="rope",
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)), ffn="swiglu", bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _name_pairs(n_layers: int) -> list[tuple[str, str]]:
    pairs = list(_GLOBAL_NAMES)
    for i in range(n_layers):
        pairs += [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in _LAYER_NAMES]
    return pairs


def to_llama_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {theirs: state[ours] for ours, theirs in _name_pairs(cfg.n_layers)}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight")
    return out


def from_llama_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = {re.sub(r"^model\.model\.", "model.", k): v for k, v in state.items()}
    if cfg.tie_embeddings:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    missing = [theirs for _, theirs in _name_pairs(cfg.n_layers) if theirs not in state]
    if missing:
        raise ValueError(f"Llama checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    return {ours: state[theirs] for ours, theirs in _name_pairs(cfg.n_layers)}


def save_llama_dir(
    out: Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer_json: Path | None = None,
    special_ids: dict[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write a ``LlamaForCausalLM`` directory (config.json, model.safetensors, tokenizer files) that
    ``transformers`` loads with no custom code. Written to a temporary directory, renamed when complete."""
    from safetensors.torch import save_file

    special_ids = special_ids or {}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        **llama_config(cfg), "rope_theta": cfg.rope_theta,
        "bos_token_id": special_ids.get("bos"), "eos_token_id": special_ids.get("eos"),
        "pad_token_id": special_ids.get("pad"), "torch_dtype": str(dtype).removeprefix("torch."),
    }
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to(dtype).contiguous().clone() for k, v in to_llama_state_dict(state, cfg).items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": special_ids.get("bos"), "eos_token_id": special_ids.get("eos"),
         "pad_token_id": special_ids.get("pad")}, indent=2))
    if tokenizer_json is not None:
        shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
        names = {"bos": "bos_token", "eos": "eos_token", "pad": "pad_token", "unk": "unk_token"}
        tokens = json.loads(Path(tokenizer_json).read_text()).get("added_tokens", [])
        by_id = {t["id"]: t["content"] for t in tokens}
        tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len}
        tok_config.update({names[k]: by_id[i] for k, i in special_ids.items() if k in names and i in by_id})
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def load_llama_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Llama-format directory (config.json + *.safetensors, possibly sharded) into our names."""
    from safetensors.torch import load_file

    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} has no config.json; expected a Hugging Face model directory")
    hf = json.loads(config_path.read_text())
    if hf.get("model_type") != "llama":
        raise ValueError(f"{path} holds model_type={hf.get('model_type')!r}; only 'llama' can be imported")
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors weights (convert .bin weights with transformers first)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    cfg = model_config_from_llama(hf)
    return cfg, from_llama_state_dict(state, cfg)
