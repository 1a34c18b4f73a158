"""What a checkpoint's weights are worth outside the run that wrote them: consolidation across tensor
parallelism, export without DeepSpeed, init_from across tensor-parallel sizes, resume guards, and a skipped
(non-finite) step that leaves weights and optimizer untouched.

Every run is a real `megatransformer train` process (torchrun --standalone for two ranks, gloo on CPU).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from support.runs import ONE_THREAD, losses, tiny_data_overrides, tiny_model, train

# The checkpoints that cross tensor-parallel sizes are of an encoder-decoder with biases: cross-attention and
# column-parallel biases are split (and gathered) too.
SEQ2SEQ = ["model.arch=encoder_decoder", "objective=span_corruption", "model.bias=true", "model.norm=layernorm"]


def overrides(tiny_data, run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [
        *tiny_model(max_seq_len=64),
        f"run_dir={run_dir}",
        *tiny_data_overrides(tiny_data),
        "data.seq_len=32",
        "train.micro_batch_size=8",
        "train.grad_accum=1",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.eval_batches=1",
        "optim.lr=1e-2",
        "schedule.warmup_steps=1",
        "checkpoint.every=1000",
        "wandb.mode=disabled",
        *extra,
    ]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The whole fp32 weights of the run's latest checkpoint (its shards assembled)."""
    from megatransformer.checkpoint import load_weights

    return load_weights(run_dir / "checkpoints")[1]


@pytest.fixture(scope="module")
def sources(tiny_data, tmp_path_factory):
    """The same 12 steps trained on one rank (ZeRO-0) and with tensor parallelism 2 (ZeRO-1)."""
    root = tmp_path_factory.mktemp("sources")
    train(overrides(tiny_data, root / "tp1", 12, *SEQ2SEQ, "parallel.zero_stage=0"), env=ONE_THREAD)
    train(
        overrides(tiny_data, root / "tp2", 12, *SEQ2SEQ, "parallel.zero_stage=1", "parallel.tensor_parallel=2"),
        nproc=2,
        env=ONE_THREAD,
    )
    return root / "tp1", root / "tp2"


def test_tensor_parallel_checkpoint_holds_the_whole_model(sources):
    """The TP=2 checkpoint's consolidated weights are the full matrices, equal to the TP=1 run's."""
    tp1, tp2 = (weights(run) for run in sources)
    assert tp1.keys() == tp2.keys()
    assert any(".cross_attn.q_proj.bias" in name for name in tp1), "no cross-attention bias to check"
    for name in tp1:
        assert tp2[name].shape == tp1[name].shape, name
        # fp32 rounding differs between the sharded and the whole matmuls; 12 Adam steps at lr 3e-3 amplify it
        # to ~2e-4 at most (measured); a misplaced shard would be off by the weights' scale (~0.02)
        torch.testing.assert_close(tp2[name], tp1[name], rtol=1e-3, atol=5e-4, msg=name)


def test_export_is_usable_without_deepspeed(sources, tmp_path):
    from safetensors.torch import load_file

    from megatransformer.cli import main
    from megatransformer.config import load_config
    from megatransformer.model import build_model

    tp2 = sources[1]
    for dtype in ("fp32", "bf16"):
        out = tmp_path / dtype
        assert main(["export", "--checkpoint", str(tp2 / "checkpoints"), "--out", str(out), "--dtype", dtype]) == 0
        exported = load_file(str(out / "model.safetensors"))
        assert {t.dtype for t in exported.values()} == {torch.float32 if dtype == "fp32" else torch.bfloat16}
        assert (out / "tokenizer.json").read_bytes() == (tp2 / "checkpoints/step_000012/tokenizer.json").read_bytes()
        model = build_model(load_config(out / "config.yaml").model)
        model.load_state_dict({k: v.float() for k, v in exported.items()})  # strict: every name, every shape
    reference = weights(tp2)
    for name, tensor in load_file(str(tmp_path / "fp32" / "model.safetensors")).items():
        assert torch.equal(tensor, reference[name]), name


def test_init_from_across_tensor_parallel_sizes(sources, tiny_data, tmp_path):
    """Fine-tuning from the TP=2 checkpoint on one rank (ZeRO-3) and on TP=2 (ZeRO-2) starts from the same
    trained weights: the same losses, far below a fresh start's ln(vocab)."""
    tp2 = sources[1]
    on_tp1, on_tp2 = tmp_path / "on_tp1", tmp_path / "on_tp2"
    source = f"init_from={tp2}/checkpoints"
    train(overrides(tiny_data, on_tp1, 2, *SEQ2SEQ, source, "parallel.zero_stage=3", "seed=7"), env=ONE_THREAD)
    train(
        overrides(
            tiny_data, on_tp2, 2, *SEQ2SEQ, source, "parallel.zero_stage=2", "parallel.tensor_parallel=2", "seed=7"
        ),
        nproc=2,
        env=ONE_THREAD,
    )
    assert losses(on_tp2) == pytest.approx(losses(on_tp1), rel=1e-5)
    assert losses(on_tp1)[0] < math.log(512) - 0.5
    state = json.loads((on_tp1 / "checkpoints" / "step_000002" / "trainer.json").read_text())
    assert (state["step"], state["zero_stage"]) == (2, 3)  # a new run: weights only, not the source's step


def test_resume_with_another_tokenizer_is_an_error(sources, tiny_data, tmp_path):
    """Shards re-made with another tokenizer (same vocabulary size) cannot continue a run: token ids differ."""
    from data_pipeline.tokenizer import file_sha256

    run = tmp_path / "run"
    shutil.copytree(sources[0], run)
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text(Path(tiny_data.tokenizer).read_text() + "\n")  # another file hash
    shards = tmp_path / "shards"
    shutil.copytree(tiny_data.shards, shards)
    manifest = json.loads((shards / "manifest.json").read_text())
    manifest["tokenizer_sha256"] = file_sha256(tokenizer)
    (shards / "manifest.json").write_text(json.dumps(manifest))
    args = overrides(
        tiny_data,
        run,
        14,
        *SEQ2SEQ,
        "parallel.zero_stage=0",
        "resume=auto",
        f"data.tokenizer={tokenizer}",
        f"data.train={shards}",
    )
    result = train(args, expect=2, env=ONE_THREAD)
    assert "trained with another tokenizer" in result.stderr


def test_skipped_steps_leave_weights_and_optimizer_untouched(tiny_data, tmp_path):
    """Weights so large that every gradient overflows: each step is skipped and counted, and the checkpoint
    written on stopping holds the initial weights and an optimizer that never stepped."""
    from megatransformer.checkpoint.sharded import ShardedState
    from megatransformer.config import load_config
    from megatransformer.model import build_model

    run = tmp_path / "nan"
    args = overrides(tiny_data, run, 8, "parallel.zero_stage=0", "model.init_std=1e39", "train.max_bad_steps=2")
    result = train(args, expect=3, env=ONE_THREAD)
    assert "update skipped (2 in a row)" in result.stdout
    cfg = load_config(None, args)
    initial = build_model(cfg.model, cfg.seed).state_dict()  # the trainer's initialisation
    saved = weights(run)
    assert all(torch.equal(initial[name].float(), saved[name]) for name in initial)
    step = run / "checkpoints" / "step_000002"
    index = json.loads((step / "index.json").read_text())
    assert index["optimizer"]["step"] == 0, "the step count changed"
    state = ShardedState(step)  # (the fused AdamW that skips on the device makes its moments at zero, unchanged)
    moments = [state.tensor(name, kind) for name in initial for kind in state.kinds_of(name) if kind != "fp32"]
    assert all(not m.any() for m in moments), "Adam moments changed"
    assert json.loads((step / "trainer.json").read_text())["bad_steps"] == 2


def test_plot_draws_several_runs(sources, tmp_path, capsys):
    from megatransformer.cli import main

    out = tmp_path / "curves.png"
    assert main(["plot", *map(str, sources), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert main(["plot", str(tmp_path), "--out", str(out)]) == 2  # not a run directory
    assert "has no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("stage", [0, 3])  # (ZeRO-1/2 on one CPU rank run as 0)
def test_bf16_checkpoint_holds_the_fp32_master_weights(tiny_data, tmp_path, stage):
    """bf16 training updates fp32 master weights; the consolidated checkpoint keeps them, not their bf16
    rounding (fine-tuning and export would otherwise lose the low mantissa bits of every step)."""
    run = tmp_path / "bf16"
    train(overrides(tiny_data, run, 3, "precision=bf16", f"parallel.zero_stage={stage}"), env=ONE_THREAD)
    matrices = [t for t in weights(run).values() if t.dim() == 2]
    assert matrices and all(t.dtype == torch.float32 for t in matrices)
    assert all(not torch.equal(t.bfloat16().float(), t) for t in matrices)


def test_a_fresh_start_never_overwrites_a_run(sources, tiny_data):
    run = sources[0]
    before = (run / "metrics.jsonl").read_text()
    result = train(overrides(tiny_data, run, 14, *SEQ2SEQ, "parallel.zero_stage=0"), expect=2, env=ONE_THREAD)
    assert "already holds checkpoints (latest: step_000012); pass resume=auto" in result.stderr
    assert (run / "metrics.jsonl").read_text() == before
