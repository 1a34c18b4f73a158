"""``megatransformer export --format hf`` then ``import --hf``, in-process, for every family: the imported
checkpoint computes the logits of the exported one; damaged directories are refused in one line."""

from __future__ import annotations

import argparse
import json
import shutil
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


def _safetensors_header(data: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _with_header(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def _one_shape_past_its_bytes(data: bytes) -> bytes:
    header, body = _safetensors_header(data)
    name = next(name for name in header if name != "__metadata__")
    header[name] = {**header[name], "shape": [header[name]["shape"][0] * 1000, *header[name]["shape"][1:]]}
    return _with_header(header, body)


def _without(key: str):
    return lambda config: {k: v for k, v in config.items() if k != key}


DAMAGES = {  # what is done to an exported Llama directory, and what the refusal names
    "truncated weights": ("model.safetensors", lambda data: data[: len(data) // 2], "not a readable safetensors"),
    "garbled header": ("model.safetensors", lambda data: data[:8] + bytes(100) + data[108:], "not a readable"),
    "huge header length": ("model.safetensors", lambda data: struct.pack("<Q", 2**62) + data[8:], "not a readable"),
    "a shape past its bytes": ("model.safetensors", _one_shape_past_its_bytes, "not a readable safetensors"),
    "config a JSON list": ("config.json", lambda config: [config], "holds a JSON list"),
    "config not JSON": ("config.json", lambda config: "{not json", "is not JSON"),
    "no num_hidden_layers": ("config.json", _without("num_hidden_layers"), "lacks 'num_hidden_layers'"),
}


@pytest.fixture(scope="module")
def exported_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    cfg = run_config(model=FAMILY_MODELS[LLAMA])
    write_weights_checkpoint(directory / "ours", cfg, build_model(cfg.model).state_dict())
    export(argparse.Namespace(checkpoint=str(directory / "ours"), out=str(directory / "hf"), format="hf", dtype="fp32"))
    return directory / "hf"


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_directory_is_refused_in_one_line(tmp_path, exported_llama, damage):
    name, change, message = DAMAGES[damage]
    directory = tmp_path / "hf"
    shutil.copytree(exported_llama, directory)
    file = directory / name
    if name == "config.json":
        changed = change(json.loads(file.read_text()))
        file.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    else:
        file.write_bytes(change(file.read_bytes()))
    with pytest.raises(ConfigError, match=message) as refusal:
        import_hf(argparse.Namespace(hf=str(directory), out=str(tmp_path / "out")))
    assert "\n" not in str(refusal.value) and name in str(refusal.value)


@pytest.mark.parametrize("family", [GPT2, QWEN3], ids=lambda family: family.model_type)
def test_a_tied_checkpoint_holding_another_output_head_is_refused_in_one_line(tmp_path, family):
    """(GPT-2: imported with the embedding as its head, 36 logits away from transformers' reading of the file.)"""
    from safetensors.torch import load_file, save_file

    cfg = run_config(model=FAMILY_MODELS[family])
    torch.manual_seed(0)
    write_weights_checkpoint(tmp_path / "ours", cfg, randomized(build_model(cfg.model)).state_dict())
    export(argparse.Namespace(checkpoint=str(tmp_path / "ours"), out=str(tmp_path / "hf"), format="hf", dtype="fp32"))
    file = tmp_path / "hf" / "model.safetensors"
    state = load_file(file)
    embedding = next(name for name in state if name.endswith(("wte.weight", "embed_tokens.weight")))
    save_file({**state, "lm_head.weight": state[embedding] + 1.0}, file, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="tied .* but holds a lm_head.weight that differs from") as refusal:
        import_hf(argparse.Namespace(hf=str(tmp_path / "hf"), out=str(tmp_path / "back")))
    assert "\n" not in str(refusal.value) and "by up to 1" in str(refusal.value)
    save_file({**state, "lm_head.weight": state[embedding].clone()}, file, metadata={"format": "pt"})
    assert import_hf(argparse.Namespace(hf=str(tmp_path / "hf"), out=str(tmp_path / "back"))) == 0  # (the same)
