"""The partition map and the checkpointer agree: on two gloo ranks at ZeRO-0 to 3 (and DeepSpeed's bf16 optimizers at
ZeRO-0 and 1), a save's plan holds exactly the map's fragments of its rank, writes every element of every parameter
once, and what it writes, assembled over the ranks, is DeepSpeed's own fp32 master and Adam moments of each
parameter (its public ``safe_get_full_*`` API; ZeRO-0: the parameters and the torch optimizer's state)."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
from support.models import run_config
from support.ranks import fork_ranks

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from plan_memory import free_port, host_batch, join  # noqa: E402

KEYS = ("exp_avg", "exp_avg_sq")


def _rank(rank: int, stage: int, precision: str, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from megatransformer.checkpoint import sharded
    from megatransformer.training.checkpointing.checkpointer import SavePlan, innermost_optimizer
    from megatransformer.training.engine.train_module import TrainModule
    from megatransformer.training.runtime.distributed import teardown

    cfg = run_config(parallel={"zero_stage": stage}, train={"micro_batch_size": 2}, precision=precision)
    module = TrainModule(cfg, join(rank, 2, port), zero_stage=stage)
    module.step(itertools.repeat(host_batch(cfg)))  # (the optimizer's state made)
    partitions, engine = module.partitions, module.engine
    plan = SavePlan.build(engine, partitions, module.tp)
    seen = {
        "wrapper": type(engine.optimizer).__name__,
        "map": sorted([f.name, 0, f.start, f.start + f.numel] for f in partitions.mine()),
        "plan": sorted(list(f.coordinates) for f in plan.held),
        "numel": {name: shape.numel() for name, shape in partitions.shapes.items()},
        "writes": {},
        "differs": [],
    }
    for fragment, lo, hi in plan.mine:
        seen["writes"][fragment.name] = seen["writes"].get(fragment.name, 0) + hi - lo
    if stage in (1, 2):  # (DeepSpeed links the moments to its fragments after the first group's step only)
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    inner = innermost_optimizer(engine)
    masters = {}  # ZeRO-0: each parameter's fp32 master, where DeepSpeed's unfused optimizer keeps one
    for params, fp32 in zip(getattr(engine.optimizer, "fp16_groups", []), getattr(engine.optimizer, "fp32_groups", [])):
        masters |= {id(p): m for p, m in zip(params, fp32)}
    for name, param in engine.module.named_parameters():
        for kind in (sharded.MASTER, *KEYS):
            assembled = torch.zeros(seen["numel"][name])
            for fragment, lo, hi in plan.mine:
                if fragment.name == name:
                    assembled[lo:hi] = fragment.view(kind)[lo - fragment.start : hi - fragment.start]
            dist.all_reduce(assembled)
            if stage == 0:
                master = masters.get(id(param), param)
                own = master if kind == sharded.MASTER else inner.state[master][kind]
            elif kind == sharded.MASTER:
                own = safe_get_full_fp32_param(param)
            else:
                own = safe_get_full_optimizer_state(param, kind)
            if not torch.equal(assembled, own.detach().float().reshape(-1)):
                seen["differs"].append(f"{name} {kind}")
    module.close()
    teardown()
    Path(f"{out}.{rank}").write_text(json.dumps(seen))


@pytest.mark.parametrize(
    "stage, precision, wrapper",
    [
        (0, "fp32", "AdamW"),
        (1, "fp32", "DeepSpeedZeroOptimizer"),
        (2, "fp32", "DeepSpeedZeroOptimizer"),
        (3, "fp32", "DeepSpeedZeroOptimizer_Stage3"),
        (0, "bf16", "FP16_UnfusedOptimizer"),
        (1, "bf16", "BF16_Optimizer"),
    ],
)
def test_the_save_plan_is_the_partition_map_of_each_rank(tmp_path, stage, precision, wrapper):
    out = tmp_path / "seen"
    fork_ranks(_rank, (stage, precision, free_port(), str(out)), 2)
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(2)]
    for seen in ranks:
        assert seen["wrapper"] == wrapper
        assert seen["plan"] == seen["map"] and seen["plan"]
        assert seen["differs"] == []
        held = sum(stop - start for _, _, start, stop in seen["map"])
        assert held < sum(seen["numel"].values()) if stage else held == sum(seen["numel"].values())
    numel = ranks[0]["numel"]
    assert {name: sum(seen["writes"].get(name, 0) for seen in ranks) for name in numel} == numel  # (each once)
