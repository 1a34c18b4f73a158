"""RoPE between our config and transformers' ``rope_parameters`` (of every Llama-like family)."""

from __future__ import annotations

from megatransformer.config import ModelConfig, RopeScaling, validate

# transformers' rope_parameters keys of each scaled rope type: (their key, our RopeScaling field). Dynamic NTK's
# trained length is transformers' max_position_embeddings (see model_config_from_llama).
_ROPE_KEYS = {
    "linear": [("factor", "factor")],
    "dynamic": [("factor", "factor")],
    "yarn": [
        ("factor", "factor"),
        ("original_max_position_embeddings", "original_max_seq_len"),
        ("beta_fast", "beta_fast"),
        ("beta_slow", "beta_slow"),
        ("attention_factor", "attention_factor"),
        ("truncate", "truncate"),
    ],
    "llama3": [
        ("factor", "factor"),
        ("original_max_position_embeddings", "original_max_seq_len"),
        ("low_freq_factor", "low_freq_factor"),
        ("high_freq_factor", "high_freq_factor"),
    ],
}
# rope_parameters keys that change nothing at these values (transformers' own defaults)
_NEUTRAL_ROPE_KEYS = {"partial_rotary_factor": 1.0}


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' ``rope_parameters`` of a rope model."""
    scaling = cfg.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    keys = {theirs: getattr(scaling, ours) for theirs, ours in _ROPE_KEYS[scaling.type]}
    return {
        "rope_type": scaling.type,
        "rope_theta": cfg.rope_theta,
        **{key: value for key, value in keys.items() if value is not None},
    }


def max_position_embeddings(cfg: ModelConfig) -> int:
    """transformers' ``max_position_embeddings``: for dynamic NTK the trained length where its scaling starts
    (``rope_scaling.original_max_seq_len``), else model.max_seq_len."""
    scaling = cfg.rope_scaling
    return scaling.original_max_seq_len if scaling is not None and scaling.type == "dynamic" else cfg.max_seq_len


def rope_scaling_from(rope: dict, max_positions: int) -> RopeScaling | None:
    """Our rope scaling for transformers' ``rope_parameters`` (or a legacy ``rope_scaling``) dict of a config whose
    ``max_position_embeddings`` is ``max_positions``."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", *_ROPE_KEYS):
        raise ValueError(f"rope_type={rope_type} is not supported (default, {', '.join(_ROPE_KEYS)} are)")
    known = {theirs for theirs, _ in _ROPE_KEYS.get(rope_type, [])} | {"rope_type", "type", "rope_theta"}
    for key, value in rope.items():
        if key in known or value is None or _NEUTRAL_ROPE_KEYS.get(key) == value:
            continue
        if rope_type != "default" or key in _NEUTRAL_ROPE_KEYS:  # (plain RoPE reads no other key)
            raise ValueError(f"rope_type={rope_type} with {key}={value} is not supported")
    if rope_type == "default":
        return None
    fields = {ours: rope[theirs] for theirs, ours in _ROPE_KEYS[rope_type] if rope.get(theirs) is not None}
    if rope_type == "dynamic":  # (its trained length is max_position_embeddings)
        fields["original_max_seq_len"] = max_positions
    elif rope_type in ("yarn", "llama3"):  # (transformers' default where the key is absent)
        fields.setdefault("original_max_seq_len", max_positions)
    return validate({"type": rope_type, **fields}, RopeScaling)
