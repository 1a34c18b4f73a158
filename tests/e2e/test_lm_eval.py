"""lm-evaluation-harness through our LM: the same per-item responses and metrics as the harness's own Hugging
Face model on the exported checkpoint, on one and two ranks, and during training."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install -e '.[eval]'")

from support.harness_tasks import TASKS, write_tasks  # noqa: E402
from support.runs import ONE_THREAD, checkpoint, cli, tiny_run, torchrun, train  # noqa: E402

OFFLINE = {"HF_DATASETS_OFFLINE": "1", **ONE_THREAD}
STEPS = 8


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory) -> dict:
    """The tiny decoder trained for 8 steps with the four tasks evaluated in training every 4 steps, its last
    checkpoint exported for transformers, and ``megatransformer eval --tasks`` of that checkpoint on one rank."""
    root = tmp_path_factory.mktemp("lm_eval")
    yamls = write_tasks(tiny_data.corpus, root / "tasks")
    run_dir = root / "run"
    tasks = "[" + ", ".join(str(path) for path in yamls.values()) + "]"
    train(
        tiny_run(tiny_data, run_dir, STEPS, {"checkpoint.every": STEPS})
        + [f"train.evals.tasks={tasks}", "train.evals.every=4"],
        env=OFFLINE,
    )
    hf = root / "hf"
    cli("export", "--checkpoint", run_dir, "--format", "hf", "--out", hf)
    ours = ours_eval(checkpoint(run_dir, STEPS), root / "tasks", root / "ours.jsonl")
    return {"root": root, "run_dir": run_dir, "hf": hf, "ours": ours}


def ours_eval(ckpt: Path, tasks: Path, samples: Path, nproc: int = 1, options: tuple[str, ...] = ()) -> dict:
    """``megatransformer eval --tasks`` (all four, --json, ``options``): its JSON and its per-item samples."""
    launcher = torchrun(nproc) if nproc > 1 else [sys.executable]
    command = [*launcher, "-m", "megatransformer.cli", "eval", "--checkpoint", str(ckpt), "--include-path"]
    command += [str(tasks), "--tasks", *TASKS, "--batch-size", "4", "--bootstrap-iters", "0", "--json", *options]
    result = run(command + ["--samples", str(samples)])
    return {"tasks": json.loads(result.stdout)["tasks"], "samples": read_samples(samples)}


def run(command: list[str]) -> subprocess.CompletedProcess:
    import os

    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **OFFLINE}, timeout=900)
    assert result.returncode == 0, f"{' '.join(command)}: exit {result.returncode}\n{result.stderr[-4000:]}"
    return result


def read_samples(path: Path) -> dict[tuple[str, int], dict]:
    return {(r["task"], r["doc_id"]): r for r in map(json.loads, path.read_text().splitlines())}


def assert_same(ours: dict, theirs: dict, where: str) -> None:
    """Loglikelihoods within 1e-6 relative, everything else (greedy flags, generated text, metrics) equal."""
    if isinstance(theirs, float) or isinstance(ours, float):
        assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-9), where
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, dict):
        assert set(ours) == set(theirs), where
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    else:
        assert ours == theirs, where


def test_same_items_and_metrics_as_the_harness_hf_model(trained):
    out = trained["root"] / "hf_out"
    # (logits_cache=False: the hf model's reuse of logits across requests gave another number for a rolling
    # window of periodic text than its own forward of that window; off, it scores every request itself)
    run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args"]
        + [f"pretrained={trained['hf']},dtype=float32,logits_cache=False", "--device", "cpu", "--batch_size", "4"]
        + ["--include_path", str(trained["root"] / "tasks"), "--tasks", *TASKS, "--output_path", str(out)]
        + ["--log_samples"]
    )
    theirs_metrics = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    ours = trained["ours"]
    for task in TASKS:
        expected = {
            key.partition(",")[0]: value
            for key, value in theirs_metrics[task].items()
            if key.endswith(",none") and "stderr" not in key
        }
        assert_same(in_log_space(ours["tasks"][task]), in_log_space(expected), task)
        items = [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
        assert len(items) == 20
        for item in items:
            mine = ours["samples"][(task, item["doc_id"])]
            theirs = [response(x, TASKS[task][0]) for [x] in item["resps"]]
            assert_same([x for [x] in mine["resps"]], theirs, f"{task} item {item['doc_id']}")
            assert_same(mine["metrics"], {name: item[name] for name in item["metrics"]}, f"{task} {item['doc_id']}")


def in_log_space(metrics: dict) -> dict:
    """Perplexities as their logs (the mean loglikelihoods they are exp of, where the tolerance applies)."""
    return {name: math.log(value) if "perplexity" in name else value for name, value in metrics.items()}


def response(value, output_type: str):
    """A response as the harness's samples file writes it (numbers as strings) in ours' terms."""
    if isinstance(value, list):
        return [float(value[0]), value[1] == "True"]
    return float(value) if output_type == "loglikelihood_rolling" else value


@pytest.mark.parametrize("options", [(), ("--zero-stage", "3", "--batch-size", "1")], ids=["whole", "zero3"])
def test_two_ranks_give_the_numbers_of_one(trained, options):
    """Each rank with the whole model, or with half of it (ZeRO-3, the ranks' forwards in step: batches of one
    item, so that the shares take different numbers of forwards)."""
    root = trained["root"]
    two = ours_eval(checkpoint(trained["run_dir"], STEPS), root / "tasks", root / "two.jsonl", 2, options)
    assert_same(two["tasks"], trained["ours"]["tasks"], "two ranks")
    assert set(two["samples"]) == set(trained["ours"]["samples"])
    for key, item in trained["ours"]["samples"].items():
        assert_same(two["samples"][key], item, f"two ranks {key}")


def test_zero3_ranks_in_bf16_give_the_numbers_of_one_process_in_bf16(trained):
    """``--dtype bf16`` at ``--zero-stage 3``: each rank's partitions made in bf16, the same numbers item by item as
    the whole bf16 model on one process (both in batches of one: bf16 rounds what another batch shape would sum
    in another order)."""
    root, saved = trained["root"], checkpoint(trained["run_dir"], STEPS)
    options = ("--batch-size", "1", "--dtype", "bf16")
    one = ours_eval(saved, root / "tasks", root / "bf16.jsonl", 1, options)
    two = ours_eval(saved, root / "tasks", root / "bf16-two.jsonl", 2, ("--zero-stage", "3", *options))
    assert_same(two["tasks"], one["tasks"], "bf16, two ranks")
    for key, item in one["samples"].items():
        assert_same(two["samples"][key], item, f"bf16, two ranks {key}")
    assert one["tasks"] != trained["ours"]["tasks"]  # (fp32's differ)


def test_training_logs_the_tasks(trained):
    records = [json.loads(line) for line in (trained["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r for r in records if any(key.startswith("eval/") for key in r)}
    assert sorted(evaluated) == [4, STEPS]
    last = {key.removeprefix("eval/"): value for key, value in evaluated[STEPS].items() if key.startswith("eval/")}
    # the training process's numbers are those of the checkpoint evaluated afterwards (fp32, the same tasks)
    expected = {
        f"{task}/{metric}": value
        for task, values in trained["ours"]["tasks"].items()
        for metric, value in values.items()
    }
    assert_same(in_log_space(last), in_log_space(expected), "step 8")
    assert evaluated[4]["kind"] == "valid" and evaluated[4]["eval/mt_choice/acc"] is not None
    assert all(record["eval_s"] > 0 for record in evaluated.values())  # (the seconds the tasks took)


@pytest.mark.parametrize(
    "layout, precision, ranks",
    [
        ("parallel.zero_stage=3", "fp32", 2),
        ("parallel.zero_stage=3", "bf16", 2),
        ("parallel.tensor_parallel=2", "fp32", 2),
        ("parallel.tensor_parallel=2", "fp32", 4),  # (2 data-parallel ranks of 2 tensor-parallel peers)
        ("parallel.sequence_parallel=2", "fp32", 2),
        ("parallel.sequence_parallel=2 parallel.zero_stage=3", "fp32", 4),  # (2 data-parallel ranks of 2 peers)
    ],
    ids=["zero3", "zero3-bf16", "tp2", "dp2-tp2", "sp2", "dp2-sp2-zero3"],
)
def test_ranks_that_share_the_model_evaluate_in_training_with_the_numbers_of_the_checkpoint(
    layout, precision, ranks, tiny_data, tmp_path
):
    """At ZeRO-3 every forward gathers each layer's parameters from both ranks, so the ranks run their shares'
    forwards in step, a rank whose share is done running one-token stand-ins until the other's is (all four kinds
    of task: choices, loglikelihood, rolling, generation); with tensor parallelism both ranks run the same share,
    each forward summing their parts; with sequence parallelism each rank runs whole rows of its own share. The
    numbers logged are those of the checkpoint evaluated afterwards on one process, in the run's precision
    (``--dtype bf16``: the bf16 weights a bf16 run evaluates, its fp32 masters rounded, and its forwards' GEMMs)."""
    yamls = write_tasks(tiny_data.corpus, tmp_path / "tasks")
    tasks = "[" + ", ".join(str(path) for path in yamls.values()) + "]"
    run_dir = tmp_path / "run"
    overrides = tiny_run(tiny_data, run_dir, 4, {"checkpoint.every": 4, "train.grad_accum": 1})
    evals = [f"train.evals.tasks={tasks}", "train.evals.every=4", "train.evals.batch_size=1"]  # (uneven shares)
    train(overrides + [*layout.split(), f"precision={precision}", *evals], ranks, env=OFFLINE)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in records if any(key.startswith("eval/") for key in r))
    ours = ours_eval(checkpoint(run_dir, 4), tmp_path / "tasks", tmp_path / "after.jsonl", 1, ("--dtype", precision))
    expected = {f"{task}/{metric}": value for task, values in ours["tasks"].items() for metric, value in values.items()}
    got = {key.removeprefix("eval/"): value for key, value in logged.items() if key.startswith("eval/")}
    assert logged["step"] == 4 and set(got) == set(expected)
    assert_same(in_log_space(got), in_log_space(expected), f"{layout}, {precision}, step 4")


def test_a_compiled_run_evaluates_its_tasks_without_compiling_again(tiny_data, tmp_path):
    """The tasks' forwards have shapes the training step never runs: the compiled blocks run them eagerly rather
    than compile again for them (a line of the compile watch each, up to dynamo's limit), and the numbers logged
    are those of the checkpoint evaluated afterwards."""
    yamls = write_tasks(tiny_data.corpus, tmp_path / "tasks")
    tasks = "[" + ", ".join(str(path) for path in yamls.values()) + "]"
    run_dir = tmp_path / "run"
    overrides = tiny_run(tiny_data, run_dir, 4, {"checkpoint.every": 2, "train.compile": True})
    result = train(overrides + [f"train.evals.tasks={tasks}", "train.evals.every=2"], env=OFFLINE)
    recompiles = [line for line in result.stdout.splitlines() if "recompile" in line]
    assert all(line.startswith("torch.compile, step 2's evaluation: recompiled") for line in recompiles)
    # (the validation's forwards compile once without gradients, and once for its packed rows; the tasks' rows
    # would compile for each new length up to dynamo's limit)
    assert [line.split(": ", 2)[2].split("  ")[0].strip() for line in recompiles] == [
        "0/0: GLOBAL_STATE changed: grad_mode",
        "0/1: mask.q_segments is None",
    ]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = next(r for r in records if r["step"] == 2 and any(key.startswith("eval/") for key in r))
    ours = ours_eval(checkpoint(run_dir, 2), tmp_path / "tasks", tmp_path / "after.jsonl")
    expected = {f"{task}/{metric}": value for task, values in ours["tasks"].items() for metric, value in values.items()}
    got = {key.removeprefix("eval/"): value for key, value in logged.items() if key.startswith("eval/")}
    assert_same(in_log_space(got), in_log_space(expected), "compiled, step 2")


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tasks", "no_such_task"], "lm-eval knows no task no_such_task"),
        ([], "give --data (loss and perplexity) or --tasks (lm-eval tasks), one of them"),
    ],
)
def test_bad_task_arguments_are_one_line_before_loading(args, message):
    result = cli("eval", "--checkpoint", "no/such/checkpoint", *args, check=False, env=OFFLINE)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    "ranks, layout, signalled",
    [(1, [], [0]), (2, ["parallel.zero_stage=3"], [0, 1]), (2, ["parallel.tensor_parallel=2"], [1])],
    ids=["one-rank", "zero3-two-ranks", "tp2-one-rank-signalled"],
)
def test_a_preemption_during_the_tasks_ends_them_and_the_next_step_saves(
    ranks, layout, signalled, tiny_data, tmp_path, monkeypatch
):
    """The signal arrives while the tasks run (seconds of rolling windows, one at a time): they end at the next
    forward, on every rank (at ZeRO-3 and with tensor parallelism the ranks' forwards are in step: they end at the
    same one, even where one rank has the signal before the other, whose forward would wait for it), without their
    numbers, and the run checkpoints after the next step and exits 124 rather than finishing them. Two ranks are
    started as srun starts them, each signalled as srun relays a signal, or one alone."""
    import signal

    from support.runs import spawn_ranks, train_command, wait_for_step, wait_ranks

    yamls = write_tasks(tiny_data.corpus, tmp_path / "tasks", n=120)
    run_dir = tmp_path / "run"
    overrides = tiny_run(tiny_data, run_dir, 1000, {"checkpoint.every": 1000, "wandb.mode": "disabled"})
    overrides += [f"train.evals.tasks=[{yamls['mt_rolling']}]", "train.evals.every=2", "train.evals.batch_size=1"]
    log = tmp_path / "train"
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)  # (for the processes started below)
    if ranks == 1:
        with open(f"{log}.rank0.log", "w") as out:
            processes = [subprocess.Popen([*train_command(), *overrides], stdout=out, stderr=subprocess.STDOUT)]
    else:
        processes = spawn_ranks([*overrides, *layout], log)
    try:
        wait_for_step(run_dir, 2, processes, Path(f"{log}.rank0.log"))  # (logged just before its tasks start)
        for rank in signalled:
            processes[rank].send_signal(signal.SIGUSR1)
        assert wait_ranks(processes, log) == [124] * ranks
    finally:
        for process in processes:
            process.kill()
    output = Path(f"{log}.rank0.log").read_text()
    assert "step 2: train.evals interrupted: preempted; evaluate the checkpoint the run saves next" in output, output
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000003"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_2 = next(r for r in records if r["step"] == 2 and "val_loss" in r)
    assert not any(key.startswith("eval/") for key in step_2)


def test_a_preempted_step_is_saved_before_its_tasks_which_are_skipped_with_a_line(tiny_data, tmp_path):
    """The tasks may take longer than Slurm's warning leaves before the kill: a step whose ranks agreed to stop
    saves at once, the tasks due then skipped with a line naming the checkpoint to evaluate instead."""
    import os
    import signal

    from support.runs import train_command, wait_for_step

    yamls = write_tasks(tiny_data.corpus, tmp_path / "tasks")
    run_dir = tmp_path / "run"
    overrides = tiny_run(tiny_data, run_dir, 1000, {"checkpoint.every": 1000, "wandb.mode": "disabled"})
    evals = [f"train.evals.tasks=[{yamls['mt_choice']}]", "train.evals.every=1"]  # (due at every step)
    log = (tmp_path / "out.log").open("w")
    process = subprocess.Popen(
        [*train_command(), *overrides, *evals], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE}
    )
    try:
        wait_for_step(run_dir, 2, [process], tmp_path / "out.log")
        process.send_signal(signal.SIGUSR1)
        assert process.wait(timeout=300) == 124
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    output = (tmp_path / "out.log").read_text()
    saved = int((run_dir / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert f"step {saved}: train.evals skipped: preempted; evaluate the checkpoint saved now" in output, output[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any(key.startswith("eval/") for r in records if r["step"] == saved for key in r)
    # (the step before may have had its tasks interrupted, when the signal came while they ran)
    assert all(any(key.startswith("eval/") for key in r) for r in records if "val_loss" in r and r["step"] < saved - 1)
