"""Config loading, overrides, one-line errors, the shipped configs, model size and FLOPs."""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from support import REPO

from data_pipeline.settings import Dataset, DataSettings, ObjectiveArgs
from megatransformer.config import ConfigError, RunConfig, apply_overrides, dump_config, load_config
from megatransformer.config.loading import _model_in
from megatransformer.flops import model_size
from megatransformer.model import build_model

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_every_required_config_is_shipped():
    names = {p.stem for p in CONFIGS}
    assert {"quickstart", "transformer-base", "transformer-big", "llama-style", "bert-style", "t5-style"} <= names


def test_paper_base_model_has_the_papers_size():
    cfg = load_config(REPO / "configs/transformer-base.yaml").model
    assert (cfg.norm_position, cfg.position, cfg.ffn, cfg.vocab_size) == ("post", "sinusoidal", "relu", 37000)
    assert 60e6 < model_size(cfg).params < 66e6  # the paper reports 65M


def small_untied_model():
    overrides = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=128", "model.vocab_size=300"]
    return load_config(None, [*overrides, "model.tie_embeddings=false"]).model


def test_param_count_matches_built_model():
    cfg = small_untied_model()
    model = build_model(cfg)
    assert model_size(cfg).params == sum(p.numel() for p in model.parameters())
    assert model_size(cfg).non_embedding_params == model_size(cfg).params - 300 * 64


def test_flops_per_token_is_6n_plus_attention():
    cfg = small_untied_model()
    linear = sum(m.weight.numel() for m in build_model(cfg).modules() if isinstance(m, torch.nn.Linear))
    assert model_size(cfg, 100).flops_per_token == 6 * linear + 12 * 2 * 64 * 100


def test_overrides_parse_yaml_values():
    raw = apply_overrides(
        {}, ["model.d_model=64", "optim.betas=[0.9, 0.98]", "wandb.mode=disabled", "train.compile=true", "resume="]
    )
    assert raw == {
        "model": {"d_model": 64},
        "optim": {"betas": [0.9, 0.98]},
        "wandb": {"mode": "disabled"},
        "train": {"compile": True},
        "resume": None,
    }


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(CONFIGS[0], ["seed=7"])
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.d_modle=64"], "unknown config key 'model.d_modle'; did you mean 'model.d_model'?"),
        (["trian.max_steps=3"], "did you mean 'train'?"),
        (["model.d_model=100"], "model.d_model=100 is not divisible by model.n_heads=8"),
        (["model.n_kv_heads=3"], "model.n_heads=8 is not divisible by model.n_kv_heads=3"),
        (["parallel.tensor_parallel=3"], "parallel.tensor_parallel=3 does not divide model.n_heads=8"),
        (
            ["model.n_heads=6", "model.d_model=384", "parallel.tensor_parallel=3", "model.d_ff=1000"],
            "parallel.tensor_parallel=3 does not divide model.d_ff=1000",
        ),
        (["parallel.tensor_parallel=2", "model.vocab_size=32001"], "does not divide model.vocab_size=32001"),
        (["objective=span_corruption"], "objective=span_corruption needs model.arch in ['encoder_decoder']"),
        (["data.seq_len=4096"], "data.seq_len=4096 exceeds model.max_seq_len=2048"),
        (["train.max_steps=ten"], "config key 'train.max_steps'"),
        (["model.attention_backend=flash2"], "config key 'model.attention_backend'"),
        (["model.d_model"], "is not of the form key.path=value"),
    ],
)
def test_bad_values_give_one_precise_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text,message",
    [("model: [1, 2]", "config key 'model'"), ("- a\n- b", "mapping"), ("model: {d_model: 64", "not valid YAML")],
)
def test_malformed_files_are_config_errors(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_retired_key_is_refused_with_why_and_dropped_from_a_saved_config(tmp_path):
    from megatransformer.checkpoint.files import saved_config

    for given in (["checkpoint.dtype=bf16"], []):
        path = tmp_path / "run.yaml"
        path.write_text("checkpoint: {dtype: bf16}\n")
        with pytest.raises(
            ConfigError, match=r"^checkpoint.dtype is no longer a setting \(.*export --dtype.*\); remove it$"
        ):
            load_config(os.devnull if given else path, given)
    saved = tmp_path / "step_000001"
    saved.mkdir()
    written = yaml.safe_load(dump_config(load_config("quickstart")))  # (by a version that had the key)
    written["checkpoint"] |= {"every": 7, "dtype": "fp32"}
    (saved / "config.yaml").write_text(yaml.safe_dump(written))
    assert saved_config(saved).checkpoint.every == 7


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_every_field_is_documented():
    def fields(section):  # a pydantic model, or a pydantic dataclass of data_pipeline's
        return getattr(section, "model_fields", None) or getattr(section, "__pydantic_fields__", None)

    def sections(model):
        yield model
        for field in fields(model).values():
            inner = _model_in(field.annotation)  # (also inside ``str | list[X] | None``)
            if inner is not None:
                yield from sections(inner)

    found = list(sections(RunConfig))
    assert {ObjectiveArgs, DataSettings, Dataset} <= set(found)
    for section in found:
        for name, field in fields(section).items():
            if not (isinstance(field.annotation, type) and fields(field.annotation)):
                assert field.description, f"{section.__name__}.{name} has no docstring"
