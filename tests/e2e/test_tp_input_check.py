"""DeepSpeed AutoTP's first-forward check that tensor-parallel peers got the same batch pickles what it
inspects from the source rank to its peers: it must see the batch, not the attention masks (whose device
tensors would be unpickled onto the source's device)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from support import REPO

FIRST_STEPS = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from megatransformer.config import RunConfig
    from megatransformer.training.runtime.distributed import setup, teardown
    from megatransformer.training.engine.train_module import TrainModule
    sys.path.insert(0, "bench")
    from step_probe import batches

    seen = []  # what the consistency check handed to broadcast_object_list, as each rank holds it after
    broadcast = dist.broadcast_object_list
    def recording(object_list, *args, **kwargs):
        result = broadcast(object_list, *args, **kwargs)
        sent = object_list[0]
        seen.append(sorted(sent) if isinstance(sent, dict) else [type(x).__name__ for x in sent])
        return result
    dist.broadcast_object_list = recording

    info = setup()
    cfg = RunConfig.model_validate({
        "model": dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=64),
        "data": {"seq_len": 32}, "objective": "prefix_lm", "train": {"micro_batch_size": 2, "grad_accum": 1},
        "parallel": {"tensor_parallel": 2}})
    module = TrainModule(cfg, info)
    data = batches(128, 2, 32, prefix=True)
    losses = [module.step(data).loss for _ in range(2)]
    check_left = module.engine.first_dataloader_check.id in module.engine.module._forward_pre_hooks
    report = {"rank": info.rank, "seen": seen, "losses": losses, "check_left": check_left}
    with open(f"{sys.argv[1]}/rank{info.rank}.json", "w") as f:  # (the ranks share stdout: lines may mix)
        json.dump(report, f)
    module.close()
    teardown()
""")


def test_the_autotp_input_check_compares_the_batch_without_the_masks(tmp_path):
    script = tmp_path / "first_steps.py"
    script.write_text(FIRST_STEPS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        [kwargs] = report["seen"]  # the check's one run: the keyword arguments (the positional ones are none)
        assert "masks" not in kwargs
        assert {"input_ids", "labels", "segment_ids", "prefix_len"} <= set(kwargs)
        assert not report["check_left"]  # it ran once and removed itself
    assert reports[0]["losses"] == reports[1]["losses"]
