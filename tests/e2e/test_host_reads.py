"""Host reads in the trainer's step (``support.host_reads``): the step statistics' one read per step, no other
(DeepSpeed's bf16 step's two reads of the gradient norm are replaced: ``training/bf16_step.py``); and that
replacement updates the weights exactly as DeepSpeed's own step, clipping or not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from support import REPO

STEPS = textwrap.dedent("""
    import json, os, sys
    import torch
    sys.path.insert(0, "bench")
    from step_probe import batches
    from support.host_reads import counting_host_reads
    from megatransformer.config import RunConfig
    from megatransformer.training import engine
    from megatransformer.training.distributed import leave, setup
    from megatransformer.training.spikes import SpikeLadder

    precision, grad_clip = sys.argv[1], float(sys.argv[2])
    info = setup()
    cfg = RunConfig.model_validate({
        "model": dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=64),
        "data": {"seq_len": 32}, "precision": precision,
        "train": {"micro_batch_size": 2, "grad_accum": 2, "grad_clip": grad_clip}})

    def run(device_step):
        install = engine.install_device_step
        if not device_step:
            engine.install_device_step = lambda optimizer: False
        module = engine.TrainModule(cfg, info)
        engine.install_device_step = install
        data, ladder, reads, norms = batches(128, 2, 32, prefix=False), SpikeLadder(cfg.train.spikes), [], []
        for _ in range(4):
            with counting_host_reads() as counted:
                result = module.step(data, reject=ladder.rejects)
            reads.append(counted.where)
            norms.append(result.grad_norm)
        weights = [p.detach().float().flatten().tolist() for p in module.engine.module.parameters()]
        return {"reads": reads, "norms": norms, "weights": weights, "optimizer": type(module.engine.optimizer).__name__}

    report = {"device": run(True), "deepspeed": run(False)}
    with open(sys.argv[3], "w") as f:
        json.dump(report, f)
    leave(0)
""")


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
    done = subprocess.run(
        [sys.executable, str(script), precision, str(grad_clip), str(out)], cwd=REPO, env=env, capture_output=True
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_step_reads_the_device_once(tmp_path, precision):
    report = steps(tmp_path, precision, 1.0)
    for reads in report["device"]["reads"]:
        assert len(reads) == 1 and reads[0].startswith("tolist at") and "training/engine.py" in reads[0], reads


@pytest.mark.parametrize("grad_clip", [1e-3, 1e3])  # every step clipped; none
def test_the_bf16_device_step_updates_as_deepspeeds_own(tmp_path, grad_clip):
    report = steps(tmp_path, "bf16", grad_clip)
    ours, theirs = report["device"], report["deepspeed"]
    assert ours["optimizer"] == theirs["optimizer"] == "BF16_Optimizer"
    assert len(theirs["reads"][0]) == 3  # (DeepSpeed's own: its two reads of the norm and ours)
    assert ours["weights"] == theirs["weights"]
    assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-6)
