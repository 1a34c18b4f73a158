"""DeepSpeed's ``BF16_Optimizer`` step (ZeRO-1 in bf16: fp32 gradient accumulation, fp32 master weights) without
its waits for the device: the gradient norm and the clipping by it in a few foreach kernels on the device, where
DeepSpeed computes the norm tensor by tensor and reads it on the host twice (``is_invalid_grad_norm`` and
``if clip_coef < 1``). A non-finite norm does not return early here: the trainer's verdict, taken on the same
norm, skips the update (``engine.gated_update``), which leaves weights, moments and schedule as DeepSpeed's early
return does.

Read from DeepSpeed 0.19.8 (``runtime/bf16_optimizer.py``): check on an upgrade, with ``internals.py``."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist


def squared_norm(tensors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The squared 2-norm of ``tensors`` viewed as one vector, in fp32 (one foreach kernel for the norms of all);
    on their device, or ``device`` when there are none."""
    if not tensors:
        return torch.zeros((), device=device)
    norms = torch._foreach_norm([t.detach() for t in tensors], 2, dtype=torch.float32)
    return torch.stack(norms).pow(2).sum()


def clip_by_norm(tensors: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale ``tensors`` by min(1, max_norm / (norm + 1e-6)) in place, as DeepSpeed's
    ``clip_tensors_by_global_norm`` does, without reading the factor on the host."""
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_([t.detach() for t in tensors], factor.to(tensors[0].device))


def takes_device_step(optimizer) -> bool:
    """Whether ``optimizer`` is a ``BF16_Optimizer`` whose step :func:`device_step` replaces: no MoE, no Muon, and
    the attributes that step uses (DeepSpeed 0.19's)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    needed = ("get_grads_for_norm", "fp32_groups_flat_partition", "fp32_groups_gradient_flat_partition", "clip_grad")
    return (
        isinstance(optimizer, BF16_Optimizer)
        and not optimizer.has_moe_layers
        and not getattr(optimizer, "_uses_muon", False)
        and all(hasattr(optimizer, name) for name in needed)
    )


@torch.no_grad()
def device_step(self, closure=None) -> None:
    """``BF16_Optimizer.step`` with the norm and clipping on the device (bound to the optimizer instance)."""
    if closure is not None:
        raise NotImplementedError(f"{self.__class__} does not support closure.")
    self.overflow = False
    grads, _ = self.get_grads_for_norm()
    squares = squared_norm(grads)
    if self.mpu is not None:  # tensor-parallel shards' squares summed, as DeepSpeed's norm does
        dist.all_reduce(squares, group=self.mpu.get_model_parallel_group())
    norm = squares.pow(0.5)
    norm = norm.masked_fill(~torch.isfinite(norm), -1.0)  # (DeepSpeed's mark of a non-finite norm)
    self._global_grad_norm = norm
    if self.clip_grad > 0.0:
        clip_by_norm(self.get_grads_for_norm(for_clipping=True), self.clip_grad, norm.abs())
    for weights, grads in zip(self.fp32_groups_flat_partition, self.fp32_groups_gradient_flat_partition):
        weights.grad = grads.to(weights.dtype) if grads.dtype != weights.dtype else grads
    self.optimizer.step()
    if self.grad_acc_dtype is not torch.float32:
        for param_partition in self.fp32_groups_flat_partition:
            param_partition.grad = None
    self._lazy_init_hp_params_optimizer_state()
    self.update_lp_params()
    self.clear_hp_grads()


def install_device_step(optimizer) -> bool:
    """Replace ``optimizer``'s step by :func:`device_step` where :func:`takes_device_step`; returns whether."""
    if not takes_device_step(optimizer):
        return False
    optimizer.step = types.MethodType(device_step, optimizer)
    return True
