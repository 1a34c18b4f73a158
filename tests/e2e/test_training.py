"""Training through DeepSpeed on CPU: ZeRO stages, tensor parallelism, exact resume, objectives, errors.

Every run is a real `megatransformer train` process (torchrun for several ranks, gloo backend).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
from support.runs import losses, metrics, tiny_run, train, train_command, wait_for_step


def test_single_process_run_directory(tiny_data, tmp_path):
    run = tmp_path / "run"
    result = train(
        tiny_run(tiny_data, run, steps=12) + ["wandb.mode=offline", "train.eval_every=6", "checkpoint.keep=2"],
        env={"WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567"},
    )
    assert "host memory: keep" in result.stdout  # (train.host_memory's default, said in the run log)
    records = metrics(run)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    for key in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"):
        assert all(r[key] is not None for r in steps), key
    assert all(r["mfu"] is None for r in steps)  # a CPU without train.peak_tflops
    assert steps[-1]["tokens"] == 12 * 8 * 64
    assert sum(losses(run)[-3:]) < sum(losses(run)[:3])
    assert [r["step"] for r in records if "val_loss" in r] == [6, 12]
    assert (run / "config.yaml").is_file()
    assert (run / "checkpoints" / "latest").read_text() == "step_000012"
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000008", "step_000012"]
    assert list((run / "wandb").glob("offline-run-*")), "no offline W&B run"
    for path in run.rglob("*"):
        if path.is_file():
            assert b"0123456789abcdef0123456789abcdef01234567" not in path.read_bytes(), path


def test_zero_stages_train_and_agree_with_plain_data_parallel(tiny_data, tmp_path):
    """Two data-parallel ranks: ZeRO 1, 2 and 3 partition optimizer state, gradients and parameters but
    compute the same updates as plain data parallelism (stage 0), and the loss falls."""
    runs = {}
    for stage in (0, 1, 2, 3):
        runs[stage] = tmp_path / f"zero{stage}"
        train(tiny_run(tiny_data, runs[stage]) + [f"parallel.zero_stage={stage}"], nproc=2)
    for stage in (1, 2, 3):
        assert losses(runs[stage]) == pytest.approx(losses(runs[0]), rel=1e-4), f"ZeRO-{stage}"
    assert sum(losses(runs[3])[-2:]) < sum(losses(runs[3])[:2])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_two_rank_bf16_zero_run_says_nothing_of_deepspeeds_internals_and_saves_no_code(stage, tiny_data, tmp_path):
    """No FutureWarning from DeepSpeed's collectives on stderr (ZeRO-2's gathers, ZeRO-3's reduce-scatters of
    gradients, three a step before they were filtered), no DeepSpeed recovery scripts in the checkpoints (the
    shards are the whole state)."""
    run = tmp_path / "run"
    done = train(tiny_run(tiny_data, run, steps=2) + ["precision=bf16", f"parallel.zero_stage={stage}"], nproc=2)
    assert "Warning" not in done.stderr, done.stderr[-3000:]
    saved = [p.name for p in (run / "checkpoints" / "step_000002").iterdir()]
    assert "shard_00001.safetensors" in saved and not [name for name in saved if name.endswith(".py")], saved


def test_data_parallel_ranks_read_disjoint_data(tiny_data, tmp_path):
    """Two ranks with micro batch 4 consume 8 distinct sequences per step: tokens double, loss differs from a
    single rank reading the same first 4 sequences."""
    two, one = tmp_path / "two", tmp_path / "one"
    train(tiny_run(tiny_data, two, steps=2) + ["train.grad_accum=1"], nproc=2)
    train(tiny_run(tiny_data, one, steps=2) + ["train.grad_accum=1"])
    assert metrics(two)[0]["tokens"] == 2 * metrics(one)[0]["tokens"]


def test_validation_is_split_across_data_parallel_ranks_with_one_rank_numbers(tiny_data, tmp_path):
    """Three validation batches over two ZeRO-3 ranks (2 + 1, the second rank runs a dropped forward to keep
    the parameter gathers in step) give the loss and token count of one rank evaluating all three; the closing
    sample, each of its forwards run by both ranks on their partitions or slices (no checkpoint read: none was
    written), is the one rank's."""
    two, one, tp2 = tmp_path / "two", tmp_path / "one", tmp_path / "tp2"
    frozen = ["train.max_steps=1", "optim.lr=1e-10", "train.eval_batches=3"]  # the same weights in every run
    frozen += ["train.sample_prompt=The", "checkpoint.final=false", "checkpoint.every=100"]
    out_two = train(tiny_run(tiny_data, two) + frozen + ["parallel.zero_stage=3"], nproc=2).stdout
    out_tp2 = train(tiny_run(tiny_data, tp2) + frozen + ["parallel.tensor_parallel=2"], nproc=2).stdout
    out_one = train(tiny_run(tiny_data, one) + frozen).stdout
    assert not (two / "checkpoints").exists()
    (val_two,), (val_one,) = ([r for r in metrics(run) if "val_loss" in r] for run in (two, one))
    assert val_two["val_tokens"] == val_one["val_tokens"] > 2 * 4 * 64  # three batches of 4 x 64, less boundaries
    assert val_two["val_loss"] == pytest.approx(val_one["val_loss"], rel=1e-6)
    (sample,) = re.findall(r"^sample: The.*$", out_one, re.M)
    assert len(sample) > len("sample: The")
    for out in (out_two, out_tp2):
        assert re.findall(r"^sample: The.*$", out, re.M) == [sample]


@pytest.mark.parametrize("window", [None, 16], ids=["whole", "window"])
def test_tensor_parallel_peers_sample_with_their_share_of_the_kv_heads(window, tiny_data, tmp_path):
    """Each peer's KV cache holds the key/value heads its slice of the projections computes (2 of 4 here), with a
    sliding window too: the closing sample is one rank's."""
    tp2, one = tmp_path / "tp2", tmp_path / "one"
    frozen = ["train.max_steps=1", "optim.lr=1e-10", "train.sample_prompt=The", "model.n_kv_heads=4"]
    frozen += [f"model.attention_window={window}"] if window else []
    out_tp2 = train(tiny_run(tiny_data, tp2) + frozen + ["parallel.tensor_parallel=2"], nproc=2).stdout
    (sample,) = re.findall(r"^sample: The.+$", train(tiny_run(tiny_data, one) + frozen).stdout, re.M)
    assert re.findall(r"^sample: The.*$", out_tp2, re.M) == [sample]


def test_tensor_parallel_equals_single_rank(tiny_data, tmp_path):
    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    train(tiny_run(tiny_data, tp2) + ["parallel.tensor_parallel=2", "parallel.zero_stage=1"], nproc=2)
    train(tiny_run(tiny_data, tp1) + ["parallel.zero_stage=1"])
    assert losses(tp2) == pytest.approx(losses(tp1), rel=1e-5)
    grads = [[r["grad_norm"] for r in metrics(run) if "grad_norm" in r] for run in (tp2, tp1)]
    assert grads[0] == pytest.approx(grads[1], rel=1e-4)


def test_tensor_parallel_times_data_parallel_equals_data_parallel(tiny_data, tmp_path):
    both, dp = tmp_path / "tp2dp2", tmp_path / "dp2"
    steps = tiny_run(tiny_data, both, steps=4) + ["train.grad_accum=1", "parallel.zero_stage=2"]
    train(steps + ["parallel.tensor_parallel=2"], nproc=4)
    train(tiny_run(tiny_data, dp, steps=4) + ["train.grad_accum=1", "parallel.zero_stage=2"], nproc=2)
    assert losses(both) == pytest.approx(losses(dp), rel=1e-5)


def test_bf16_trains_with_fp32_gemms_as_with_pytorchs_bf16_kernels(tiny_data, tmp_path):
    """train.cpu_bf16_matmul=fp32 (what auto picks on a CPU without bf16 GEMM kernels) trains as PyTorch's own
    bf16 kernels do: the same products, summed in another order."""
    fp32_gemms, native = tmp_path / "fp32-gemms", tmp_path / "native"
    said = train(tiny_run(tiny_data, fp32_gemms) + ["precision=bf16", "train.cpu_bf16_matmul=fp32"]).stdout
    assert "bf16 matmuls: fp32 GEMMs of the bf16 operands; train.cpu_bf16_matmul=fp32" in said
    said = train(tiny_run(tiny_data, native) + ["precision=bf16", "train.cpu_bf16_matmul=native"]).stdout
    assert "bf16 matmuls: PyTorch's bf16 kernels" in said
    assert losses(fp32_gemms)[-1] < losses(fp32_gemms)[0]
    assert losses(fp32_gemms) == pytest.approx(losses(native), rel=1e-3)  # (2e-5 apart here)


def test_kill_9_and_resume_equals_uninterrupted(tiny_data, tmp_path):
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    overrides = tiny_run(tiny_data, crashed, steps=30) + ["data.num_workers=2", "checkpoint.every=5"]
    process = subprocess.Popen(
        train_command() + overrides, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    wait_for_step(crashed, 13, [process])
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert (crashed / "checkpoints" / "latest").is_file()
    train(overrides + ["resume=auto"])
    train(tiny_run(tiny_data, reference, steps=30) + ["data.num_workers=2", "checkpoint.every=5"])
    assert [r["step"] for r in metrics(crashed)] == [r["step"] for r in metrics(reference)]
    assert losses(crashed) == losses(reference)


def test_preemption_signal_checkpoints_and_exits_124(tiny_data, tmp_path):
    run = tmp_path / "preempted"
    overrides = tiny_run(tiny_data, run, steps=60) + ["checkpoint.every=1000"]
    process = subprocess.Popen(train_command() + overrides, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_step(run, 3, [process])
    process.send_signal(signal.SIGUSR1)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 124, output[-3000:]
    saved = int((run / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert 3 <= saved < 60
    train(overrides + ["resume=auto"])
    assert [r["step"] for r in metrics(run) if "loss" in r] == list(range(1, 61))


@pytest.mark.parametrize(
    "arch,objective",
    [
        ("decoder", "prefix_lm"),
        ("encoder", "masked_lm"),
        ("encoder_decoder", "span_corruption"),
        ("encoder_decoder", "prefix_lm"),
    ],
)
def test_every_objective_trains_its_architecture(tiny_data, tmp_path, arch, objective):
    run = tmp_path / objective
    options = ["model.norm=layernorm", "model.position=learned", "model.ffn=gelu"] if arch == "encoder" else []
    train(tiny_run(tiny_data, run, steps=4) + [f"model.arch={arch}", f"objective={objective}", *options])
    assert all(0 < loss < 10 for loss in losses(run))


def test_non_finite_losses_skip_updates_then_stop_with_a_checkpoint(tiny_data, tmp_path):
    run = tmp_path / "nan"
    # init_std 1e39 overflows float32: infinite weights, a NaN loss from the first step
    result = train(tiny_run(tiny_data, run) + ["model.init_std=1e39", "train.max_bad_steps=2"], expect=3)
    assert "non-finite" in result.stdout
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    assert [r["bad_steps"] for r in metrics(run) if "bad_steps" in r] == [1, 2]


def test_a_model_killed_by_its_learning_rate_stops_as_a_diverged_run(tiny_data, tmp_path):
    run = tmp_path / "dead"
    # (as optim.muon_lr=1e10 did, now refused: gradient norm 0 from step 2, loss ln(vocab) every step, exit 0):
    # weights of 1e-30 give hidden states and logits of ~0, a uniform output and no gradient
    dead = ["model.init_std=1e-30", "schedule.warmup_steps=0", "train.max_dead_steps=3"]
    result = train(tiny_run(tiny_data, run, steps=12) + dead, expect=3)
    line = next(line for line in result.stdout.splitlines() if "stopped learning" in line)
    assert "train.max_dead_steps=3" in line and "uniform output" in line and "gradient norm of" in line
    assert max(r["step"] for r in metrics(run) if "loss" in r) < 12


@pytest.mark.parametrize(
    "extra,message",
    [
        (["train.global_batch_size=12"], "train.global_batch_size=12"),
        (["resume=/nonexistent/step_000004"], "resume=/nonexistent/step_000004"),
        (["model.vocab_size=256"], "model.vocab_size=256"),
        (["data.tokenizer=/nonexistent.json"], "does not exist"),
        (["parallel.tensor_parallel=2"], "does not divide the world size 1"),
        (["model.n_kv_heads=3"], "model.n_kv_heads=3"),
    ],
)
def test_bad_configs_exit_2_with_one_line(tiny_data, tmp_path, extra, message):
    result = train(tiny_run(tiny_data, tmp_path / "bad") + extra, expect=2)
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "bad").exists()  # found before the run started: nothing written


def test_resume_with_another_model_shape_lists_the_fields(tiny_data, tmp_path):
    run = tmp_path / "run"
    train(tiny_run(tiny_data, run, steps=4))
    result = train(tiny_run(tiny_data, run, steps=8) + ["resume=auto", "model.d_ff=128", "model.n_layers=3"], expect=2)
    assert "model.n_layers: 2 in the checkpoint, 3 now" in result.stderr
    assert "model.d_ff: 96 in the checkpoint, 128 now" in result.stderr


def test_init_from_across_data_parallel_size_and_zero_stage(tiny_data, tmp_path):
    source, tuned = tmp_path / "source", tmp_path / "tuned"
    train(tiny_run(tiny_data, source, steps=8) + ["parallel.zero_stage=3", "train.grad_accum=1"], nproc=2)
    train(tiny_run(tiny_data, tuned, steps=2) + [f"init_from={source}/checkpoints", "parallel.zero_stage=0"])
    assert losses(tuned)[0] < losses(source)[0] - 0.5
