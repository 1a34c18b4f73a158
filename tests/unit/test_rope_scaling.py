"""RoPE scaling (model.rope_scaling): transformers' frequencies for every rope type, cached generation
consistent with full forwards, and exports to Llama (rope_parameters) and Mistral (sliding_window) with the
logits of the real transformers models."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from support import models
from support.models import assert_exported_logits_match, randomized

from megatransformer.config import ConfigError, ModelConfig, dump_config, load_config, validate
from megatransformer.hf import GPT2, LLAMA, MISTRAL, hf_incompatibility, load_hf_dir, save_hf_dir
from megatransformer.hf.llama import llama_config
from megatransformer.model import build_model
from megatransformer.model.rope_scaling import rotary

transformers = pytest.importorskip("transformers")  # a test dependency: `pip install -e .[test]`

SCALINGS = {
    "linear": {"type": "linear", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 2.0, "original_max_seq_len": 16},
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_seq_len": 16},
    "yarn_tuned": {
        "type": "yarn",
        "factor": 8.0,
        "original_max_seq_len": 16,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "attention_factor": 1.3,
        "truncate": False,
    },
    "llama3": {
        "type": "llama3",
        "factor": 8.0,
        "original_max_seq_len": 16,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
}


def llama_style(**overrides) -> ModelConfig:
    small = {"n_layers": 2, "max_seq_len": 32, "rope_theta": 10000.0, "tie_embeddings": False}
    return models.llama_style(**{**small, **overrides})


@pytest.mark.parametrize("name", SCALINGS)
@pytest.mark.parametrize("length", [20, 80])
def test_frequencies_are_transformers(name, length):
    """Ours against transformers' ROPE_INIT_FUNCTIONS, for a call whose positions end at ``length``
    (dynamic scaling only changes anything beyond its original_max_seq_len = 16)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = llama_style(rope_scaling=SCALINGS[name])
    hf_config = transformers.LlamaConfig(**llama_config(cfg))
    positions = torch.arange(length).view(1, -1)
    want, want_factor = ROPE_INIT_FUNCTIONS[cfg.rope_scaling.type](hf_config, "cpu", torch.tensor(length))
    got, got_factor = rotary(cfg).frequencies(positions)
    assert torch.allclose(got, want, rtol=1e-6), (got - want).abs().max()
    assert got_factor == pytest.approx(want_factor)
    assert not torch.allclose(got, rotary(llama_style()).frequencies(positions)[0])


def test_rope_scaling_config_is_checked_by_type():
    for overrides, message in [
        (
            ["model.position=learned", "model.rope_scaling.type=linear", "model.rope_scaling.factor=2"],
            "model.rope_scaling needs model.position=rope",
        ),
        (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=2"], "type=yarn needs original_max_seq_len"),
        (
            ["model.rope_scaling.type=linear", "model.rope_scaling.factor=2", "model.rope_scaling.beta_fast=8"],
            "model.rope_scaling.beta_fast is for type yarn, not type=linear",
        ),
        (
            [
                "model.rope_scaling.type=llama3",
                "model.rope_scaling.factor=8",
                "model.rope_scaling.original_max_seq_len=8",
                "model.rope_scaling.high_freq_factor=1",
            ],
            "high_freq_factor=1.0 must exceed low_freq_factor=1.0",
        ),
        (["model.rope_scaling.type=linear", "model.rope_scaling.factor=0.5"], "factor"),
        (["model.rope_scaling.type=dynamic", "model.rope_scaling.factor=2"], "type=dynamic needs original_max_seq_len"),
        (
            ["model.rope_scaling={type: yarn, factor: 4, original_max_seq_len: 8192}", "model.max_seq_len=4096"],
            "model.rope_scaling.original_max_seq_len=8192 exceeds model.max_seq_len=4096: the extended context",
        ),
        (
            ["model.rope_scaling={type: yarn, factor: 4, original_max_seq_len: 64, beta_fast: 1, beta_slow: 32}"],
            r"model.rope_scaling.beta_fast=1.0 must exceed beta_slow=32.0 \(beta_fast bounds",
        ),
        (
            ["model.attention_window=4096", "model.max_seq_len=2048"],
            "model.attention_window=4096 exceeds model.max_seq_len=2048, so it never narrows attention",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_the_long_context_limits_allow_their_edge_and_alibi_windows_beyond_max_seq_len():
    """A window of max_seq_len, an original length of max_seq_len (dynamic from its first token), and ALiBi,
    which runs beyond max_seq_len, with a wider window."""
    load_config(None, ["model.attention_window=2048", "model.max_seq_len=2048"])
    load_config(None, ["model.rope_scaling={type: dynamic, factor: 2, original_max_seq_len: 2048}"])
    load_config(None, ["model.position=alibi", "model.attention_window=4096", "model.max_seq_len=2048"])


def test_the_readmes_long_context_example_is_a_valid_config():
    """README's Long context block, as written (it names no max_seq_len of its own: the rest is the default)."""
    from support import REPO

    text = (REPO / "README.md").read_text()
    block = text[text.index("### Long context") :].split("```yaml\n", 1)[1].split("```", 1)[0]
    validate(yaml.safe_load(block))


@pytest.mark.parametrize("name", SCALINGS)
def test_rope_scaling_survives_the_run_directorys_config_yaml(name):
    cfg = load_config(None, [f"model.rope_scaling={json.dumps(SCALINGS[name])}", "model.attention_window=64"])
    assert validate(yaml.safe_load(dump_config(cfg))) == cfg


@pytest.mark.parametrize("name", ["linear", "yarn", "llama3"])
def test_cached_decoding_sees_the_positions_of_a_full_forward(name):
    """Each cached step's logits equal the full forward's at that position, beyond the original context."""
    torch.manual_seed(0)
    model = build_model(llama_style(rope_scaling=SCALINGS[name], attention_window=12)).eval()
    ids = torch.randint(0, 211, (2, 40))
    caches = model.new_caches(2, 40)
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :24], caches=caches)[:, -1]]
        steps += [model(ids[:, i : i + 1], caches=caches)[:, -1] for i in range(24, 40)]
    assert torch.allclose(torch.stack(steps, 1), full[:, 23:], atol=1e-5)


def test_dynamic_scaling_follows_the_longest_position_of_each_call():
    """As transformers does: within the trained length (original_max_seq_len) plain RoPE; beyond it the base
    grows with the call's length."""
    cfg = llama_style(rope_scaling=SCALINGS["dynamic"])
    plain = rotary(llama_style())
    short, long = torch.arange(16).view(1, -1), torch.arange(32).view(1, -1)
    assert torch.equal(rotary(cfg)(short, torch.float32)[0], plain(short, torch.float32)[0])
    assert not torch.allclose(rotary(cfg)(long, torch.float32)[0], plain(long, torch.float32)[0])


# ----------------------------------------------------------------------------------- export and import


@pytest.mark.parametrize("name", SCALINGS)
def test_scaled_rope_exports_to_llama_with_the_same_logits(tmp_path, name):
    """48 positions: beyond the original 16 of yarn, llama3 and dynamic, and beyond max_seq_len."""
    assert_exported_logits_match(tmp_path / "hf", llama_style(rope_scaling=SCALINGS[name]), LLAMA, 48)


@pytest.mark.parametrize("scaling", [None, "yarn"])
def test_a_sliding_window_exports_to_mistral_with_the_same_logits(tmp_path, scaling):
    cfg = llama_style(attention_window=7, rope_scaling=SCALINGS.get(scaling))
    assert_exported_logits_match(tmp_path / "hf", cfg, MISTRAL, 30)


def test_dynamic_scaling_decodes_with_a_kv_cache_as_transformers_does(tmp_path):
    """Past the trained length each decoding step rotates its query and key with the base of its own length
    while the cached keys keep theirs: transformers' cached decoding, step by step, from 24 to 48 positions."""
    cfg = llama_style(rope_scaling=SCALINGS["dynamic"])
    torch.manual_seed(0)
    ours = randomized(build_model(cfg)).eval()
    save_hf_dir(tmp_path / "hf", cfg, ours.state_dict())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    caches = ours.new_caches(2, 48)
    with torch.no_grad():
        want = theirs(ids[:, :24], use_cache=True)
        got = [ours(ids[:, :24], caches=caches)[:, -1]]
        past, expected = want.past_key_values, [want.logits[:, -1]]
        for i in range(24, 48):
            step = theirs(ids[:, i : i + 1], past_key_values=past, use_cache=True)
            past = step.past_key_values
            expected.append(step.logits[:, -1])
            got.append(ours(ids[:, i : i + 1], caches=caches)[:, -1])
    assert (torch.stack(got) - torch.stack(expected)).abs().max().item() < 1e-5


def test_a_window_without_a_family_is_refused_with_each_reason():
    gpt2 = models.gpt2_style(n_layers=2, attention_window=8)
    reason = hf_incompatibility(gpt2)
    assert "model.attention_window=8 (Llama needs None)" in reason
    assert "model.norm=layernorm (Mistral needs rmsnorm)" in reason
    assert "model.attention_window=8 (GPT-2 needs None)" in reason
    assert GPT2.incompatibility(gpt2.model_copy(update={"attention_window": None})) is None


def test_legacy_rope_scaling_and_unsupported_rope_types_on_import(tmp_path):
    """Configs written by transformers 4.x name the scaling ``rope_scaling`` and keep rope_theta apart."""
    cfg = llama_style()
    save_hf_dir(tmp_path / "hf", cfg, build_model(cfg).state_dict())
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    del config["rope_parameters"]
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    path.write_text(json.dumps(config))
    imported, _ = load_hf_dir(tmp_path / "hf")
    assert imported == llama_style(rope_scaling=SCALINGS["llama3"])
    config["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_type=longrope is not supported"):
        load_hf_dir(tmp_path / "hf")
