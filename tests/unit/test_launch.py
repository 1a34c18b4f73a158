"""launch: environment parsing (torchrun, srun, batch script, nothing), the early-signal relay, and real runs
through ``python -m launch`` as one process and under torchrun with 2 processes (ZeRO-2 on CPU, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launch.env import PORT_BASE, PORT_SPAN, DistEnv, LaunchError, detect, master_address, slurm_port, tasks_per_node

REPO = Path(__file__).resolve().parents[1]
UNRESOLVABLE = "no-such-node.invalid"  # .invalid never resolves (RFC 2606)


def fake_scontrol(hostnames: str, node_addr: str | None = None, calls: list | None = None):
    def run(*args: str) -> str:
        if calls is not None:
            calls.append(args)
        if args[:2] == ("show", "hostnames"):
            return hostnames
        if args[:2] == ("show", "node"):
            return f"NodeName={args[2]} Arch=x86_64 NodeAddr={node_addr} NodeHostName=vm Port=17001" if node_addr \
                else f"NodeName={args[2]} Arch=x86_64"
        raise AssertionError(f"unexpected scontrol {args}")
    return run


def srun_task(procid: int, localid: int = 0, nodeid: int = 0, ntasks: int = 2, job_id: int = 4242,
              tasks_per_node_spec: str = "1(x2)", **extra: str) -> dict[str, str]:
    env = {"SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
           "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_STEP_NUM_TASKS": str(ntasks),
           "SLURM_NTASKS": str(ntasks), "SLURM_STEP_TASKS_PER_NODE": tasks_per_node_spec,
           "SLURM_STEP_NODELIST": f"{UNRESOLVABLE.split('.')[0]}[1-2]", "SLURM_JOB_NODELIST": "ignored[1-2]"}
    return env | extra


# ------------------------------------------------------------------------------------------ torchrun


def test_torchrun_environment_is_kept():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7",
           "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
           "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}  # torchrun inside an srun step: torchrun's view wins
    dist = detect(env, scontrol=fake_scontrol(""))
    assert dist == DistEnv("torchrun", 3, 1, 4, 2, "10.0.0.7", 29500)
    assert dist.variables() == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                                "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}


def test_partial_torchrun_environment_names_what_is_missing():
    with pytest.raises(LaunchError, match="MASTER_ADDR, MASTER_PORT"):
        detect({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})


def test_rank_outside_world_is_an_error():
    env = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    with pytest.raises(LaunchError, match="RANK=2 is outside WORLD_SIZE=2"):
        detect(env)


# --------------------------------------------------------------------------------------------- Slurm


def test_srun_tasks_agree_on_master_and_get_their_ranks():
    """Every task derives the same address and port on its own; ranks come from SLURM_PROCID/LOCALID."""
    tasks = [srun_task(0, 0, 0, ntasks=4, tasks_per_node_spec="2(x2)"),
             srun_task(1, 1, 0, ntasks=4, tasks_per_node_spec="2(x2)"),
             srun_task(2, 0, 1, ntasks=4, tasks_per_node_spec="2(x2)"),
             srun_task(3, 1, 1, ntasks=4, tasks_per_node_spec="2(x2)")]
    calls: list = []
    scontrol = fake_scontrol("no-such-node1\nno-such-node2\n", node_addr="10.1.2.3", calls=calls)
    dists = [detect(env, scontrol) for env in tasks]
    assert [(d.rank, d.local_rank, d.world_size, d.local_world_size) for d in dists] == \
        [(0, 0, 4, 2), (1, 1, 4, 2), (2, 0, 4, 2), (3, 1, 4, 2)]
    assert {(d.source, d.master_addr, d.master_port) for d in dists} == {("slurm", "10.1.2.3", slurm_port(4242))}
    assert calls[0] == ("show", "hostnames", "no-such-node[1-2]")  # the step's nodes, not the job's
    assert calls[1] == ("show", "node", "no-such-node1", "-o")  # the first node's NodeAddr (name unresolvable)


def test_resolvable_first_host_is_used_without_asking_the_controller():
    calls: list = []
    assert master_address("localhost,x", fake_scontrol("localhost\nx\n", calls=calls)) == "localhost"
    assert calls == [("show", "hostnames", "localhost,x")]


def test_unresolvable_node_without_node_addr_is_an_error():
    with pytest.raises(LaunchError, match="export MASTER_ADDR"):
        master_address("n1", fake_scontrol("no-such-node.invalid\n"))


def test_exported_master_address_and_port_win():
    env = srun_task(1, MASTER_ADDR="head.example", MASTER_PORT="31000")
    dist = detect(env, scontrol=fake_scontrol(""))  # scontrol must not be needed
    assert (dist.master_addr, dist.master_port, dist.rank) == ("head.example", 31000, 1)


def test_port_is_derived_from_the_job_id():
    ports = [slurm_port(job) for job in range(1000, 1100)]
    assert len(set(ports)) == 100  # nearby jobs do not collide
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert slurm_port(7) == slurm_port(7)


@pytest.mark.parametrize("spec, expected", [("1", [1]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]),
                                            ("4,2(x2)", [4, 2, 2])])
def test_tasks_per_node(spec, expected):
    assert tasks_per_node(spec) == expected


def test_bad_slurm_values_are_errors():
    with pytest.raises(LaunchError, match="SLURM_STEP_TASKS_PER_NODE"):
        tasks_per_node("2x3")
    with pytest.raises(LaunchError, match="SLURM_PROCID='zero' is not an integer"):
        detect(srun_task(0) | {"SLURM_PROCID": "zero"}, fake_scontrol("localhost"))
    with pytest.raises(LaunchError, match="SLURM_PROCID=2 is outside SLURM_STEP_NUM_TASKS=2"):
        detect(srun_task(2), fake_scontrol("localhost"))


def test_batch_script_without_srun_is_one_process_and_says_so():
    env = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    dist = detect(env, scontrol=fake_scontrol(""))
    assert dist.source == "single" and dist.variables() == {}
    assert "srun" in dist.note


def test_no_launcher_is_a_single_process():
    dist = detect({"PATH": "/usr/bin"})
    assert dist == DistEnv("single") and dist.variables() == {} and not dist.note


# ---------------------------------------------------------------------------------- python -m launch


def run_launch(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    return env | extra


def test_inconsistent_environment_is_one_line_and_exit_2():
    result = run_launch(["--config", "x.yaml"], clean_env(RANK="0", WORLD_SIZE="2"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "launch: error: RANK/WORLD_SIZE are set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT not: start with torchrun, "
        "or set all of RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"]


def test_config_errors_come_from_the_trainer_with_exit_2(tmp_path):
    result = run_launch(["--config", str(tmp_path / "missing.yaml")], clean_env())
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_signal_during_start_up_reaches_the_trainer_handler():
    """USR1 before the trainer installed its handler must not kill the process, and must not be lost."""
    script = textwrap.dedent("""
        import os, signal, time
        from launch.__main__ import EarlySignals
        EarlySignals()
        os.kill(os.getpid(), signal.SIGUSR1)     # arrives while 'the trainer is starting'
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: got.append("USR1"))   # the trainer takes over
        signal.signal(signal.SIGTERM, lambda s, f: got.append("TERM"))
        deadline = time.time() + 10
        while len(got) < 2 and time.time() < deadline:
            time.sleep(0.05)
        print(",".join(got))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "USR1,TERM"


# --------------------------------------------------------------------------------------- real training


def write_tiny_config(path: Path, tiny_data, run_dir: Path, **train: int) -> Path:
    """A ~20k-parameter decoder, ZeRO-2, that trains a step in milliseconds on CPU."""
    cfg = {
        "run_dir": str(run_dir), "seed": 0,
        "model": {"arch": "decoder", "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "d_ff": 64,
                  "vocab_size": 512, "max_seq_len": 32, "norm": "rmsnorm", "position": "rope", "ffn": "swiglu",
                  "tie_embeddings": True},
        "data": {"train": str(tiny_data.shards), "tokenizer": str(tiny_data.tokenizer), "seq_len": 32,
                 "shuffle_buffer": 50},
        "objective": "autoregressive",
        "train": {"max_steps": 6, "micro_batch_size": 2, "grad_accum": 1, "log_every": 1, "eval_batches": 1,
                  "peak_tflops": 1.0} | train,
        "optim": {"lr": 1.0e-3},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "checkpoint": {"every": 3},
        "parallel": {"zero_stage": 2},
        "wandb": {"mode": "disabled"},
    }
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_train_loss(run_dir: Path) -> tuple[int, float]:
    last = [m for m in metrics(run_dir) if "loss" in m][-1]
    return last["step"], last["loss"]


@pytest.mark.slow
def test_single_process_just_runs(tmp_path, tiny_data):
    config = write_tiny_config(tmp_path / "tiny.yaml", tiny_data, tmp_path / "run", max_steps=2)
    result = run_launch(["--config", str(config), "parallel.zero_stage=0"], clean_env(), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "launch: single process" in result.stdout
    trainer = json.loads((tmp_path / "run/checkpoints/step_000002/trainer.json").read_text())
    assert trainer["world_size"] == 1


@pytest.mark.slow
def test_torchrun_two_processes_zero2(tmp_path, tiny_data):
    run_dir = tmp_path / "run"
    config = write_tiny_config(tmp_path / "tiny.yaml", tiny_data, run_dir, max_steps=6)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "-m", "launch", "--config", str(config)]
    result = subprocess.run(command, cwd=REPO, env=clean_env(OMP_NUM_THREADS="1"), capture_output=True,
                            text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "launch: torchrun: world 2 (2 per node)" in log
    assert final_train_loss(run_dir)[0] == 6
    losses = [m["loss"] for m in metrics(run_dir) if "loss" in m]
    assert all(loss == loss and loss < 10 for loss in losses)  # finite, near ln(512) = 6.2 at the start
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints/latest").read_text().strip()
    trainer = json.loads((latest / "trainer.json").read_text())
    assert (trainer["step"], trainer["world_size"], trainer["zero_stage"]) == (6, 2, 2)
    # ZeRO-2 partitions the optimizer state: one shard per rank
    assert sorted(p.name for p in latest.glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
