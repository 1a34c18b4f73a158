"""Muon for the hidden matrices, AdamW for everything else, as one torch optimizer handed to DeepSpeed.

Which parameters Muon updates is read from the model's structure before DeepSpeed sees it (the weights of
``nn.Linear`` modules, tied embeddings and the output head excluded), never from tensor shapes, which ZeRO
flattens. The Muon update is ``torch.optim.Muon``'s, line for line (its Newton-Schulz iteration and its
learning-rate adjustment of the matrix shape), at every ZeRO stage: where ZeRO hands the optimizer flat
partitions, the momentum stays partitioned and the update is gathered over the data-parallel group, each matrix
orthogonalised whole and the rank's part kept; under tensor parallelism each rank's shard of a matrix is gathered
over the tensor-parallel group alike. Design notes and costs: docs/optimizers.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from megatransformer.config import ConfigError, OptimConfig
from megatransformer.model.matrices import hidden_matrix_names
from megatransformer.model.tp_plan import partition_dim
from megatransformer.training.deepspeed_internals import fragment_mapping

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic
NS_EPS = 1e-7


def muon_param_groups(model: nn.Module, o: OptimConfig, tensor_parallel: int) -> tuple[list[dict], str]:
    """Parameter groups of :class:`MuonWithAdamW` for ``model`` and the run-log line that counts them.

    Muon groups carry ``tp_dim``, the dimension their weights are split along under tensor parallelism; AdamW's
    follow :func:`optim.param_groups`' weight-decay rule (matrices decayed; norms, biases, embeddings not)."""
    chosen = hidden_matrix_names(model)
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    linear -= {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}  # (a tied head's table)
    muon: dict[int | None, list[nn.Parameter]] = {}
    decay, no_decay, seen = [], [], set()
    muon_elements = adam_elements = 0
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if name in chosen:
            dim = partition_dim(name) if tensor_parallel > 1 else None
            muon.setdefault(dim, []).append(p)
            muon_elements += p.numel()
            continue
        adam_elements += p.numel()
        is_matrix = id(p) in linear
        (decay if o.decay_norms_and_embeddings or is_matrix else no_decay).append(p)
    muon_settings = {
        "use_muon": True,
        "lr": o.muon_lr,
        "weight_decay": o.muon_weight_decay,
        "momentum": o.muon_momentum,
        "nesterov": o.muon_nesterov,
        "ns_steps": o.muon_ns_steps,
        "ns_dtype": o.muon_ns_dtype,
        "adjust_lr_fn": o.muon_adjust_lr_fn,
    }
    groups = [{"params": ps, "tp_dim": dim, **muon_settings} for dim, ps in sorted(muon.items(), key=str)]
    adam = {"use_muon": False, "lr": o.lr, "betas": tuple(o.betas), "eps": o.eps}
    groups += [
        {"params": decay, "weight_decay": o.weight_decay, **adam},
        {"params": no_decay, "weight_decay": 0.0, **adam},
    ]
    n_muon = sum(len(g["params"]) for g in groups if g["use_muon"])
    line = (
        f"optimizer: Muon on {n_muon} matrices ({muon_elements:,} parameters, linear layers' weights), "
        f"AdamW on {len(decay) + len(no_decay)} tensors ({adam_elements:,}: embeddings, head, norms, biases)"
    )
    return [g for g in groups if g["params"]], line


@dataclass(frozen=True)
class MatrixPiece:
    """The part of one Muon matrix that a rank's flat ZeRO partition holds: elements ``lp_start`` to ``lp_start +
    numel`` of the flattened matrix, at ``hp_start`` of the partition. ``part`` > 0 (ZeRO-3: every matrix
    partitioned on its own): each rank's partition holds ``part`` elements of the matrix from ``start`` on;
    ``part`` = 0 (ZeRO-1/2: a group flattened, then partitioned): the matrix begins at ``start`` of the ranks'
    partitions laid end to end."""

    shape: torch.Size  # (this tensor-parallel rank's shard of the matrix)
    start: int
    part: int
    lp_start: int
    hp_start: int
    numel: int

    def whole(self, gathered: torch.Tensor) -> torch.Tensor:
        """The matrix, from all ranks' partitions (``gathered``: one row per rank)."""
        if self.part:
            flat = gathered[:, self.start : self.start + self.part].reshape(-1)
        else:
            flat = gathered.view(-1)[self.start :]
        return flat[: self.shape.numel()].view(self.shape)


@dataclass(frozen=True)
class FlatPartition:
    """A rank's flat ZeRO partition of Muon matrices and the data-parallel group that partitions them."""

    pieces: tuple[MatrixPiece, ...]
    group: dist.ProcessGroup


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the groups marked ``use_muon``, ``torch.optim.AdamW`` on the others, in one
    optimizer whose state (``momentum_buffer`` for Muon's matrices; ``exp_avg``, ``exp_avg_sq``, ``step`` for
    AdamW's tensors) saves and loads as any torch optimizer's.

    Set once the engine exists (:func:`bind_to_engine`): ``tp_group``, the tensor-parallel group the ``tp_dim``
    of a Muon group refers to; ``partitions``, the layout of each flat ZeRO partition of Muon matrices (by the
    partition's ``id``). ``orthogonalize`` counts its calls in ``ns_calls``."""

    def __init__(self, groups: list[dict], fused: bool = False) -> None:
        super().__init__(groups, {})
        self.tp_group: dist.ProcessGroup | None = None
        self.partitions: dict[int, FlatPartition] = {}
        self.ns_calls = 0
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    _check_matrix(p)
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._adamw = torch.optim.AdamW(adam_groups, fused=fused) if adam_groups else None

    @staticmethod
    def state_keys(group: dict) -> tuple[str, ...]:
        """The state the tensors of ``group`` keep: Muon's a momentum and no step count, AdamW's its own."""
        return ("momentum_buffer",) if group["use_muon"] else ("exp_avg", "exp_avg_sq", "step")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
        if self._adamw is not None:
            # (the same group dicts and state: the LR schedule and a loaded state dict reach both halves)
            self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            for group in self._adamw.param_groups:
                for key, value in self._adamw.defaults.items():
                    group.setdefault(key, value)
            self._adamw.state = self.state
            self._adamw.step()
        return loss

    def _muon_group(self, group: dict) -> None:
        lr, wd, beta = group["lr"], group["weight_decay"], group["momentum"]
        settings = group["tp_dim"], group["ns_steps"], group["ns_dtype"]
        for p in group["params"]:
            if p.grad is None:
                continue
            partition = self.partitions.get(id(p))
            if partition is None:
                _check_matrix(p)  # (a wrapper may have put its own copies of the parameters into the groups)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - beta)
            update = p.grad.lerp(buf, beta) if group["nesterov"] else buf
            p.mul_(1 - lr * wd)
            if partition is None:
                orthogonal, shape = self._orthogonalize_whole(update, *settings)
                p.add_(orthogonal, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))
                continue
            for piece, whole in self._gather_matrices(update, partition):
                orthogonal, shape = self._orthogonalize_whole(whole, *settings)
                mine = orthogonal.reshape(-1).narrow(0, piece.lp_start, piece.numel)
                p.narrow(0, piece.hp_start, piece.numel).add_(mine, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))

    @staticmethod
    def _gather_matrices(update: torch.Tensor, partition: FlatPartition) -> list[tuple[MatrixPiece, torch.Tensor]]:
        """Each matrix this rank's partition holds a part of, whole, from every rank's part of the update."""
        size = dist.get_world_size(partition.group)
        gathered = torch.empty(size * update.numel(), dtype=update.dtype, device=update.device)
        dist.all_gather_into_tensor(gathered, update.contiguous(), group=partition.group)
        return [(piece, piece.whole(gathered.view(size, -1))) for piece in partition.pieces]

    def _orthogonalize_whole(
        self, shard: torch.Tensor, dim: int | None, steps: int, dtype: str
    ) -> tuple[torch.Tensor, torch.Size]:
        """Newton-Schulz of the whole matrix whose tensor-parallel shard (along ``dim``) this rank holds; this
        rank's part of the result, and the whole matrix's shape."""
        if dim is None or self.tp_group is None:
            return self.orthogonalize(shard, steps, dtype), shard.shape
        size = dist.get_world_size(self.tp_group)
        parts = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(parts, shard.contiguous(), group=self.tp_group)
        whole = torch.cat(parts, dim)
        mine = self.orthogonalize(whole, steps, dtype).chunk(size, dim)[dist.get_rank(self.tp_group)]
        return mine, whole.shape

    def orthogonalize(self, update: torch.Tensor, steps: int, dtype: str) -> torch.Tensor:
        self.ns_calls += 1
        if dtype == "bf16":
            return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, steps, NS_EPS)
        return newton_schulz_fp32(update, steps)


def bind_to_engine(optimizer: MuonWithAdamW, zero, tp_group: dist.ProcessGroup | None) -> None:
    """Tell ``optimizer`` the tensor-parallel group and the layout of the flat partitions that ``zero`` (DeepSpeed's
    ZeRO-1/2, ZeRO-3 or bf16 optimizer wrapping it; any other wrapper hands it whole matrices) steps it with.

    Read from DeepSpeed 0.19.8's wrappers: ZeRO-1/2 and the bf16 optimizer flatten each parameter group and give
    each rank one contiguous partition (``fragment_mapping``: which elements of a parameter, where in the partition);
    ZeRO-3 partitions each parameter on its own and lays the rank's parts of a sub-group end to end
    (``grad_position``)."""
    optimizer.tp_group = tp_group
    optimizer.partitions = {}
    muon = [g["use_muon"] for g in optimizer.param_groups]
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
        group = zero.dp_process_group
        rank = dist.get_rank(group)
        for sub, (flat, params) in enumerate(zip(zero.fp32_partitioned_groups_flat, zero.fp16_groups)):
            if not muon[zero.sub_group_to_group_id[sub]]:
                continue
            pieces = []
            for param in params:
                _, offset, part = zero.grad_position[zero.get_param_id(param)]
                numel = min(part, param.ds_numel - rank * part)
                if numel > 0:
                    pieces.append(MatrixPiece(param.ds_shape, offset, part, rank * part, offset, numel))
            optimizer.partitions[id(flat)] = FlatPartition(tuple(pieces), group)
        return
    flats = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(zero, "fp32_groups_flat_partition", [])
    lows = getattr(zero, "bit16_groups", None) or getattr(zero, "bf16_groups", [])
    for i, (flat, params) in enumerate(zip(flats, lows)):
        if not muon[i]:
            continue
        group = zero.real_dp_process_group[i]
        base = dist.get_rank(group) * flat.numel()
        pieces = []
        for param in params:
            mapping = fragment_mapping(param)
            if mapping is None:
                continue  # (wholly in other ranks' partitions)
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            pieces.append(MatrixPiece(param.shape, base + hp.start - lp.start, 0, lp.start, hp.start, lp.numel))
        optimizer.partitions[id(flat)] = FlatPartition(tuple(pieces), group)


def _check_matrix(p: torch.Tensor) -> None:
    if p.ndim != 2:
        raise ConfigError(
            f"optim.name=muon: a Muon parameter reached the optimizer as a tensor of shape {tuple(p.shape)} (a "
            "wrapper flattened it) whose layout the optimizer was not told (muon.bind_to_engine), so it cannot be "
            "orthogonalised"
        )


def newton_schulz_fp32(update: torch.Tensor, steps: int) -> torch.Tensor:
    """``torch.optim.Muon``'s Newton-Schulz iteration in fp32 instead of bf16."""
    a, b, c = NS_COEFFICIENTS
    x = update.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x
