"""Numerical parity with independent implementations: Hugging Face LlamaForCausalLM and GPT2LMHeadModel."""

from __future__ import annotations

import json

import pytest
import torch
from support.memory import peak_host_bytes
from support.models import ReadOnLookup, assert_exported_logits_match, gpt2_style, llama_style, run_config

from megatransformer.checkpoint import load_weights, write_weights_checkpoint
from megatransformer.hf import GPT2, LLAMA, hf_incompatibility, load_hf_dir, save_hf_dir
from megatransformer.hf.llama import from_llama_state_dict, llama_config, to_llama_state_dict
from megatransformer.model import build_model

transformers = pytest.importorskip("transformers")  # a test dependency: `pip install -e .[test]`


@pytest.mark.parametrize("tie", [False, True])
def test_llama_logits_match_transformers(tie):
    cfg = llama_style(tie_embeddings=tie)
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(cfg))).eval()
    missing, unexpected = theirs.load_state_dict(to_llama_state_dict(ours.state_dict(), cfg), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set())
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids)
    assert (got - expected).abs().max().item() < 1e-5


def test_llama_weights_round_trip():
    cfg = llama_style()
    ours = build_model(cfg)
    back = from_llama_state_dict(to_llama_state_dict(ours.state_dict(), cfg), cfg)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize(
    "option,value",
    [("norm", "layernorm"), ("position", "learned"), ("ffn", "gelu"), ("norm_position", "post"), ("arch", "encoder")],
)
def test_non_llama_configs_are_refused_by_name(option, value):
    reason = LLAMA.incompatibility(llama_style(**{option: value}))
    assert reason is not None and option in reason


# ------------------------------------------------------------------------------------------------ GPT-2


@pytest.mark.parametrize("family,cfg", [(LLAMA, llama_style(tie_embeddings=False)), (GPT2, gpt2_style())])
def test_exported_directory_loads_in_transformers_with_the_same_logits(tmp_path, family, cfg):
    assert_exported_logits_match(tmp_path / "hf", cfg, family)


@pytest.mark.parametrize("family,cfg", [(LLAMA, llama_style(tie_embeddings=True)), (GPT2, gpt2_style())])
def test_an_export_larger_than_a_shard_is_written_in_shards_that_transformers_loads(tmp_path, family, cfg):
    """As save_pretrained writes them: files of at most the shard's bytes (a larger tensor alone), and their index."""
    from safetensors import safe_open

    limit = sum(t.nbytes for t in build_model(cfg).state_dict().values()) // 5
    assert_exported_logits_match(tmp_path / "hf", cfg, family, shard_bytes=limit)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 4 and sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors")) == files
    total = 0
    for file in files:
        with safe_open(str(tmp_path / "hf" / file), framework="pt") as f:
            sizes = [f.get_tensor(name).nbytes for name in f.keys()]
            assert sorted(f.keys()) == sorted(n for n, held in index["weight_map"].items() if held == file)
        assert sum(sizes) <= limit or len(sizes) == 1, (file, sizes)
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total


def test_an_export_reads_a_layer_at_a_time_and_holds_a_shard_never_the_model(tmp_path):
    """From weights read on lookup (as `export --format hf` reads a checkpoint): torch's host allocator holds a
    layer's tensors and a shard at most, never the model (the whole state: 1.0); and from a weights checkpoint the
    same tensors."""
    cfg = llama_style(n_layers=12, d_model=128, d_ff=256, vocab_size=64, tie_embeddings=False)
    state = build_model(cfg).state_dict()
    whole = sum(t.nbytes for t in state.values())
    peak = peak_host_bytes(lambda: save_hf_dir(tmp_path / "hf", cfg, ReadOnLookup(state), shard_bytes=whole // 12))
    assert peak < 0.35 * whole, (peak, whole)
    path = write_weights_checkpoint(tmp_path / "weights", run_config(model=cfg.model_dump()), state)
    _, lazy = load_weights(path, lazy=True)
    save_hf_dir(tmp_path / "from_checkpoint", cfg, lazy, shard_bytes=whole // 12)
    for directory in ("hf", "from_checkpoint"):
        back = dict(load_hf_dir(tmp_path / directory)[1])
        for name, tensor in state.items():
            assert torch.equal(back[name], tensor), (directory, name)


@pytest.mark.parametrize(
    "option,value",
    [
        ("norm", "rmsnorm"),
        ("position", "rope"),
        ("ffn", "relu"),
        ("bias", False),
        ("tie_embeddings", False),
        ("n_kv_heads", 2),
    ],
)
def test_non_gpt2_configs_are_refused_by_name(option, value):
    reason = hf_incompatibility(gpt2_style(**{option: value}))
    assert reason is not None and f"model.{option}=" in reason and "GPT-2 needs" in reason


def test_gpt2_with_the_tanh_gelu_is_not_imported(tmp_path):
    cfg = gpt2_style()
    save_hf_dir(tmp_path / "hf", cfg, build_model(cfg).state_dict())
    config = tmp_path / "hf" / "config.json"
    config.write_text(config.read_text().replace('"activation_function": "gelu"', '"activation_function": "gelu_new"'))
    with pytest.raises(ValueError, match="activation_function='gelu_new' is not supported"):
        load_hf_dir(tmp_path / "hf")
