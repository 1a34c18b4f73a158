"""The DeepSpeed side of training: the engine a RunConfig describes, one optimizer step on it, and its
checkpoints (through ``checkpointer.py``).

Everything that knows DeepSpeed lives here and in ``checkpointer.py`` (its config, the tensor-parallel plan in
its form, the loss normalisation it needs, skipped updates, gradient norms, tensor-parallel corrections); the
loop in ``loop.py`` only sees :class:`TrainModule`: ``advance`` (``settle``, ``discard``), ``evaluate``, ``save``
and ``load``.

A step waits for the device at most once, after its update is queued, and a step whose result is left to read
(the loop's steps that log nothing) not at all: the verdict on the update (non-finite loss or gradients, a
spike) is taken on the device from the step's all-reduced statistics and PyTorch's fused AdamW skips by it in
its kernel; the statistics are copied to the host behind the update and read during the next step, once its
forward and backward passes are queued (:meth:`TrainModule.advance`). Where the optimizer cannot skip on the
device (fp16's loss scaler, Muon, DeepSpeed's CPU Adam) they are read before the update: before DeepSpeed's
step without ZeRO, inside it, once ZeRO has computed the norm, with ZeRO. The rest is decided on the host before
the batches move: label and token counts are counted from the loader's CPU tensors, attention metadata is built
once per batch (:func:`masks.batch_masks`), and the loss normaliser is all-reduced on the device and used there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatransformer.batch import IGNORE_INDEX, PAD_SEGMENT
from megatransformer.checkpoint import TrainerState
from megatransformer.config import ConfigError, RunConfig, precision_dtype
from megatransformer.flops import ModelSize, document_lengths, documents_flops, model_size
from megatransformer.model.gpu_cores import VARLEN_BACKENDS, activate_for
from megatransformer.model.latent_attention import LatentAttention
from megatransformer.model.masks import ModelMasks, batch_masks, to_device
from megatransformer.model.tp_plan import TP_PLAN, assign_head_offsets, has_partial_gradient, partition_dim
from megatransformer.planner import reduce_bucket_elements, zero3_sizes
from megatransformer.training.checkpointing import checkpointer
from megatransformer.training.checkpointing.resume import ResumePlan
from megatransformer.training.deepspeed.bf16_step import install_device_step, squared_norm
from megatransformer.training.deepspeed.internals import data_parallel_rank, import_own_muon_uncompiled, param_shape
from megatransformer.training.deepspeed.partitions import build_partition_map
from megatransformer.training.deepspeed.saved_weights import weights_saved_by_place
from megatransformer.training.engine.compiled import (
    compile_blocks,
    compile_enabled,
    eager_on_recompile,
    gather_whole_blocks,
)
from megatransformer.training.engine.construction import (
    build_for_run,
    load_into_partitioned,
    partitions_at_construction,
    slices_made_by_autotp,
)
from megatransformer.training.engine.sequence_parallel import (
    SequenceShard,
    apply_ulysses,
    sequence_groups,
    whole_sequences,
)
from megatransformer.training.engine.staged import StagedCopy, StagedValue
from megatransformer.training.engine.tiled_mlp import apply_tiled_mlp
from megatransformer.training.engine.tp_input_check import check_batch_without_masks
from megatransformer.training.observability.spikes import SpikeLadder
from megatransformer.training.optimizers.muon import MuonWithAdamW, muon_param_groups
from megatransformer.training.optimizers.schedules import make_scheduler, param_groups
from megatransformer.training.runtime.cpu_bf16 import gemms_as_fp32, matmul_context
from megatransformer.training.runtime.distributed import Dist
from megatransformer.training.runtime.host_memory import return_free_memory
from megatransformer.training.runtime.layout import (
    BatchSizes,
    data_parallel_size,
    engine_zero_stage,
    resolve_batch_sizes,
)


def deepspeed_layer_specs(plan: dict[str, str] = TP_PLAN) -> list[dict]:
    """The tensor-parallel plan in DeepSpeed AutoTP's ``tensor_parallel.partition_config.layer_specs`` form."""
    by_type: dict[str, list[str]] = {}
    for pattern, partition in plan.items():
        by_type.setdefault(partition, []).append(pattern)
    return [{"patterns": patterns, "partition_type": kind} for kind, patterns in by_type.items()]


def deepspeed_config(cfg: RunConfig, sizes: BatchSizes, device: str, zero_stage: int | None = None) -> dict[str, Any]:
    """DeepSpeed's config for ``cfg``; ``zero_stage`` defaults to :func:`engine_zero_stage`.

    bf16 gradients accumulate over micro batches and reduce over data-parallel ranks in fp32 (DeepSpeed's
    default is the model's dtype for both): ZeRO-1 then runs DeepSpeed's ``BF16_Optimizer``, ZeRO-2/3 keep
    fp32 gradient partitions. ZeRO-0 cannot accumulate in fp32 in DeepSpeed, so its gradients accumulate in
    bf16 (the run log says so) and only its reduction runs in fp32.
    """
    t, o, p = cfg.train, cfg.optim, cfg.parallel
    cuda = device.startswith("cuda")
    adam: dict[str, Any] = {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay}
    if o.name == "adam":
        adam["adam_w_mode"] = False
    if o.name == "muon":
        optimizer = None  # (TrainModule hands DeepSpeed its own: muon.MuonWithAdamW)
    elif p.offload_optimizer:
        # DeepSpeedCPUAdam (AVX, JIT-built once): the optimizer step runs on the host, next to the states
        optimizer = {"type": "AdamW" if o.name == "adamw" else "Adam", "params": adam}
    else:
        # PyTorch's fused AdamW (CUDA and CPU kernels; no JIT-built op): one kernel per step, and no read of
        # the step count per parameter as its unfused implementations do
        optimizer = {
            "type": "AdamW" if o.name == "adamw" else "Adam",
            "params": {**adam, "torch_adam": True, "fused": True},
        }
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": sizes.micro,
        "gradient_accumulation_steps": sizes.accum,
        "gradient_clipping": t.grad_clip,
        "steps_per_print": 1 << 30,
        "zero_optimization": {
            "stage": engine_zero_stage(cfg, sizes.dp, torch.device(device).type) if zero_stage is None else zero_stage
        },
        "bf16": {"enabled": cfg.precision == "bf16"},
        "fp16": {"enabled": cfg.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
    }
    if optimizer is not None:
        ds["optimizer"] = optimizer
    elif ds["zero_optimization"]["stage"] > 0:
        ds["zero_allow_untested_optimizer"] = True  # (muon.MuonWithAdamW, told ZeRO's partitions: MuonWithAdamW.bind)
    if ds["zero_optimization"]["stage"] == 3:
        # its buckets and gathers sized by the model's layers (DeepSpeed's defaults gather a smaller model whole)
        shards = sizes.dp * p.sequence_parallel  # (ZeRO partitions over sequence peers too)
        ds["zero_optimization"] |= zero3_sizes(cfg.model, p.tensor_parallel, shards).deepspeed()
    elif ds["zero_optimization"]["stage"] > 0:
        # DeepSpeed allocates the whole bucket, 5e8 elements by default, whatever the model's size
        ds["zero_optimization"]["reduce_bucket_size"] = reduce_bucket_elements(cfg.model, p.tensor_parallel)
    if ds["zero_optimization"]["stage"] in (1, 2):
        # several GPUs: gradients reduced on a side stream while the backward pass goes on (one more bucket)
        ds["zero_optimization"]["overlap_comm"] = cuda and sizes.dp > 1
    if cfg.precision == "bf16":
        ds["communication_data_type"] = "fp32"
        if ds["zero_optimization"]["stage"] > 0:
            ds["data_types"] = {"grad_accum_dtype": "fp32"}
    if p.offload_optimizer:
        if p.zero_stage == 0:
            raise ConfigError("parallel.offload_optimizer needs parallel.zero_stage >= 1")
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if p.tensor_parallel > 1:
        ds["tensor_parallel"] = {
            "autotp_size": p.tensor_parallel,
            "partition_config": {"use_default_specs": False, "layer_specs": deepspeed_layer_specs()},
        }
    return ds


def check_muon_layout(cfg: RunConfig) -> None:
    """Refuse the layouts :class:`MuonWithAdamW` cannot orthogonalise whole matrices in: it runs at every ZeRO
    stage (each matrix sent to its owner rank from DeepSpeed's partitions) with any data-, tensor- and
    sequence-parallel degree, but not where ZeRO-Offload steps it on the host. (A partition layout whose fragments
    do not tile each matrix is refused once the engine exists: ``MuonWithAdamW.bind``.)"""
    if cfg.parallel.offload_optimizer:
        raise ConfigError(
            "optim.name=muon with parallel.offload_optimizer=true: ZeRO-Offload steps the optimizer on the host, "
            "where Muon cannot gather each matrix's update over the data-parallel group; set "
            "parallel.offload_optimizer=false"
        )


@dataclass
class StepResult:
    loss: float  # mean token loss of the global batch (NaN when non-finite)
    tokens: int  # input positions processed, all ranks, padding included
    model_flops: float  # the training FLOPs of the batch's documents, all ranks (the MFU numerator)
    finite: bool  # the loss and gradients were finite (else the update was skipped)
    stop: bool  # a rank was asked to stop (preemption)
    lr: float  # the learning rate this step's update used
    rejected: bool = False  # the step was finite, but ``spikes`` refused it: the update was skipped
    grad_norm: float | None = None  # global gradient norm before clipping (NaN: non-finite; None: not computed)
    z_loss: float | None = None  # mean z-loss term per loss token, beside ``loss`` (None: train.z_loss is 0)
    save_due: bool = False  # a rank asked for a checkpoint after this step (checkpoint.every_minutes)
    step: int = 0  # the step's number in the run (``TrainModule.advance``'s ``index``)


@dataclass
class Verdict:
    """The step's reduced statistics and what becomes of its update."""

    loss: float
    grad_norm: float | None
    finite: bool
    rejected: bool
    stop: bool
    model_flops: float
    z_loss: float | None = None
    save_due: bool = False

    @property
    def apply(self) -> bool:
        return self.finite and not self.rejected


@dataclass
class Judged:
    """A step's reduced statistics (``TrainModule._reduce``) and the verdict on its update: read on the host
    before the update (``verdict``), or taken on the device (``apply_on_device``) and read after it, at once or
    a step later (``staged``)."""

    reduced: torch.Tensor
    norm_computed: bool
    apply_on_device: torch.Tensor | None = None
    verdict: Verdict | None = None
    index: int = 0
    tokens: int = 0
    lr: float = 0.0
    zero_skipped: bool = False  # ZeRO skipped the update on its own (non-finite gradients)
    staged: StagedValue | None = None

    def decided(self) -> torch.Tensor:
        """The reduced statistics and, last, the device's verdict (1: applied), as one vector to read."""
        return torch.cat([self.reduced, self.apply_on_device.double().reshape(1)])

    @property
    def answer(self) -> bool | torch.Tensor:
        """What ``gated_update`` asks: whether to apply the update, known on the host or on the device."""
        return self.verdict.apply if self.verdict is not None else self.apply_on_device


class TrainModule:
    """A DeepSpeed engine and the optimizer step of a RunConfig: ZeRO stage, AutoTP, precision, optimizer."""

    def __init__(
        self,
        cfg: RunConfig,
        dist_info: Dist,
        init_state: dict[str, torch.Tensor] | None = None,
        zero_stage: int | None = None,
    ) -> None:
        """``zero_stage``: the stage DeepSpeed runs, by default :func:`engine_zero_stage` (probes of ZeRO's
        own step on one rank pass ``cfg.parallel.zero_stage``)."""
        import deepspeed
        from deepspeed.utils import groups

        self.cfg, self.device = cfg, torch.device(dist_info.device)
        tp = self.tp = cfg.parallel.tensor_parallel
        sp = cfg.parallel.sequence_parallel
        self.sizes = resolve_batch_sizes(cfg.train, data_parallel_size(cfg, dist_info.world_size))
        self.zero_stage = (
            zero_stage if zero_stage is not None else engine_zero_stage(cfg, self.sizes.dp, self.device.type)
        )
        ds_config = deepspeed_config(cfg, self.sizes, dist_info.device, self.zero_stage)
        # ZeRO-3: partitioned as it is made; tensor parallelism: each rank's slices made as AutoTP shards the model
        model = build_for_run(cfg, self.zero_stage, ds_config, self.device)
        if init_state is not None and tp == 1:
            if partitions_at_construction(cfg, self.zero_stage):
                load_into_partitioned(model, init_state)
            else:
                checkpointer.load_weights_into(model, init_state)
        if cfg.model.mlp_tiles > 1:
            apply_tiled_mlp(model, cfg.model.mlp_tiles)
        # ranks of a sequence group read the same rows, each keeps its slice of them
        self.sequence, mpu = None, None
        if sp > 1:
            mpu = sequence_groups(sp)  # (DeepSpeed's groups, for ZeRO's partitions and reductions)
            self.sequence = SequenceShard(mpu.get_sequence_parallel_rank(), sp)
            apply_ulysses(model, mpu.get_sequence_parallel_group(), self.sequence.rank, sp)
        full_shapes = {name: p.shape for name, p in model.named_parameters()}
        optimizer, self.optimizer_line = None, None
        if cfg.optim.name == "muon":
            check_muon_layout(cfg)
            groups_, self.optimizer_line = muon_param_groups(model, cfg.optim, tp)
            # (built on the parameters AutoTP shards)
            optimizer = functools.partial(MuonWithAdamW, fused=True, cpu_bf16_matmul=cfg.train.cpu_bf16_matmul)
        else:
            groups_ = param_groups(model, cfg.optim.weight_decay, cfg.optim.decay_norms_and_embeddings)
        self.compiled = compile_enabled(cfg, self.device.type)
        if self.compiled and self.zero_stage == 3:
            gather_whole_blocks(model)  # (ZeRO-3's hooks around each compiled block, outside its graph)
        import_own_muon_uncompiled()  # (ZeRO's start imports DeepSpeed's Muon, which compiles as it loads)
        sliced = slices_made_by_autotp(model, cfg, self.device, init_state, groups_) if tp > 1 else nullcontext()
        with sliced:
            self.engine, *_ = deepspeed.initialize(
                model=model,
                model_parameters=groups_,
                optimizer=optimizer,
                config=ds_config,
                lr_scheduler=make_scheduler(cfg),
                mpu=mpu,
            )
        return_free_memory()  # (the model's construction and DeepSpeed's start-up freed their transients)
        self.tp_rank = groups.get_tensor_model_parallel_rank() if tp > 1 else 0
        inner = checkpointer.innermost_optimizer(self.engine)
        self.partitions = build_partition_map(self.engine, inner, self.zero_stage, self.tp_rank)  # (a collective)
        self.muon_owner_line = None
        if cfg.optim.name == "muon":
            self.muon_owner_line = inner.bind(self.engine.module, self.partitions, tp)
        if tp > 1:
            check_tensor_parallel_shards(self.engine.module, full_shapes, tp)
            check_batch_without_masks(self.engine)
        install_device_step(self.engine.optimizer)  # (bf16 ZeRO-1: the norm and clipping without host reads)
        if self.compiled:
            compile_blocks(self.engine.module)
        self.dp_rank = data_parallel_rank() if tp > 1 else dist_info.rank // sp
        self.dp_size = self.sizes.dp
        self.checkpointer = checkpointer.Checkpointer(self.engine, self.partitions, cfg, self.device)
        if tp > 1:
            assign_head_offsets(self.engine.module, self.tp_rank, tp)
            sum_partial_gradients(self.engine.module, groups.get_tensor_model_parallel_group())
            sum_shared_key_gradients(self.engine.module, groups.get_tensor_model_parallel_group())
        # the ranks DeepSpeed divides the summed gradients by: the data-parallel ones, except in ZeRO-3's
        # reduce-scatter, which divides by all ranks it partitions over, sequence-parallel peers included
        self.averaged_ranks = self.dp_size * (sp if self.zero_stage == 3 else 1)
        if self.dp_size == 1 and sp == 1 and self.zero_stage == 0:
            # one data-parallel rank: DeepSpeed's all-reduce over it would only copy every gradient into a
            # flat buffer and back (tensor-parallel peers' replicated gradients are equal already)
            self.engine.enable_backward_allreduce = False
        # forward and backward passes run in it: fp32 GEMMs for bf16 on CPUs without bf16 kernels (cpu_bf16.py)
        self.matmuls = matmul_context(
            gemms_as_fp32(cfg.train.cpu_bf16_matmul, self.device, precision_dtype(cfg.precision), self.compiled)
        )
        # ZeRO-3: a forward pass leaves the weights it gathered to be freed, not held by autograd till the backward
        self.saved_weights = weights_saved_by_place if self.zero_stage == 3 and not self.compiled else nullcontext
        # flash-attn's varlen metadata is built only where a varlen kernel may run
        self.varlen = self.device.type == "cuda" and cfg.model.attention_backend in VARLEN_BACKENDS
        activate_for(cfg.model.attention_backend, self.device.type)  # flash-attn 4 / 3, before compiling
        self._unread: Judged | None = None  # the step whose result is read during the next (advance)
        self._staged = StagedCopy()

    # ------------------------------------------------------------------------------------ one step

    def step(
        self,
        batches: Iterator[Mapping[str, torch.Tensor]],
        stop_requested: Callable[[], bool] = lambda: False,
        spikes: SpikeLadder | None = None,
        save_due: Callable[[], bool] = lambda: False,
    ) -> StepResult:
        """Forward/backward every micro batch of one optimizer step, then step (or skip a bad step); its result
        read at once. ``spikes`` (judging the global batch's loss and the global gradient norm before clipping,
        the same numbers on every rank) may refuse a finite step's update (a loss or gradient-norm spike).

        The loss is the mean over every loss token of the global batch (all micro batches, all data-parallel
        ranks), not a mean of per-batch means, so padding and variable loss counts (masked-LM) weigh right.
        A non-finite loss or gradient on any rank skips the update on every rank (weights, Adam moments and
        the schedule unchanged); with fp16, DeepSpeed's loss scaler skips overflowing steps on its own.
        ``stop_requested()`` is asked at the step's end: a stop asked for during the step ends the run after it;
        ``save_due()`` too, and a True on any rank sets ``save_due`` of the result on every rank.
        """
        return self.advance(batches, stop_requested, spikes, save_due)[-1]

    def advance(
        self,
        batches: Iterator[Mapping[str, torch.Tensor]],
        stop_requested: Callable[[], bool] = lambda: False,
        spikes: SpikeLadder | None = None,
        save_due: Callable[[], bool] = lambda: False,
        index: int = 0,
        read: bool = True,
    ) -> list[StepResult]:
        """One step as :meth:`step` (``index``: its number in the run, its result's ``step``), returning the
        results read in it, oldest first: the previous step's, if it was left to read, then this one's. Where
        :attr:`decides_on_device` and ``read`` is False, this step's result is left to read: its statistics are
        read during the next call (after that step's forward and backward passes are queued) or by
        :meth:`settle`; until then the schedule and ``spikes`` have not seen it."""
        accum, engine = self.sizes.accum, self.engine
        host = [next(batches) for _ in range(accum)]
        tokens = sum(positions(b) for b in host) * self.dp_size  # every rank's batches have one shape
        parts = [self.split(b) for b in host]
        # counted on this rank's part: the ranks of a sequence group hold disjoint parts of the same rows
        targets = sum(int(np.count_nonzero(local["labels"].numpy() != IGNORE_INDEX)) for _, local in parts)
        # each rank of a sequence group counts its share of the whole rows' documents
        flops = sum(self.model_flops(whole) for whole, _ in parts) / self.cfg.parallel.sequence_parallel
        # DeepSpeed averages gradients over micro batches and data-parallel ranks; undo that so the gradient
        # is that of (sum of token losses) / (loss tokens in the global batch). Summed on the device: no wait.
        global_targets = self._on_device([float(targets)])
        dist.all_reduce(global_targets)  # tensor-parallel peers count the same batches: tp copies
        scale = (accum * self.averaged_ranks * self.tp) / global_targets.clamp(min=1.0)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        z_sum = torch.zeros((), dtype=torch.float64, device=self.device)  # (the z-loss's part of loss_sum)
        objective = {"label_smoothing": self.cfg.train.label_smoothing}
        if self.cfg.train.z_loss:
            objective["z_loss"] = self.cfg.train.z_loss
        bad = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (whole, local) in enumerate(parts):
            inputs, labels, masks = self.to_device(local, whole)
            with self.matmuls():
                with self.saved_weights():
                    loss = engine(**inputs, masks=masks, labels=labels, **objective)
                if "z_loss" in objective:
                    loss, z = loss
                    z_sum += z
                loss_sum += loss.detach()
                bad += (~torch.isfinite(loss.detach())).double()
                engine.backward(loss * scale)
            if i < accum - 1:
                engine.step()  # (not a boundary: DeepSpeed only counts the micro step)
        # the previous step's result, its statistics long computed by now: the schedule and the spike
        # thresholds this step's update uses know it
        results = self.settle(spikes)
        lr = engine.get_lr()[0]
        # the boundary: one reduction of the step's statistics, once the gradient norm is known: here without
        # ZeRO, inside DeepSpeed's step (before the update) with it; the verdict on the update taken on the device
        # (:meth:`_device_verdict`) or, where the optimizer cannot skip on the device, read on the host
        flags = [float(stop_requested()), float(save_due()), flops]
        stats = torch.cat([torch.stack([loss_sum, bad, z_sum]), self._on_device(flags)])
        limits = spikes.limits() if spikes is not None else (math.inf, math.inf)
        judged: list[Judged] = []

        def judge(norm: torch.Tensor | None, on_device: bool = self.decides_on_device) -> bool | torch.Tensor:
            entry = Judged(self._reduce(stats, global_targets, norm), norm is not None)
            if on_device:
                entry.apply_on_device = self._device_verdict(entry.reduced, entry.norm_computed, limits)
            else:
                entry.verdict = self._verdict(entry.reduced.tolist(), entry.norm_computed, spikes)
            judged.append(entry)
            return entry.answer

        if self.zero_stage == 0:
            judge(unclipped_grad_norm(engine.module, self.tp) / getattr(engine.optimizer, "loss_scale", 1.0))
        skipped_before = engine.skipped_steps
        with gated_update(engine, lambda: judged[0].answer if judged else judge(zero_grad_norm(engine))):
            engine.step()
        if not judged:  # ZeRO skipped the update before asking: non-finite gradients (fp16: the loss scale)
            judge(None, on_device=False)
            judged[0].verdict.grad_norm = math.nan
        current = judged[0]
        current.index, current.tokens, current.lr = index, tokens, lr
        # ZeRO skips a step with non-finite gradients on its own (and counts it); with fp16 that is the loss
        # scaler finding its scale, which is routine, not divergence
        current.zero_skipped = self.cfg.precision != "fp16" and engine.skipped_steps != skipped_before
        if current.apply_on_device is not None and not read:
            current.staged = self._staged.stage(current.decided())
            self._unread = current
            return results
        return results + [self._result(current, spikes)]

    @functools.cached_property
    def decides_on_device(self) -> bool:
        """Whether the verdict on an update is taken on the device, the optimizer stepping either way and
        skipping by the verdict (PyTorch's fused Adam/AdamW: the ``found_inf`` of its kernel, which leaves weights,
        moments and step count unchanged): the host then reads it when it likes. Otherwise the host reads the
        step's statistics before the update (fp16, whose loss scaler reads them anyway; Muon; DeepSpeed's CPU Adam)."""
        inner = checkpointer.innermost_optimizer(self.engine)
        fused = type(inner) in (torch.optim.Adam, torch.optim.AdamW) and all(g.get("fused") for g in inner.param_groups)
        return fused and self.cfg.precision != "fp16"

    def settle(self, spikes: SpikeLadder | None = None) -> list[StepResult]:
        """The result of the step left to read, if any (read now: a wait for the device), as a list; the
        schedule moves on and ``spikes`` judges it."""
        step, self._unread = self._unread, None
        return [] if step is None else [self._result(step, spikes)]

    def discard(self) -> None:
        """Forget the step left to read (the run goes back to a checkpoint, which restores what it changed)."""
        self._unread = None

    def _result(self, step: Judged, spikes: SpikeLadder | None) -> StepResult:
        """``step``'s result: the verdict read on the host (one step late where it was staged) and checked
        against the device's, the schedule moved on where the update was applied."""
        if step.verdict is None:
            values = step.staged.values() if step.staged is not None else step.decided().tolist()
            applied = values.pop() > 0
            step.verdict = self._verdict(values, step.norm_computed, spikes)
            if step.verdict.apply != applied:
                raise RuntimeError(
                    f"step {step.index}: the device's verdict on the update ({'applied' if applied else 'skipped'}) "
                    "differs from the host's on the same statistics"
                )
            if applied:
                self.engine.lr_scheduler.step()  # (held back in the step: gated_update)
        verdict = step.verdict
        finite = verdict.finite and not step.zero_skipped
        # (loss sums and counts are both counted once per tensor-parallel peer)
        return StepResult(
            verdict.loss,
            step.tokens,
            verdict.model_flops / self.tp,
            finite,
            verdict.stop,
            step.lr,
            verdict.rejected,
            verdict.grad_norm,
            verdict.z_loss,
            verdict.save_due,
            step.index,
        )

    def _reduce(self, stats: torch.Tensor, global_targets: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """This rank's ``stats`` (loss sum, non-finite losses, z-loss sum, stop and save flags, model FLOPs) and
        the gradient norm ``norm`` (a device scalar, rank 0's: every rank holds the same; None: none computed),
        all-reduced, with the global count of loss tokens after them: one vector, the same on every rank."""
        slot = torch.zeros(1, dtype=torch.float64, device=self.device)
        if norm is not None and dist.get_rank() == 0:
            # (DeepSpeed's norms report a non-finite norm as -1)
            slot = torch.where(norm >= 0, norm.double(), math.nan).reshape(1).to(self.device)
        stats = torch.cat([stats, slot])
        dist.all_reduce(stats)
        return torch.cat([stats, global_targets])

    def _device_verdict(self, reduced: torch.Tensor, norm_computed: bool, limits: tuple[float, float]) -> torch.Tensor:
        """Whether to apply the update, a device bool from the reduced statistics (:meth:`_reduce`) and the
        spike limits of the loss and the gradient norm (:meth:`SpikeLadder.limits`): the host's
        :meth:`_verdict` on the same numbers, in the same float64 arithmetic."""
        loss_total, n_bad, z_total, _, _, _, grad_norm, targets = reduced.unbind()
        loss = (loss_total - z_total) / targets.clamp(min=1.0)
        finite = n_bad == 0
        spiked = loss > limits[0]
        if norm_computed:
            finite = finite & grad_norm.isfinite()
            spiked = spiked | (grad_norm > limits[1])
        return finite & ~spiked

    def _verdict(self, values: list[float], norm_computed: bool, spikes: SpikeLadder | None) -> Verdict:
        """The verdict on the update from the reduced statistics (:meth:`_reduce`) read on the host; ``spikes``
        judges a finite step (and learns from one it accepts)."""
        loss_total, n_bad, z_total, stop, save, flops_total, grad_norm, targets_total = values
        # the cross-entropy and the z-loss apart (the loss optimised is their sum)
        loss = (loss_total - z_total) / max(targets_total, 1.0)
        z_loss = z_total / max(targets_total, 1.0) if self.cfg.train.z_loss else None
        grad_norm = grad_norm if norm_computed else None
        norm_finite = grad_norm is None or math.isfinite(grad_norm)
        # (fp16: non-finite gradients are the loss scaler's to skip)
        finite = n_bad == 0 and (norm_finite or self.cfg.precision == "fp16")
        rejected = finite and spikes is not None and spikes.rejects(loss, grad_norm if norm_finite else None)
        return Verdict(loss, grad_norm, finite, rejected, stop > 0, flops_total, z_loss, save > 0)

    # ---------------------------------------------------------------------------------- checkpoints

    def save(self, state: TrainerState, loader_state: dict, keep: tuple[str, ...] = ()) -> Path:
        """Start checkpointing step ``state.step`` (every rank calls it; the files are written in the
        background); ``keep``: checkpoints rotation must spare."""
        if self._unread is not None:
            raise RuntimeError(f"step {self._unread.index}'s result is still to be read: settle() before saving")
        return self.checkpointer.save(state, loader_state, keep)

    def load(self, plan: ResumePlan) -> tuple[TrainerState, dict | list[dict]]:
        """Restore the engine (built from ``plan``'s weights), schedule and RNG from ``plan``'s checkpoint;
        returns the trainer state (of this layout) and what the train loader continues from (this rank's
        state, or every old rank's)."""
        loader_states = self.checkpointer.load(plan.path, plan.state.world_size, plan.elastic is None)
        layout = {
            "world_size": dist.get_world_size(),
            "tensor_parallel": self.tp,
            "sequence_parallel": self.cfg.parallel.sequence_parallel,
            "zero_stage": self.zero_stage,
        }
        return plan.state.model_copy(update=layout), loader_states

    def split(self, batch: Mapping[str, torch.Tensor]) -> tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]:
        """The batch the masks are built from and the part of it this rank runs: the same batch twice,
        unless sequence parallelism splits it (:meth:`SequenceShard.split`)."""
        return (batch, batch) if self.sequence is None else self.sequence.split(batch)

    def to_device(
        self, batch: Mapping[str, torch.Tensor], whole: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, ModelMasks]:
        """A loader batch as model inputs, labels and attention masks on the device (:func:`batch_to_device`;
        on CUDA the copies come from pinned memory and do not wait); ``whole``: the batch the masks describe,
        when ``batch`` is this rank's part of its sequences."""
        return batch_to_device(batch, self.device, self.cfg.model.arch, self.varlen, whole)

    @functools.cached_property
    def size(self) -> ModelSize:
        return model_size(self.cfg.model, self.cfg.data.seq_len)

    def model_flops(self, batch: Mapping[str, torch.Tensor]) -> float:
        """The training FLOPs of ``batch``'s documents (:func:`flops.documents_flops`), counted on the host."""
        if self.cfg.model.arch == "encoder_decoder":
            return self.size.flops_per_token * real_positions(batch)
        segments = batch.get("segment_ids")
        shape = tuple(batch["input_ids"].shape)
        return documents_flops(self.size, document_lengths(None if segments is None else segments.numpy(), shape))

    def _on_device(self, values: list[float]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.float64)
        return to_device(host, self.device)

    def close(self) -> None:
        """Remove DeepSpeed's gradient hooks (``DeepSpeedEngine.destroy``, DeepSpeed 0.19.8): their closures,
        held by the autograd graph where the garbage collector cannot see them, keep the engine, its model and
        the process groups it holds alive to the interpreter's shutdown, their gloo threads running. The module
        steps no more."""
        self.engine.destroy()
        del self.engine, self.checkpointer  # (the groups' last holders: teardown ends them)

    # ---------------------------------------------------------------------------------- evaluation

    @torch.no_grad()
    def evaluate(self, batches: list[Mapping[str, torch.Tensor]]) -> dict[str, float]:
        """Token-weighted loss over ``batches`` (the same list on every rank).

        Data-parallel rank r evaluates batches r, r + dp, ... (its tensor-parallel peers the same ones) and the
        sums are all-reduced: the numbers of one rank evaluating them all, in 1/dp of the time. A rank with a
        batch fewer runs one more forward and drops its result, so all ranks run the same forwards (ZeRO-3
        gathers parameters in each).
        """
        self.engine.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, loss tokens
        for index in eval_schedule(len(batches), self.dp_size, self.dp_rank):
            whole, local = self.split(batches[index or 0])
            inputs, labels, masks = self.to_device(local, whole)
            with self.matmuls():
                loss = self.engine(**inputs, masks=masks, labels=labels)
            if index is not None:
                sums += torch.stack([loss.double(), (labels != IGNORE_INDEX).sum().double()])
        self.engine.train()
        dist.all_reduce(sums)
        loss_sum, targets = (x / self.tp for x in sums.tolist())
        loss = loss_sum / max(targets, 1)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": int(targets)}

    def item_share(self) -> tuple[int, int]:
        """(this rank's share, the number of shares) of items each rank runs :meth:`plain_model` on alone: one a
        data-parallel rank, and one each of its sequence-parallel peers (the plain model runs whole sequences);
        tensor-parallel peers run the same share, the same forwards, each summing their parts. At ZeRO-3 every
        rank runs each forward in step with the others: a forward gathers the parameters from all of them."""
        if self.sequence is None:
            return self.dp_rank, self.dp_size
        return self.dp_rank * self.sequence.size + self.sequence.rank, self.dp_size * self.sequence.size

    @property
    def forwards_together(self) -> bool:
        """Whether each forward of :meth:`plain_model` needs every rank (ZeRO-3 gathers each layer's parameters
        from all of them; tensor-parallel peers sum their parts): the ranks then run their forwards in step."""
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        return (self.zero_stage == 3 or self.tp > 1) and ranks > 1

    @contextmanager
    def plain_model(self) -> Iterator[torch.nn.Module]:
        """The model as a module this rank runs on inputs of its own (in the run's precision, evaluation mode),
        outside DeepSpeed's forward: whole sequences, also under sequence parallelism (:func:`whole_sequences`);
        compiled code where it fits the inputs, eager where it would have to compile again."""
        self.engine.eval()
        try:
            with whole_sequences(self.engine.module) as model, eager_on_recompile() if self.compiled else nullcontext():
                yield model
        finally:
            self.engine.train()


def batch_to_device(
    batch: Mapping[str, torch.Tensor],
    device: torch.device,
    arch: str,
    varlen: bool = False,
    whole: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, ModelMasks]:
    """A loader batch as model inputs, labels and attention masks on ``device``: the masks' metadata built
    from the host tensors of ``whole`` (default: ``batch``), each tensor copied once (a segment tensor the
    masks share with the inputs too)."""
    moved = {k: to_device(v, device) for k, v in batch.items()}
    masks = batch_masks(arch, batch if whole is None else whole, varlen=varlen)
    masks = masks.to(device, {id(batch[k]): moved[k] for k in batch})
    labels = moved.pop("labels")
    return moved, labels, masks


def positions(batch: Mapping[str, torch.Tensor]) -> int:
    """Input positions of a batch (both stacks of an encoder-decoder), padding included."""
    return sum(batch[key].numel() for key in ("input_ids", "decoder_input_ids") if key in batch)


def real_positions(batch: Mapping[str, torch.Tensor]) -> int:
    """Input positions that hold a token (segment ids mark padding), counted on the host."""
    total = 0
    for ids, segments in (("input_ids", "segment_ids"), ("decoder_input_ids", "decoder_segment_ids")):
        if ids in batch:
            total += (
                int(np.count_nonzero(batch[segments].numpy() != PAD_SEGMENT))
                if segments in batch
                else batch[ids].numel()
            )
    return total


def eval_schedule(n_batches: int, dp_size: int, dp_rank: int) -> list[int | None]:
    """The validation batches data-parallel rank ``dp_rank`` evaluates, round by round: ``dp_rank``,
    ``dp_rank + dp_size``, ...; None marks a round whose forward only keeps this rank in step with the others."""
    rounds = -(-n_batches // dp_size)
    return [i if i < n_batches else None for i in range(dp_rank, rounds * dp_size, dp_size)]


@contextmanager
def gated_update(engine, apply: Callable[[], bool | torch.Tensor]):
    """The optimizer step inside this block asks ``apply()``, once, when the innermost optimizer is about to
    update (DeepSpeed's ZeRO has computed the gradient norm and clipped by then), whether to change anything.
    When not, weights, Adam moments, the optimizer's step count and the learning-rate schedule stay as they
    were (DeepSpeed still zeroes the gradients), which is what DeepSpeed's ZeRO optimizers do on their own for
    non-finite gradients (they return before the update, and ``apply`` is not asked).

    An answer on the device (a bool tensor) is not read: the optimizer steps with it as ``found_inf`` (PyTorch's
    fused Adam skips by it in its kernel), and the schedule is held back, for the reader of the verdict to move
    on (:meth:`TrainModule.settle`).
    """
    answer: list[bool | torch.Tensor] = []  # apply()'s, once asked

    def gate(step: Callable, asks: bool) -> Callable:
        @functools.wraps(step)  # (with the mark torch's LR scheduler leaves on the optimizer's step)
        def gated(*args, **kwargs):
            if asks and not answer:
                answer.append(apply())
            if answer and isinstance(answer[0], torch.Tensor):
                if not asks:  # (the schedule: moved on by the verdict's reader)
                    return None
                inner.found_inf = (~answer[0]).float()
                try:
                    return step(*args, **kwargs)
                finally:
                    del inner.found_inf
            if answer and not answer[0]:
                return None
            return step(*args, **kwargs)

        return gated

    inner = checkpointer.innermost_optimizer(engine)
    # (torch's LR scheduler may already have wrapped the optimizer's step on the instance: put it back)
    patched = [(obj, vars(obj).get("step")) for obj in (inner, engine.lr_scheduler) if obj is not None]
    for obj, _ in patched:
        obj.step = gate(obj.step, asks=obj is inner)
    try:
        yield
    finally:
        for obj, own in patched:
            if own is None:
                del obj.step
            else:
                obj.step = own


def sum_shared_key_gradients(model: torch.nn.Module, group) -> None:
    """Multi-head latent attention's RoPE key is one per token for all heads, read by every tensor-parallel
    shard's heads: its gradient is summed over the shards (DeepSpeed's ``ColumnParallel``, the identity forward
    and an all-reduce backward, which its column-parallel layers apply to their inputs too)."""
    from deepspeed.module_inject.layers import ColumnParallel

    for module in model.modules():
        if isinstance(module, LatentAttention):
            module.shared_key = functools.partial(ColumnParallel.apply, group)


def zero_grad_norm(engine) -> torch.Tensor | None:
    """The global gradient norm before clipping that DeepSpeed's ZeRO (or bf16) optimizer computed in this
    step, once it is about to update: a device scalar (-1 where non-finite), or None if it computes none."""
    norm = getattr(engine.optimizer, "_global_grad_norm", None)
    return None if norm is None else torch.as_tensor(norm)


def unclipped_grad_norm(module: torch.nn.Module, tensor_parallel: int) -> torch.Tensor:
    """Global gradient norm without ZeRO (whose optimizer computes it for us), as a device tensor:
    tensor-parallel shards' squares are summed over the tensor-parallel group (on the gradients' device),
    replicated parameters counted once."""
    sharded, replicated = [], []
    for name, param in module.named_parameters():
        if param.grad is not None:
            split = tensor_parallel > 1 and partition_dim(name) is not None
            (sharded if split else replicated).append(param.grad.detach())
    device = next(module.parameters()).device
    squares = [squared_norm(grads, device).to(device) for grads in (sharded, replicated)]
    if tensor_parallel > 1:
        from deepspeed.utils import groups

        dist.all_reduce(squares[0], group=groups.get_tensor_model_parallel_group())
    return (squares[0] + squares[1]).sqrt()


def sum_partial_gradients(module: torch.nn.Module, group) -> None:
    """Sum the gradients of the replicated weights that each tensor-parallel rank applies to its own heads only
    (``tp_plan.PARTIAL_GRADIENTS``: QK-norm's) over the tensor-parallel ``group`` as autograd computes them, before
    DeepSpeed accumulates them: every rank then holds the whole gradient and takes the same update."""

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=group)
        return grad

    for name, param in module.named_parameters():
        if has_partial_gradient(name):
            param.register_hook(summed)


def check_tensor_parallel_shards(module: torch.nn.Module, full_shapes: Mapping[str, torch.Size], tp: int) -> None:
    """Every weight the plan splits holds 1/tp of its elements after DeepSpeed's AutoTP set-up.

    A DeepSpeed that does not apply custom partition patterns leaves the layers whole and would train a
    replicated model at tp times the cost with no error; this makes that an error at start-up.
    """
    for name, param in module.named_parameters():
        if partition_dim(name) is None or name.endswith(".bias") or name not in full_shapes:
            continue
        shape = param_shape(param)
        if math.prod(shape) * tp != math.prod(full_shapes[name]):
            raise ConfigError(
                f"tensor parallelism did not split {name}: it holds {tuple(shape)} of "
                f"{tuple(full_shapes[name])} on tensor_parallel={tp}; upgrade DeepSpeed "
                "(pip install -U deepspeed) or set parallel.tensor_parallel=1"
            )
