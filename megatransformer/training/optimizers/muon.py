"""Muon for the hidden matrices, AdamW for everything else, as one torch optimizer handed to DeepSpeed.

Which parameters Muon updates is read from the model's structure before DeepSpeed sees it (the weights of
``nn.Linear`` modules, tied embeddings and the output head excluded), never from tensor shapes, which ZeRO
flattens. The Muon update is ``torch.optim.Muon``'s, line for line (its Newton-Schulz iteration and its
learning-rate adjustment of the matrix shape), at every ZeRO stage and under tensor parallelism: each matrix is
orthogonalised once, by an owner rank chosen to balance Newton-Schulz's FLOPs, which receives every rank's
fragments of it (read from DeepSpeed's partition map) and sends each rank its fragments of the result. Design notes
and costs: docs/optimizers.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from megatransformer.config import ConfigError, OptimConfig
from megatransformer.flops import assign_owners, newton_schulz_flops
from megatransformer.model.matrices import hidden_matrix_names
from megatransformer.model.tp_plan import partition_dim
from megatransformer.training.deepspeed.internals import param_shape
from megatransformer.training.deepspeed.partitions import Fragment, PartitionMap

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
class Matrix:
    """A Muon matrix: ``shard`` is one tensor-parallel rank's part of it, ``tp`` such parts laid along ``tp_dim``
    make it whole; ``owner`` is the rank that orthogonalises it."""

    name: str
    shard: torch.Size
    tp_dim: int | None
    tp: int
    owner: int

    @property
    def shape(self) -> torch.Size:
        if self.tp_dim is None:
            return self.shard
        whole = list(self.shard)
        whole[self.tp_dim] *= self.tp
        return torch.Size(whole)


def owner_line(matrices: list[Matrix], ranks: int) -> str:
    """The run log's line on how the matrices are split among their owners."""
    counts, flops = [0] * ranks, [0] * ranks
    for m in matrices:
        counts[m.owner] += 1
        flops[m.owner] += newton_schulz_flops(m.shape)
    total = sum(flops) or 1
    shares = " ".join(f"{c}/{100 * f / total:.1f}%" for c, f in zip(counts, flops))
    return (
        f"Muon owners: each of {len(matrices)} matrices orthogonalised once, by one of {ranks} ranks "
        f"(max/mean Newton-Schulz FLOPs {max(flops) * ranks / total:.2f}); per rank, matrices/FLOPs: {shares}"
    )


@dataclass(frozen=True)
class Exchange:
    """What this rank sends and receives to orthogonalise the matrices of a set of flat buffers: each rank's
    fragments of a matrix to its owner (``gather``: (buffer, offset, numel) sent; (owned matrix, tensor-parallel
    shard, start, numel) received), the owner's result back to every rank that holds a fragment (``scatter``:
    (owned matrix, shard, start, numel) sent; (buffer, offset, numel, matrix) received), in the order of the
    ranks, with the element counts per rank (``*_splits``)."""

    owned: tuple[Matrix, ...]
    gather_send: tuple[tuple[int, int, int], ...]
    gather_send_splits: tuple[int, ...]
    gather_recv: tuple[tuple[int, int, int, int], ...]
    gather_recv_splits: tuple[int, ...]
    scatter_send: tuple[tuple[int, int, int, int], ...]
    scatter_send_splits: tuple[int, ...]
    scatter_recv: tuple[tuple[int, int, int, Matrix], ...]
    scatter_recv_splits: tuple[int, ...]


def plan_exchange(matrices: dict[str, Matrix], fragments: list[Fragment], rank: int, world: int) -> Exchange:
    """The :class:`Exchange` of ``fragments`` (every rank's, of the buffers stepped together) for ``rank``. Ranks
    holding the same elements (ZeRO-0's replicas) send them once: the owner's copy, else the lowest rank's."""
    order = {name: i for i, name in enumerate(matrices)}

    def shard(f: Fragment) -> int:
        return f.tp_rank if matrices[f.name].tp_dim is not None else 0

    def key(f: Fragment) -> tuple[int, int, int]:
        return order[f.name], shard(f), f.start

    sources: dict[tuple, Fragment] = {}
    for f in sorted(fragments, key=lambda f: (f.rank != matrices[f.name].owner, f.rank)):
        sources.setdefault((f.name, shard(f), f.start, f.numel), f)
    _check_cover(matrices, list(sources.values()), shard)
    owned = [m for m in matrices.values() if m.owner == rank and any(f.name == m.name for f in fragments)]
    index = {m.name: i for i, m in enumerate(owned)}

    def between(pool, src: int, dst: int) -> list[Fragment]:
        return sorted((f for f in pool if f.rank == src and matrices[f.name].owner == dst), key=key)

    gather_send, gather_recv, scatter_send, scatter_recv = [], [], [], []
    splits: list[list[int]] = [[], [], [], []]
    for other in range(world):
        out = between(sources.values(), rank, other)
        gather_send += [(f.buffer, f.offset, f.numel) for f in out]
        into = between(sources.values(), other, rank)
        gather_recv += [(index[f.name], shard(f), f.start, f.numel) for f in into]
        back = between(fragments, other, rank)
        scatter_send += [(index[f.name], shard(f), f.start, f.numel) for f in back]
        mine = between(fragments, rank, other)
        scatter_recv += [(f.buffer, f.offset, f.numel, matrices[f.name]) for f in mine]
        for i, part in enumerate((out, into, back, mine)):
            splits[i].append(sum(f.numel for f in part))
    return Exchange(
        tuple(owned),
        tuple(gather_send),
        tuple(splits[0]),
        tuple(gather_recv),
        tuple(splits[1]),
        tuple(scatter_send),
        tuple(splits[2]),
        tuple(scatter_recv),
        tuple(splits[3]),
    )


def _check_cover(matrices: dict[str, Matrix], sources: list[Fragment], shard: Callable[[Fragment], int]) -> None:
    """Every element of every tensor-parallel shard of the matrices, in exactly one fragment: else the layout is one
    the owner split cannot serve."""
    held: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for f in sources:
        held.setdefault((f.name, shard(f)), []).append((f.start, f.numel))
    names = {f.name for f in sources}
    for name in names:
        m = matrices[name]
        for s in range(m.tp if m.tp_dim is not None else 1):
            end = 0
            for start, numel in sorted(held.get((name, s), [])):
                if start != end:
                    break
                end += numel
            if end != m.shard.numel():
                raise ConfigError(
                    f"optim.name=muon: DeepSpeed's partitions of {name} (tensor-parallel shard {s}) do not tile it "
                    "(overlapping or missing elements), a layout the Muon owner split cannot serve; use "
                    "optim.name=adamw, or another parallel.zero_stage / parallel.tensor_parallel"
                )


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the groups marked ``use_muon``, ``torch.optim.AdamW`` on the others, in one
    optimizer whose state (``momentum_buffer`` for Muon's matrices; ``exp_avg``, ``exp_avg_sq``, ``step`` for
    AdamW's tensors) saves and loads as any torch optimizer's.

    Bound to an engine (:meth:`bind`), each matrix is orthogonalised once, by its owner rank: ``matrices`` (by
    name, owners assigned), ``partitions`` (DeepSpeed's map of which rank holds which elements in which flat
    buffer). Unbound, every matrix is orthogonalised where it is stepped. ``orthogonalize`` counts its calls in
    ``ns_calls``."""

    def __init__(self, groups: list[dict], fused: bool = False) -> None:
        super().__init__(groups, {})
        self.partitions: PartitionMap | None = None
        self.matrices: dict[str, Matrix] = {}
        self.ns_calls = 0
        self._exchanges: dict[tuple[int, ...], Exchange] = {}
        self._tp_dims = {id(p): g["tp_dim"] for g in self.param_groups if g["use_muon"] for p in g["params"]}
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    _check_matrix(p, param_shape(p))  # (ZeRO-3 built partitioned: the shape it keeps aside)
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._adamw = torch.optim.AdamW(adam_groups, fused=fused) if adam_groups else None

    def bind(self, module: nn.Module, partitions: PartitionMap, tp: int) -> str:
        """Orthogonalise each matrix of ``module`` once, at its owner, from the fragments ``partitions`` maps; the
        run log's line on the owners. ``tp``: the tensor-parallel degree the matrices' ``tp_dim`` splits by."""
        named = [(name, p) for name, p in module.named_parameters() if id(p) in self._tp_dims]
        unmapped = [name for name, _ in named if name not in partitions.shapes]
        if unmapped:
            raise ConfigError(
                f"optim.name=muon: DeepSpeed steps {unmapped[0]} (and {len(unmapped) - 1} more matrices) inside a "
                "buffer its partition map does not know, a layout the Muon owner split cannot serve; use "
                "optim.name=adamw, or another precision / parallel.zero_stage"
            )
        shards = [(name, partitions.shapes[name], self._tp_dims[id(p)]) for name, p in named]
        unsplit = [Matrix(name, shape, dim, tp if dim is not None else 1, 0) for name, shape, dim in shards]
        owners = assign_owners([newton_schulz_flops(m.shape) for m in unsplit], partitions.world_size)
        self.matrices = {m.name: replace(m, owner=o) for m, o in zip(unsplit, owners)}
        self.partitions, self._exchanges = partitions, {}
        plan_exchange(self.matrices, partitions.of(set(self.matrices)), 0, partitions.world_size)  # (the cover check)
        return owner_line(list(self.matrices.values()), partitions.world_size)

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
        updates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            buffer = self.partitions.buffers.get(id(p)) if self.partitions is not None else None
            if buffer is None:
                _check_matrix(p, p.shape)  # (a wrapper may have put its own copies of the parameters into the groups)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.lerp_(p.grad, 1 - beta)
            update = p.grad.lerp(buf, beta) if group["nesterov"] else buf
            p.mul_(1 - lr * wd)
            if buffer is None:
                orthogonal = self.orthogonalize(update, group["ns_steps"], group["ns_dtype"])
                p.add_(orthogonal, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
            else:
                updates[buffer] = p, update
        if updates:
            self._orthogonalize_at_owners(updates, group)

    def _orthogonalize_at_owners(self, updates: dict[int, tuple[torch.Tensor, torch.Tensor]], group: dict) -> None:
        """Send each rank's fragments of the matrices in the flat buffers ``updates`` (buffer number: the tensor
        stepped, its update) to the matrices' owners, orthogonalise there, send each rank its fragments of the
        results back and step them."""
        key = tuple(sorted(updates))
        exchange = self._exchanges.get(key)
        if exchange is None:
            fragments = [f for f in self.partitions.of(set(self.matrices)) if f.buffer in updates]
            exchange = plan_exchange(self.matrices, fragments, _rank(), self.partitions.world_size)
            self._exchanges[key] = exchange
        first = next(iter(updates.values()))[1]
        dtype, device = first.dtype, first.device
        sent = _pack([updates[b][1].view(-1).narrow(0, at, n) for b, at, n in exchange.gather_send], first)
        received = _all_to_all(sent, exchange.gather_recv_splits, exchange.gather_send_splits)
        del sent
        shards = [
            torch.empty(m.tp if m.tp_dim is not None else 1, m.shard.numel(), dtype=dtype, device=device)
            for m in exchange.owned
        ]
        at = 0
        for i, s, start, n in exchange.gather_recv:
            shards[i][s, start : start + n] = received[at : at + n]
            at += n
        del received
        for i, m in enumerate(exchange.owned):
            parts = [shard.view(m.shard) for shard in shards[i]]
            whole = torch.cat(parts, m.tp_dim) if len(parts) > 1 else parts[0]
            orthogonal = self.orthogonalize(whole, group["ns_steps"], group["ns_dtype"]).to(dtype)
            shards[i] = torch.stack([c.reshape(-1) for c in orthogonal.chunk(len(parts), m.tp_dim or 0)])
        sent = _pack([shards[i][s, start : start + n] for i, s, start, n in exchange.scatter_send], first)
        del shards
        received = _all_to_all(sent, exchange.scatter_recv_splits, exchange.scatter_send_splits)
        del sent
        at = 0
        for b, offset, n, m in exchange.scatter_recv:
            rate = _adjust_lr(group["lr"], group["adjust_lr_fn"], m.shape)
            updates[b][0].view(-1).narrow(0, offset, n).add_(received[at : at + n], alpha=-rate)
            at += n

    def orthogonalize(self, update: torch.Tensor, steps: int, dtype: str) -> torch.Tensor:
        self.ns_calls += 1
        if dtype == "bf16":
            return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, steps, NS_EPS)
        return newton_schulz_fp32(update, steps)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _pack(pieces: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(pieces) if pieces else like.new_empty(0)


def _all_to_all(sent: torch.Tensor, recv_splits: tuple[int, ...], send_splits: tuple[int, ...]) -> torch.Tensor:
    """Each rank's ``send_splits[r]`` elements of ``sent`` to rank r; rank r's ``recv_splits[r]`` elements to us."""
    if len(send_splits) == 1:
        return sent
    received = sent.new_empty(sum(recv_splits))
    dist.all_to_all_single(received, sent, list(recv_splits), list(send_splits))
    return received


def _check_matrix(p: torch.Tensor, shape: torch.Size) -> None:
    if len(shape) != 2:
        raise ConfigError(
            f"optim.name=muon: a Muon parameter reached the optimizer as a tensor of shape {tuple(shape)} (a "
            "wrapper flattened it) whose layout the optimizer was not told (MuonWithAdamW.bind), so it cannot be "
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
