"""Ctrl-C: the first one checkpoints at the end of the step and exits 124 (as preemption does), resume=auto
continues from that step, a second one exits at once, and so does one while DeepSpeed starts; one line each,
never a traceback. The summary counts the
steps the checkpoint holds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from support.runs import tiny_data_overrides, train_command

from megatransformer.cli import main

TINY = (
    "model.d_model=64 model.n_layers=2 model.n_heads=4 model.n_kv_heads=2 model.d_ff=96 model.vocab_size=512 "
    "model.max_seq_len=128 data.seq_len=64 train.micro_batch_size=4 train.grad_accum=1 train.log_every=1 "
    "train.eval_batches=2 checkpoint.every=1000 wandb.mode=disabled"
).split()
STEPS = 80  # (room for the signal to land before the end on a busy machine)


def run_command(tiny_data, run_dir: Path, *extra: str) -> list[str]:
    return [
        *train_command(),
        *TINY,
        *tiny_data_overrides(tiny_data),
        f"run_dir={run_dir}",
        f"train.max_steps={STEPS}",
        *extra,
    ]


def steps(run_dir: Path) -> list[int]:
    return [
        json.loads(line)["step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if "loss" in json.loads(line)
    ]


def wait_for_first_step(run_dir: Path, process: subprocess.Popen) -> None:
    while not ((run_dir / "metrics.jsonl").is_file() and steps(run_dir)):
        assert process.poll() is None, process.communicate()[0][-3000:]
        time.sleep(0.05)


def test_ctrl_c_checkpoints_the_step_and_resume_continues_from_it(tiny_data, tmp_path):
    run = tmp_path / "run"
    # a terminal's Ctrl-C reaches the whole process group: the trainer and its DataLoader worker
    process = subprocess.Popen(
        run_command(tiny_data, run, "data.num_workers=1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    wait_for_first_step(run, process)
    os.killpg(process.pid, signal.SIGINT)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 124, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert output.count("Ctrl-C: checkpointing after this step, then exiting (Ctrl-C again: exit now)") == 1
    saved = int((run / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert f"interrupted (Ctrl-C) at step {saved}: checkpointing, exit 124" in output
    assert f"stopped early (checkpointed; run again with resume=auto to continue): {saved} of {STEPS} steps" in output
    assert 1 <= saved < STEPS

    resumed = subprocess.run(run_command(tiny_data, run, "resume=auto"), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{saved:06d}'} at step {saved}" in resumed.stdout
    assert steps(run) == list(range(1, STEPS + 1))  # each step once: the interrupted run logged up to the saved one


def test_ctrl_c_on_every_rank_checkpoints_one_step(tiny_data, tmp_path):
    """Two ranks started as torchrun starts them (each in its own session), each sent SIGINT once, as torchrun
    passes on a Ctrl-C: both stop after the same step, which is saved, and exit 124."""
    run = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = []
    for rank in range(2):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        ranks.append(
            subprocess.Popen(
                run_command(tiny_data, run, "parallel.zero_stage=2"),
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    wait_for_first_step(run, ranks[0])
    for process in ranks:
        process.send_signal(signal.SIGINT)
    outputs = [process.communicate(timeout=600)[0] for process in ranks]
    assert [process.returncode for process in ranks] == [124, 124], outputs[0][-2000:] + outputs[1][-2000:]
    saved = int((run / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert f"interrupted (Ctrl-C) at step {saved}: checkpointing, exit 124" in outputs[0]
    assert sum(output.count("Ctrl-C: checkpointing after this step") for output in outputs) == 1  # one per node
    assert not any("Traceback" in output for output in outputs)


def test_a_second_ctrl_c_exits_at_once_with_one_line():
    script = (
        "import os, signal, time\n"
        "from megatransformer.training.loop import Preemption\n"
        "preemption = Preemption()\n"
        "preemption.starting = False\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "assert preemption.requested\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(600)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 130
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == "megatransformer train: interrupted again: exiting now, without a checkpoint"
    assert "Traceback" not in result.stderr


def test_ctrl_c_while_a_rank_waits_on_a_build_lock_exits_at_once_with_one_line(tiny_data, tmp_path):
    """Rank 0 of a two-rank run that waits on another process's build of DeepSpeed's CPU collective (a lock file
    left in its build directory): a Ctrl-C exits at once, one line, no traceback, nothing saved."""
    from megatransformer.training.runtime.builds import COLLECTIVE

    lock = tmp_path / "torch_extensions" / COLLECTIVE / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": str(lock.parent.parent),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }
    run = tmp_path / "run"
    process = subprocess.Popen(
        run_command(tiny_data, run), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for line in process.stdout:
        if line.startswith("waiting for another process's build"):
            break
    process.send_signal(signal.SIGINT)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 130, output[-3000:]
    assert output.strip().splitlines() == ["Ctrl-C while starting (nothing trained yet to checkpoint): exiting now"]
    assert not (run / "checkpoints").exists()


def test_ctrl_c_before_training_starts_is_one_line(monkeypatch, capsys):
    from megatransformer.commands import info

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(info, "run", interrupted)
    assert main(["info", "--config", "quickstart"]) == 130
    assert capsys.readouterr().err.strip() == "megatransformer info: interrupted"


def test_the_summary_counts_the_steps_of_the_checkpoint_saved(tmp_path):
    from megatransformer import checkpoint as ckpt
    from megatransformer.commands.train import summary
    from megatransformer.config import load_config

    cfg = load_config("quickstart", [f"run_dir={tmp_path}", "train.max_steps=400", "train.log_every=10"])
    records = [{"step": s, "loss": 3.0, "tokens": 1000 * s} for s in range(10, 51, 10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    saved = ckpt.checkpoints_dir(tmp_path) / ckpt.step_name(51)  # stopped between two logged steps
    saved.mkdir(parents=True)
    ckpt.write_trainer_state(
        saved,
        ckpt.TrainerState(
            step=51, tokens=51_000, bad_steps=0, tokenizer_sha256=None, world_size=1, tensor_parallel=1, zero_stage=0
        ),
    )
    text = summary(cfg, 124, 60.0, saved, None)
    assert text.startswith(
        "stopped early (checkpointed; run again with resume=auto to continue): 51 of 400 steps, 51,000 tokens"
    )
    assert "  train loss at step 50: 3.0000\n" in text  # (not of step 51, where the run stopped)


def test_a_stopped_run_s_summary_gives_the_step_of_its_last_validation_loss(tmp_path):
    from megatransformer.commands.train import summary
    from megatransformer.config import load_config

    cfg = load_config("quickstart", [f"run_dir={tmp_path}", "train.max_steps=400"])
    records = [{"step": s, "loss": 3.0, "tokens": 1000 * s} for s in range(10, 131, 10)]
    records.insert(10, {"step": 100, "val_loss": 2.5, "val_ppl": 12.18})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = summary(cfg, 124, 60.0, None, None)
    assert "  final train loss       3.0000\n" in text
    assert "  validation loss at step 100: 2.5000 (perplexity 12.18)\n" in text
    records.append({"step": 130, "val_loss": 2.25, "val_ppl": 9.49})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "  final validation loss  2.2500 (perplexity 9.49)\n" in summary(cfg, 0, 60.0, None, None)
