"""``megatransformer export --format hf`` then ``import --hf``, in-process, for every family: the imported
checkpoint computes the logits of the exported one; damaged directories are refused in one line."""

from __future__ import annotations

import argparse
import json
import struct

import pytest
import torch
from support.models import randomized, run_config

from megatransformer.checkpoint import load_weights, write_weights_checkpoint
from megatransformer.commands.export import export, import_hf
from megatransformer.config import ConfigError
from megatransformer.hf import DEEPSEEK_V3, GPT2, LLAMA, MISTRAL, QWEN3, hf_family
from megatransformer.model import build_model

SMALL = dict(d_model=32, n_layers=2, n_heads=4, d_ff=48, vocab_size=97, max_seq_len=32)
LLAMA_LIKE = dict(SMALL, n_kv_heads=2, norm="rmsnorm", position="rope", ffn="swiglu", bias=False)
FAMILY_MODELS = {  # a small model that each family's exporter picks
    LLAMA: LLAMA_LIKE,
    MISTRAL: dict(LLAMA_LIKE, attention_window=6),
    QWEN3: dict(LLAMA_LIKE, qk_norm=True, tie_embeddings=True),
    GPT2: dict(SMALL, norm="layernorm", position="learned", ffn="gelu", bias=True, tie_embeddings=True),
    DEEPSEEK_V3: dict(
        SMALL,
        norm="rmsnorm",
        position="rope",
        ffn="swiglu",
        attention="mla",
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
    ),
}


def _logits(cfg, weights, ids):
    model = build_model(cfg.model).eval()
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("family", list(FAMILY_MODELS), ids=lambda family: family.model_type)
def test_export_then_import_gives_the_same_logits(tmp_path, family):
    cfg = run_config(model=FAMILY_MODELS[family])
    assert hf_family(cfg.model) is family
    torch.manual_seed(0)
    weights = randomized(build_model(cfg.model)).state_dict()
    write_weights_checkpoint(tmp_path / "ours", cfg, weights)
    args = argparse.Namespace(checkpoint=str(tmp_path / "ours"), out=str(tmp_path / "hf"), format="hf", dtype="fp32")
    assert export(args) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [family.architecture]
    assert import_hf(argparse.Namespace(hf=str(tmp_path / "hf"), out=str(tmp_path / "back"))) == 0
    back_cfg, back = load_weights(tmp_path / "back")
    assert back_cfg.model.model_dump() == cfg.model.model_dump()
    ids = torch.randint(0, cfg.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(back_cfg, back, ids), _logits(cfg, weights, ids))
