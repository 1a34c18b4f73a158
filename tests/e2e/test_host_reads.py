"""Host reads in the trainer's step (``support.host_reads``): none in a step whose result is left to read (the
verdict on its update taken on the device, its statistics read during the next step from a staged copy), one in
a step read at once (a logging step), after its update; the same results either way, spikes, skipped updates
and non-finite steps included, with and without clipping, fp32 and bf16. And DeepSpeed's bf16 step's two reads
of the gradient norm replaced (``training/deepspeed/bf16_step.py``) by a step that updates the weights exactly
as its own."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
from support import REPO

STEPS = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, "bench")
    from step_probe import batches
    from support.host_reads import counting_host_reads
    from megatransformer.config import RunConfig
    from megatransformer.training.engine import train_module as engine
    from megatransformer.training.runtime.distributed import setup, teardown
    from megatransformer.training.optimizers.schedules import lr_multiplier
    from megatransformer.training.observability.spikes import SpikeLadder

    precision, grad_clip, every = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    STEPS, POISONED = 12, 6  # POISONED: a step whose loss is NaN
    info = setup()
    # tight spike limits: about every other finite step rejected, by its loss or its gradient norm
    spikes = dict(window=4, warmup=2, threshold=0.05, min_rise=1e-6, grad_norm=True, grad_norm_threshold=0.05,
                  grad_norm_min_rise=1e-6)
    cfg = RunConfig.model_validate({
        "model": dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=64),
        "data": {"seq_len": 32}, "precision": precision, "schedule": {"warmup_steps": 4},
        "train": {"micro_batch_size": 2, "grad_accum": 2, "grad_clip": grad_clip, "max_steps": STEPS,
                  "spikes": spikes}})

    def run(device_step, every, on_device=True):
        # every: read each step's result in it (0), or only every-th step's (the others' a step later);
        # on_device False: the verdict read on the host before the update, as for optimizers that cannot skip
        install = engine.install_device_step
        if not device_step:
            engine.install_device_step = lambda optimizer: False
        module = engine.TrainModule(cfg, info)
        engine.install_device_step = install
        module.decides_on_device = module.decides_on_device and on_device
        poisoned = [False]
        module.engine.module.register_forward_hook(lambda m, i, out: out * float("nan") if poisoned[0] else None)
        data, ladder, reads, results = batches(128, 2, 32, prefix=False), SpikeLadder(cfg.train.spikes), [], []
        for step in range(1, STEPS + 1):
            poisoned[0] = step == POISONED
            read = every == 0 or step % every == 0 or step == STEPS
            with counting_host_reads() as counted:
                if every == 0:
                    results.append(module.step(data, spikes=ladder))
                    results[-1].step = step
                else:
                    results += module.advance(data, spikes=ladder, index=step, read=read)
            reads.append(counted.where)
        weights = [p.detach().float().flatten().tolist() for p in module.engine.module.parameters()]
        fields = ("step", "loss", "grad_norm", "finite", "rejected", "lr")
        seen = {
            "reads": reads,
            "results": [{f: getattr(r, f) for f in fields} for r in results],
            "weights": weights,
            "ladder": ladder.state_dict(),
            "optimizer": type(module.engine.optimizer).__name__,
            "on_device": module.decides_on_device,
        }
        module.close()
        return seen

    report = {"every_step": run(True, 0), "late": run(True, every), "host": run(True, 0, on_device=False)}
    report["lrs"] = [cfg.optim.lr * lr_multiplier(cfg)(k) for k in range(STEPS)]
    if precision == "bf16":
        report["deepspeed"] = run(False, 0)
    with open(sys.argv[4], "w") as f:
        json.dump(report, f)
    teardown()
""")

EVERY = 4  # the late runs read their result in every 4th step (and the last) only


def steps(tmp_path, precision: str, grad_clip: float) -> dict:
    script, out = tmp_path / "steps.py", tmp_path / "steps.json"
    script.write_text(STEPS)
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
        "DS_ACCELERATOR": "cpu",
        **dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"),
        "MASTER_PORT": str(29500 + os.getpid() % 1000),
    }
    command = [sys.executable, str(script), precision, str(grad_clip), str(EVERY), str(out)]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(out.read_text())


def same(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


@pytest.fixture(
    scope="module",
    params=[("fp32", 1.0), ("fp32", 0.0), ("bf16", 1.0), ("bf16", 0.0)],
    ids=lambda p: f"{p[0]}-{'clipped' if p[1] else 'unclipped'}",
)
def report(request, tmp_path_factory):
    precision, grad_clip = request.param
    return steps(tmp_path_factory.mktemp("reads"), precision, grad_clip)


def test_a_step_left_to_read_reads_nothing_and_a_step_read_at_once_reads_once(report):
    late = report["late"]
    assert late["on_device"]
    for step, reads in enumerate(late["reads"], 1):
        if step % EVERY and step != len(late["reads"]):
            assert reads == [], (step, reads)
        else:  # (the result read at once, after the update; the previous step's from its staged copy)
            assert (
                len(reads) == 1 and reads[0].startswith("tolist at") and "training/engine/train_module.py" in reads[0]
            ), reads
    for reads in report["every_step"]["reads"]:
        assert len(reads) == 1 and "training/engine/train_module.py" in reads[0], reads


@pytest.mark.parametrize("run", ["late", "every_step"])
def test_results_decided_on_the_device_are_those_decided_on_the_host(report, run):
    """The same losses, norms, verdicts, learning rates, weights and spike statistics as the verdict read on the
    host before each update, whether read at once or a step late."""
    ours, host = report[run], report["host"]
    assert ours["on_device"] and not host["on_device"]
    assert [r["step"] for r in ours["results"]] == list(range(1, len(ours["reads"]) + 1))
    for late, now in zip(ours["results"], host["results"], strict=True):
        assert all(same(late[k], now[k]) for k in late), (late, now)
    assert ours["weights"] == host["weights"]
    assert ours["ladder"] == host["ladder"]


def test_the_run_skips_spikes_and_non_finite_steps_and_the_schedule_counts_applied_updates(report):
    results = report["late"]["results"]
    kinds = {(r["finite"], r["rejected"]) for r in results}
    assert kinds == {(True, False), (True, True), (False, False)}, kinds  # applied, a spike, non-finite
    applied = 0
    for result in results:
        assert result["lr"] == report["lrs"][applied], (result, applied)
        applied += result["finite"] and not result["rejected"]
    assert applied < len(results) - 2


@pytest.mark.parametrize("grad_clip", [1e-3, 1e3])  # every step clipped; none
def test_the_bf16_device_step_updates_as_deepspeeds_own(tmp_path, grad_clip):
    report = steps(tmp_path, "bf16", grad_clip)
    ours, theirs = report["every_step"], report["deepspeed"]
    assert ours["optimizer"] == theirs["optimizer"] == "BF16_Optimizer"
    assert len(theirs["reads"][0]) == 3  # (DeepSpeed's own: its two reads of the norm and ours)
    assert ours["weights"] == theirs["weights"]
    assert [r["grad_norm"] for r in ours["results"]] == pytest.approx(
        [r["grad_norm"] for r in theirs["results"]], rel=1e-6, nan_ok=True
    )
