"""slurm/train.sbatch on the real local Slurm cluster (slurm/local-cluster.sh: 2 nodes, 1 CPU each).

* a 2-node x 1-task job trains a tiny decoder with ZeRO-2 over gloo and writes its checkpoints;
* a second, identical job is sent the warning signal mid-run: it checkpoints, exits 124, requeues itself,
  resumes (resume=auto) and ends with the same losses, step for step, as the uninterrupted job;
* a job with a bad config fails once, with the one-line error, and is not requeued;
* a 2-node job preempted and requeued onto 1 node continues (an elastic resume, same global batch) with the
  uninterrupted 2-node job's losses.

In CI (CI=true) a missing cluster fails these tests; elsewhere they are skipped with the reason.
Every wait is bounded; a failure shows the job's log and `scontrol show job`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from support import REPO
from support.runs import clean_env, losses_by_step, write_tiny_config
from support.slurm import JOB_TIMEOUT, Job, cluster_problem

from launch.env import slurm_port

pytestmark = pytest.mark.slurm

MAX_STEPS = 150
SIGNAL_AFTER_STEP = 15  # the warning is sent once this many steps are logged


# ------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def cluster():
    problem = cluster_problem()
    if problem:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI needs the Slurm cluster: {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="module")
def submit(cluster, tmp_path_factory):
    """sbatch slurm/train.sbatch from the repository root; jobs still queued at the end are cancelled."""
    logs = tmp_path_factory.mktemp("slurm_logs")
    jobs: list[Job] = []

    def _submit(name: str, config: Path, *overrides: str) -> Job:
        command = [
            "sbatch",
            "--parsable",
            f"--chdir={REPO}",
            f"--job-name={name}",
            f"--output={logs}/%x-%j.out",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--time=30:00",
            "slurm/train.sbatch",
            str(config),
            *overrides,
        ]
        # the job inherits this environment (sbatch --export=ALL): PATH, this python, TORCH_EXTENSIONS_DIR
        result = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"sbatch failed: {result.stderr}"
        job_id = int(result.stdout.strip().split(";")[0])
        jobs.append(Job(job_id, logs / f"{name}-{job_id}.out"))
        return jobs[-1]

    yield _submit
    for job in jobs:
        if job.info().get("JobState") in ("PENDING", "RUNNING", "REQUEUED", "SUSPENDED", "COMPLETING"):
            subprocess.run(["scancel", str(job.id)], timeout=30)


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


@pytest.fixture(scope="module")
def slurm_config(tmp_path_factory, tiny_data) -> Path:
    root = tmp_path_factory.mktemp("slurm_runs")
    return write_tiny_config(root / "tiny.yaml", tiny_data, root / "unused", max_steps=MAX_STEPS)


@pytest.fixture(scope="module")
def uninterrupted(submit, slurm_config) -> tuple[Job, Path]:
    run_dir = slurm_config.parent / "uninterrupted"
    job = submit("mt-uninterrupted", slurm_config, f"run_dir={run_dir}", "checkpoint.every=50")
    job.wait_finished()
    return job, run_dir


# --------------------------------------------------------------------------------------------- tests


def test_two_nodes_train_with_zero2_and_checkpoint(uninterrupted):
    job, run_dir = uninterrupted
    info = job.info()
    if info.get("JobState") != "COMPLETED" or info.get("ExitCode") != "0:0":
        pytest.fail(job.report("the uninterrupted job did not complete with exit code 0"))
    assert (info["NumNodes"], info["NodeList"], info["Restarts"]) == ("2", "n[1-2]", "0")
    log = job.text()
    assert f"launch: slurm: world 2 (1 per node), master 127.0.0.1:{slurm_port(job.id)}" in log, log
    assert "requeueing" not in log, log  # a normal end does not requeue
    assert sorted(losses_by_step(run_dir)) == list(range(1, MAX_STEPS + 1))
    checkpoints = run_dir / "checkpoints"
    final = checkpoints / (checkpoints / "latest").read_text().strip()
    assert final.name == f"step_{MAX_STEPS:06d}" and (final / "COMPLETE").is_file()
    trainer = json.loads((final / "trainer.json").read_text())
    assert (trainer["step"], trainer["world_size"], trainer["zero_stage"]) == (MAX_STEPS, 2, 2)
    assert sorted(p.name for p in final.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
    assert len(list(final.glob("shard_*.safetensors"))) == 2  # ZeRO-2 partitions, one shard per rank
    assert (checkpoints / "step_000050" / "COMPLETE").is_file()  # checkpoint.every=50


def wait_for_idle_nodes(timeout: float) -> None:
    """Until every node is idle (the previous run of a requeued job has been cleaned up), plus a margin."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, timeout=30
        ).stdout.split()
        if states and all(state == "idle" for state in states):
            time.sleep(2)
            return
        time.sleep(0.5)
    pytest.fail(f"the nodes did not become idle within {timeout} s after the requeue")


def test_warning_signal_checkpoints_requeues_and_resumes_to_the_same_losses(submit, slurm_config, uninterrupted):
    _, reference_dir = uninterrupted
    run_dir = slurm_config.parent / "preempted"
    job = submit("mt-preempted", slurm_config, f"run_dir={run_dir}", "checkpoint.every=50")

    job.wait(
        lambda i: logged_steps(run_dir) >= SIGNAL_AFTER_STEP or i.get("JobState") not in ("PENDING", "RUNNING"),
        JOB_TIMEOUT,
        f"{SIGNAL_AFTER_STEP} logged steps",
    )
    # what Slurm does before the time limit (--signal=B:USR1@120): signal the batch script
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job.id)], check=True, timeout=30)
    job.wait_requeued()
    stopped = re.search(r"preempted at step (\d+): checkpointing, exit 124", job.text())
    assert stopped, job.report("no 'preempted at step' line")
    stopped_at = int(stopped[1])
    assert SIGNAL_AFTER_STEP <= stopped_at < MAX_STEPS, f"stopped at step {stopped_at}"
    saved = run_dir / "checkpoints" / f"step_{stopped_at:06d}"
    assert (saved / "COMPLETE").is_file(), job.report(f"{saved} is not a complete checkpoint")
    # Slurm holds a requeued job ~120 s (BeginTime); release it early, but not before the first run has left the
    # nodes: its credential is revoked
    wait_for_idle_nodes(60)
    subprocess.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now"], check=True, timeout=30)

    info = job.wait_finished()
    if info["JobState"] != "COMPLETED" or info["ExitCode"] != "0:0" or info["Restarts"] != "1":
        pytest.fail(job.report("the requeued job did not complete once with exit code 0"))
    first_part, restarted, second_part = job.text().partition(f"train.sbatch: job {job.id} (restart 1)")
    assert restarted, job.report("the log shows no restart")
    assert "train.sbatch: got SIGUSR1, forwarding it to the tasks" in first_part
    assert "train.sbatch: tasks exited with 124" in first_part
    assert f"train.sbatch: checkpoint saved after SIGUSR1; requeueing job {job.id}" in first_part
    assert "requeueing" not in second_part  # the resumed run ended normally
    first_step = re.search(r"^step (\d+)/", second_part, re.M)
    assert first_step and int(first_step[1]) == stopped_at + 1, job.report("the requeued run did not resume")

    resumed, reference = losses_by_step(run_dir), losses_by_step(reference_dir)
    assert sorted(resumed) == list(range(1, MAX_STEPS + 1))  # every step once: none lost, none doubled
    assert resumed[MAX_STEPS] == pytest.approx(reference[MAX_STEPS], rel=1e-6, abs=1e-7)
    for step in range(stopped_at + 1, MAX_STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-6, abs=1e-7), f"step {step}"


def test_failed_job_is_not_requeued(submit, tmp_path):
    job = submit("mt-bad-config", tmp_path / "missing.yaml")
    info = job.wait_finished(timeout=300)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "2:0", "0"), job.report("")
    log = job.text()
    assert "megatransformer train: error: config file" in log and "does not exist" in log, log
    assert "requeueing" not in log


def test_preempted_on_two_nodes_requeued_onto_one_continues_exactly(submit, slurm_config, uninterrupted):
    """Elastic resume on Slurm: a 2-node job is sent the warning signal, checkpoints and requeues itself; while
    it waits, its request is cut to one node (as a scheduler handing a requeued job fewer nodes), so the
    requeued run resumes the 2-rank ZeRO-2 checkpoint on 1 rank, with the same global batch (micro 2 x
    accum 2 instead of micro 2 x dp 2), and continues the uninterrupted 2-node job's losses."""
    _, reference_dir = uninterrupted
    run_dir = slurm_config.parent / "elastic"
    batch = ("train.global_batch_size=4", "train.grad_accum=null")  # the uninterrupted job's 2 x 1 x 2
    job = submit("mt-elastic", slurm_config, f"run_dir={run_dir}", "checkpoint.every=50", *batch)
    job.wait(
        lambda i: logged_steps(run_dir) >= SIGNAL_AFTER_STEP or i.get("JobState") not in ("PENDING", "RUNNING"),
        JOB_TIMEOUT,
        f"{SIGNAL_AFTER_STEP} logged steps",
    )
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job.id)], check=True, timeout=30)
    job.wait_requeued()
    subprocess.run(
        ["scontrol", "update", f"JobId={job.id}", "NumNodes=1-1", "NumTasks=1", "NumCPUs=1"], check=True, timeout=30
    )
    wait_for_idle_nodes(60)
    subprocess.run(["scontrol", "update", f"JobId={job.id}", "StartTime=now"], check=True, timeout=30)
    info = job.wait_finished()
    if info["JobState"] != "COMPLETED" or info["ExitCode"] != "0:0" or info["Restarts"] != "1":
        pytest.fail(job.report("the requeued job did not complete once with exit code 0"))
    assert info["NumNodes"] == "1", job.report("the requeued run did not run on one node")
    first_part, restarted, second_part = job.text().partition(f"train.sbatch: job {job.id} (restart 1)")
    assert restarted, job.report("the log shows no restart")
    assert "launch: slurm: world 2" in first_part and "launch: slurm: world 1" in second_part, job.text()
    stopped_at = int(re.search(r"preempted at step (\d+): checkpointing, exit 124", first_part)[1])
    assert (
        f"resuming step {stopped_at} written by 2 ranks (dp2, tp1, zero2) on 1 rank (dp1, tp1, zero0): "
        "micro 2 x accum 2 (was micro 2 x accum 1)"
    ) in second_part, job.report("no elastic resume line")
    resumed, reference = losses_by_step(run_dir), losses_by_step(reference_dir)
    assert sorted(resumed) == list(range(1, MAX_STEPS + 1))  # every step once: none lost, none doubled
    # One rank with grad_accum 2 sums the same two micro-batch gradients as two ranks' all-reduce, in another
    # order: the first resumed step agrees to rounding, the rest drift by rounding only (as the elastic tests allow).
    assert resumed[stopped_at + 1] == pytest.approx(reference[stopped_at + 1], rel=0, abs=1e-5)
    for step in range(stopped_at + 2, MAX_STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5), f"step {step}"
