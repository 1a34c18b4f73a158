"""Every bad config value is refused up front: exit 2, one line on stderr naming the key and the value, no
traceback. Values the schema can judge on its own go through the in-process CLI (`megatransformer info`,
which validates without training); what needs the machine or the files goes through real `megatransformer
train` processes in tests/e2e/test_config_cli.py."""

from __future__ import annotations

import os

import pytest
import yaml
from support import assert_one_line

from megatransformer.cli import main
from megatransformer.config import MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB, MAX_WIDTH, UniqueKeyLoader, load_config

# (override, what the one line must contain: the key and the offending value)
BAD_VALUES = [
    # model
    ("model.d_model=0", "model.d_model=0 must be > 0"),
    ("model.n_layers=0", "model.n_layers=0"),
    ("model.n_heads=-2", "model.n_heads=-2"),
    ("model.n_kv_heads=0", "model.n_kv_heads=0 must be > 0"),  # accepted, it would train MHA silently
    ("model.n_decoder_layers=0", "model.n_decoder_layers=0"),
    ("model.d_ff=0", "model.d_ff=0"),
    ("model.vocab_size=0", "model.vocab_size=0"),
    ("model.vocab_size=1000000000", f"model.vocab_size=1000000000 must be <= {MAX_VOCAB}"),
    ("model.max_seq_len=-1", "model.max_seq_len=-1"),
    ("model.n_layers=1000000", f"model.n_layers=1000000 must be <= {MAX_LAYERS}"),
    ("model.n_decoder_layers=1000000", f"model.n_decoder_layers=1000000 must be <= {MAX_LAYERS}"),
    ("model.d_model=1000000000", f"model.d_model=1000000000 must be <= {MAX_WIDTH}"),
    ("model.d_ff=1000000000", f"model.d_ff=1000000000 must be <= {MAX_WIDTH}"),
    ("model.max_seq_len=1000000000", f"model.max_seq_len=1000000000 must be <= {MAX_SEQ_LEN}"),
    ("model.norm_eps=-1", "model.norm_eps=-1 must be > 0"),  # accepted, it would train to NaN and exit 0
    ("model.norm_eps=0", "model.norm_eps=0"),
    ("model.rope_theta=0", "model.rope_theta=0 must be > 0"),  # accepted, it would train to NaN and exit 0
    ("model.rope_theta=.nan", "model.rope_theta=nan must be a finite number"),
    ("model.dropout=1.0", "model.dropout=1.0 must be < 1"),
    ("model.attention_dropout=-0.1", "model.attention_dropout=-0.1 must be >= 0"),
    ("model.embedding_dropout=1.5", "model.embedding_dropout=1.5"),
    ("model.init_std=0", "model.init_std=0"),
    # data
    ("data.seq_len=0", "data.seq_len=0"),
    ("data.num_workers=-1", "data.num_workers=-1 must be >= 0"),
    ("data.shuffle_buffer=-5", "data.shuffle_buffer=-5"),
    ("data.train=[{path: shards, weight: -1}]", "data.train[0].weight=-1 must be > 0"),
    # objective_args
    ("objective_args.mask_prob=1.5", "objective_args.mask_prob=1.5 must be <= 1"),
    ("objective_args.noise_density=-0.1", "objective_args.noise_density=-0.1"),
    (
        "objective_args.mask_token_prob=0.95",
        "objective_args.mask_token_prob + random_token_prob must be <= 1, got 0.95 + 0.1",
    ),
    ("objective_args.prefix_min=0.95", "objective_args.prefix_min must be <= prefix_max, got 0.95, 0.9"),
    ("objective_args.mask_pro=0.1", "did you mean 'objective_args.mask_prob'?"),
    ("objective_args.prefix_max=1.5", "objective_args.prefix_max=1.5"),
    ("objective_args.mean_noise_span_length=0.5", "objective_args.mean_noise_span_length=0.5 must be >= 1"),
    # train
    ("train.max_steps=-1", "train.max_steps=-1"),
    ("train.max_steps=false", "train.max_steps=false must be a number, not a boolean"),
    ("train.micro_batch_size=0", "train.micro_batch_size=0"),
    ("train.grad_accum=0", "train.grad_accum=0"),
    ("train.global_batch_size=-8", "train.global_batch_size=-8"),
    ("train.grad_clip=-1", "train.grad_clip=-1 must be >= 0"),
    ("train.label_smoothing=1.5", "train.label_smoothing=1.5 must be < 1"),
    ("train.label_smoothing=-0.1", "train.label_smoothing=-0.1 must be >= 0"),
    ("train.z_loss=-1e-4", "train.z_loss=-1e-4 must be >= 0"),
    ("train.log_every=0", "train.log_every=0"),
    ("train.eval_every=-1", "train.eval_every=-1 must be >= 0"),  # accepted, it would evaluate every step
    ("train.eval_batches=0", "train.eval_batches=0"),
    ("train.max_bad_steps=0", "train.max_bad_steps=0 must be >= 1"),  # accepted, it would stop after one good step
    ("train.host_memory=cache", "'train.host_memory': Input should be 'keep' or 'release' (got 'cache')"),
    ("train.cpu_bf16_matmul=fast", "'train.cpu_bf16_matmul': Input should be 'auto', 'fp32' or 'native' (got 'fast')"),
    ("train.peak_tflops=-3", "train.peak_tflops=-3"),
    # optim
    ("optim.lr=-1", "optim.lr=-1 must be >= 1e-10"),
    ("optim.lr=0", "optim.lr=0 must be >= 1e-10"),
    ("optim.lr=5e-324", "optim.lr=5e-324 must be >= 1e-10"),  # accepted, it trained doing nothing
    ("optim.lr=true", "optim.lr=true must be a number, not a boolean"),  # accepted, it trained at 1.0
    ("optim.betas=[true, 0.9]", "optim.betas=[true, 0.9] must be a number, not a boolean"),
    ("optim.lr=.nan", "optim.lr=nan must be a finite number"),
    ("optim.lr=nan", "optim.lr=nan must be a finite number"),
    ("optim.lr=.inf", "optim.lr=inf must be a finite number"),
    ("optim.lr=1e10", "optim.lr=1e10 must be <= 10"),  # accepted, it trained a dead model and exited 0
    ("optim.muon_lr=1e10", "optim.muon_lr=1e10 must be <= 10"),  # accepted, it trained a dead model and exited 0
    ("optim.betas=[0.9, 1.5]", "optim.betas[1]=1.5 must be < 1"),
    ("optim.betas=[-0.1, 0.99]", "optim.betas[0]=-0.1 must be >= 0"),
    ("optim.betas=[0.9, .nan]", "optim.betas[1]=nan must be a finite number"),
    ("optim.eps=0", "optim.eps=0 must be > 0"),
    ("optim.eps=-1e-8", "optim.eps=-1e-8 must be > 0"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must be >= 0"),
    # schedule
    ("schedule.warmup_steps=-10", "schedule.warmup_steps=-10 must be >= 0"),
    ("schedule.min_lr_ratio=1.5", "schedule.min_lr_ratio=1.5 must be <= 1"),
    ("schedule.min_lr_ratio=-0.1", "schedule.min_lr_ratio=-0.1 must be >= 0"),
    # checkpoint
    ("checkpoint.every=0", "checkpoint.every=0 must be > 0"),  # accepted, it would divide by zero after step 1
    ("checkpoint.every=-5", "checkpoint.every=-5"),  # accepted, it would checkpoint every step
    ("checkpoint.keep=0", "checkpoint.keep=0"),
    # parallel
    ("parallel.tensor_parallel=0", "parallel.tensor_parallel=0"),
    ("parallel.zero_stage=true", "parallel.zero_stage=true must be a number, not a boolean"),
    ("parallel.timeout_minutes=0", "parallel.timeout_minutes=0 must be > 0"),
    ("parallel.timeout_minutes=.inf", "parallel.timeout_minutes=inf must be a finite number"),
    ("parallel.timeout_minutes=1e12", "parallel.timeout_minutes=1e12 must be <= 10080"),
    # run
    ("seed=-1", "seed=-1 must be >= 0"),
    ("run_dir=''", "run_dir must not be empty"),
]


def key_of(override: str) -> str:
    return override.partition("=")[0]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(argv)
    captured = capsys.readouterr()
    assert captured.out == "", "a refused config printed to stdout"
    return code, captured.err


def test_the_table_covers_at_least_40_values_and_every_section():
    assert len(BAD_VALUES) >= 40
    sections = {key_of(o).split(".")[0] for o, _ in BAD_VALUES if "." in key_of(o)}
    assert sections == {"model", "data", "objective_args", "train", "optim", "schedule", "checkpoint", "parallel"}


@pytest.mark.parametrize("override,line", BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_bad_value_exits_2_with_one_line_naming_key_and_value(override, line, capsys):
    code, err = run_cli(["info", "--config", os.devnull, override], capsys)
    assert code == 2
    assert_one_line(err, "megatransformer info: error:", key_of(override), line)


@pytest.mark.parametrize("override", ["optim.lr=-1", "model.norm_eps=-1", "checkpoint.every=0"])
def test_train_refuses_bad_values_the_same_way(override, capsys, tmp_path):
    code, err = run_cli(["train", "--config", os.devnull, f"run_dir={tmp_path / 'run'}", override], capsys)
    assert code == 2
    assert_one_line(err, "megatransformer train: error:", key_of(override))
    assert not (tmp_path / "run").exists()


def test_booleans_stay_accepted_where_they_are_meant():
    cfg = load_config(os.devnull, ["train.compile=true", "model.bias=false"])
    assert cfg.train.compile is True and cfg.model.bias is False


@pytest.mark.parametrize("text", ["", "\n# only a comment\n"])
def test_an_empty_config_file_without_overrides_is_refused(text, tmp_path, capsys):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    code, err = run_cli(["train", "--config", str(path), f"run_dir={tmp_path / 'run'}"], capsys)
    assert code == 2
    assert_one_line(err, "megatransformer train: error:", f"config file {path} is empty")
    assert not (tmp_path / "run").exists()
    (tmp_path / "defaults.yaml").write_text("{}\n")  # the defaults, said so
    assert load_config(tmp_path / "defaults.yaml") == load_config(None)


@pytest.mark.parametrize(
    "text,line",
    [
        (
            "train:\n  max_steps: 3\nmodel:\n  d_model: 64\ntrain:\n  log_every: 1\n",
            "duplicate key 'train' on line 5 (first on line 1)",
        ),
        (
            "model:\n  d_model: 64\n  n_heads: 4\n  d_model: 128\n",
            "duplicate key 'd_model' on line 4 (first on line 2)",
        ),
    ],
)
def test_duplicate_yaml_keys_are_refused_with_their_lines(text, line, tmp_path, capsys):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    code, err = run_cli(["info", "--config", str(path)], capsys)
    assert code == 2
    assert_one_line(err, str(path), line)


def test_unique_key_loader_keeps_safe_load_semantics():
    text = "base: &b {a: 1, b: 2}\nmodel:\n  <<: *b\n  a: 3\nx: !!python/object/apply:os.system ['true']\n"
    with pytest.raises(yaml.constructor.ConstructorError, match="python/object"):
        yaml.load(text, Loader=UniqueKeyLoader)  # no arbitrary objects, as with safe_load
    # a key merged in with << may be overridden, as YAML intends
    assert yaml.load(text.rsplit("x:", 1)[0], Loader=UniqueKeyLoader)["model"] == {"a": 3, "b": 2}
