"""The DeepSpeed engine a RunConfig describes: ZeRO stage, AutoTP tensor parallelism, precision, optimizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatransformer.config import ConfigError, RunConfig
from megatransformer.model import build_model, deepspeed_layer_specs
from megatransformer.training.batching import BatchSizes, resolve_batch_sizes
from megatransformer.training.distributed import Dist
from megatransformer.training.optim import make_scheduler, param_groups


def deepspeed_config(cfg: RunConfig, sizes: BatchSizes, device: str) -> dict[str, Any]:
    t, o, p = cfg.train, cfg.optim, cfg.parallel
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": sizes.micro,
        "gradient_accumulation_steps": sizes.accum,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 1 << 30,
        "zero_optimization": {"stage": p.zero_stage},
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": {"enabled": cfg.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "optimizer": {
            "type": "AdamW" if o.name == "adamw" else "Adam",
            # torch_adam: PyTorch's implementation, no JIT-built C++/CUDA op needed anywhere.
            "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay,
                       "torch_adam": True, **({"adam_w_mode": False} if o.name == "adam" else {})},
        },
    }
    if p.offload_optimizer:
        if p.zero_stage == 0:
            raise ConfigError("parallel.offload_optimizer needs parallel.zero_stage >= 1")
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": device != "cpu"}
        ds["zero_force_ds_cpu_optimizer"] = False
    if p.tensor_parallel > 1:
        ds["tensor_parallel"] = {"autotp_size": p.tensor_parallel, "partition_config": {
            "use_default_specs": False, "layer_specs": deepspeed_layer_specs()}}
    return ds


@dataclass
class Engine:
    engine: Any  # deepspeed.DeepSpeedEngine
    sizes: BatchSizes
    dp_rank: int
    dp_size: int
    tp_rank: int


def build_engine(cfg: RunConfig, dist: Dist, init_state: dict[str, torch.Tensor] | None = None) -> Engine:
    import deepspeed
    from deepspeed.utils import groups

    tp = cfg.parallel.tensor_parallel
    if dist.world_size % tp:
        raise ConfigError(f"parallel.tensor_parallel={tp} does not divide the world size {dist.world_size}")
    sizes = resolve_batch_sizes(cfg.train, dist.world_size // tp)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = build_model(cfg.model)
    if init_state is not None:
        model.load_state_dict(init_state)
    groups_ = param_groups(model, cfg.optim.weight_decay, cfg.optim.decay_norms_and_embeddings)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups_,
                                      config=deepspeed_config(cfg, sizes, dist.device),
                                      lr_scheduler=make_scheduler(cfg))
    if cfg.train.compile:
        engine.compile()
    dp_rank = groups._get_data_parallel_rank() if tp > 1 else dist.rank
    tp_rank = groups.get_tensor_model_parallel_rank() if tp > 1 else 0
    return Engine(engine, sizes, dp_rank, dist.world_size // tp, tp_rank)
