"""Muon for the hidden matrices, AdamW for everything else, as one torch optimizer handed to DeepSpeed.

Which parameters Muon updates is read from the model's structure before DeepSpeed sees it (the weights of
``nn.Linear`` modules, tied embeddings and the output head excluded), never from tensor shapes, which ZeRO
flattens. The Muon update is ``torch.optim.Muon``'s, line for line (its Newton-Schulz iteration and its
learning-rate adjustment of the matrix shape), at every ZeRO stage and under tensor parallelism: each matrix is
orthogonalised once, by an owner rank, or split by columns across a team of ranks, chosen to balance
Newton-Schulz's FLOPs; each owner receives every rank's elements of its block (read from DeepSpeed's partition map)
and sends each rank its elements of the result. On a CPU without bf16 GEMM kernels, bf16 Newton-Schulz computes its
products as fp32 GEMMs of the bf16 operands (``train.cpu_bf16_matmul``, training/runtime/cpu_bf16.py), as the
forward and backward passes do. Design notes and costs: docs/optimizers.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from megatransformer.config import ConfigError, OptimConfig
from megatransformer.flops import balance_teams, newton_schulz_flops, team_loads
from megatransformer.model.matrices import hidden_matrix_names
from megatransformer.model.tp_plan import partition_dim
from megatransformer.training.deepspeed.internals import param_shape
from megatransformer.training.deepspeed.partitions import Fragment, PartitionMap
from megatransformer.training.runtime.cpu_bf16 import gemms_as_fp32, matmul_context

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
            muon_elements += math.prod(param_shape(p))
            continue
        adam_elements += math.prod(param_shape(p))
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
    make it whole; ``team`` the ranks that orthogonalise it: one owner, or several that each take a block of its
    columns (in the orientation Newton-Schulz runs it, at most as tall as wide)."""

    name: str
    shard: torch.Size
    tp_dim: int | None
    tp: int
    team: tuple[int, ...]

    @property
    def shape(self) -> torch.Size:
        if self.tp_dim is None:
            return self.shard
        whole = list(self.shard)
        whole[self.tp_dim] *= self.tp
        return torch.Size(whole)

    @property
    def transposed(self) -> bool:
        """Whether a team runs Newton-Schulz on the transpose: tall or square, so that each member's columns are a
        block of the weight's rows (for a square matrix the same result, to rounding)."""
        rows, cols = self.shape
        return len(self.team) > 1 and rows >= cols

    def block(self, member: int) -> tuple[int, int, int, int]:
        """Rows and columns (first, end, first, end) of the weight that ``member`` of the team orthogonalises."""
        rows, cols = self.shape
        k = len(self.team)
        if k == 1:
            return 0, rows, 0, cols
        if self.transposed:
            return rows * member // k, rows * (member + 1) // k, 0, cols
        return 0, rows, cols * member // k, cols * (member + 1) // k


class Piece(NamedTuple):
    """``rows`` x ``cols`` elements of a flat tensor, from ``offset``, ``stride`` apart from row to row."""

    offset: int
    rows: int
    cols: int
    stride: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """The piece of the contiguous 1-D ``flat``, as a 2-D view."""
        if self.rows == 1:
            return flat.narrow(0, self.offset, self.cols).view(1, self.cols)
        return flat.as_strided((self.rows, self.cols), (self.stride, 1), flat.storage_offset() + self.offset)


def _rectangles(start: int, numel: int, cols: int) -> list[tuple[int, int, int, int]]:
    """Elements ``start`` to ``start + numel`` of a row-major matrix ``cols`` wide, as up to three rectangles (first
    row, end row, first column, end column): a partial first row, whole rows, a partial last row."""
    out, end = [], start + numel
    row, col = divmod(start, cols)
    if col:
        last = min(cols, col + numel)
        out.append((row, row + 1, col, last))
        start, row = start + last - col, row + 1
    if (end - start) // cols:
        whole = (end - start) // cols
        out.append((row, row + whole, 0, cols))
        start, row = start + whole * cols, row + whole
    if start < end:
        out.append((row, row + 1, 0, end - start))
    return out


def fragment_pieces(m: Matrix, f: Fragment, member: int) -> list[tuple[Piece, Piece]]:
    """The elements of fragment ``f`` (of tensor-parallel shard ``f.tp_rank`` of ``m``) in ``member``'s block: pairs
    of pieces, in the rank's flat buffer and in the block (row-major), at most three, joined where contiguous."""
    shard = f.tp_rank if m.tp_dim is not None else 0
    height, width = m.shard
    top, left = (shard * height, 0) if m.tp_dim == 0 else (0, shard * width if m.tp_dim == 1 else 0)
    r0, r1, c0, c1 = m.block(member)
    out: list[tuple[Piece, Piece]] = []
    for y0, y1, x0, x1 in _rectangles(f.start, f.numel, width):
        rows = min(y1 + top, r1) - max(y0 + top, r0)
        cols = min(x1 + left, c1) - max(x0 + left, c0)
        if rows <= 0 or cols <= 0:
            continue
        y, x = max(y0 + top, r0), max(x0 + left, c0)
        held = Piece(f.offset + (y - top) * width + (x - left) - f.start, rows, cols, width)
        into = Piece((y - r0) * (c1 - c0) + x - c0, rows, cols, c1 - c0)
        if rows > 1 and cols == width == c1 - c0:  # (contiguous on both sides: one run)
            held, into = held._replace(rows=1, cols=rows * cols), into._replace(rows=1, cols=rows * cols)
        if out and held.rows == into.rows == out[-1][0].rows == out[-1][1].rows == 1:
            before, block = out[-1]
            if before.offset + before.cols == held.offset and block.offset + block.cols == into.offset:
                out[-1] = before._replace(cols=before.cols + cols * rows), block._replace(cols=block.cols + cols * rows)
                continue
        out.append((held, into))
    return out


def owner_line(units: list[list[Matrix]], ranks: int) -> str:
    """The run log's line on how the matrices are split among their owners, balanced within each step unit (the
    matrices whose updates are exchanged together, :func:`step_units`): the max/mean FLOPs is the busiest rank's of
    each unit summed, over the mean of all."""
    counts, flops, slowest = [0] * ranks, [0] * ranks, 0
    for unit in units:
        loads = team_loads([newton_schulz_flops(m.shape) for m in unit], [m.team for m in unit], ranks)
        for m in unit:
            for r in m.team:
                counts[r] += 1
        flops = [a + b for a, b in zip(flops, loads)]
        slowest += max(loads, default=0)
    total = sum(flops) or 1
    shares = " ".join(f"{c}/{100 * f / total:.1f}%" for c, f in zip(counts, flops))
    matrices = [m for unit in units for m in unit]
    split = sorted(len(m.team) for m in matrices if len(m.team) > 1)
    teams = ""
    if split:
        sizes = f"{split[0]}" if split[0] == split[-1] else f"{split[0]} to {split[-1]}"
        teams = f", {len(split)} of them split by columns across teams of {sizes} ranks"
    apart = f", balanced within each of {len(units)} step units (stepped one after another)" if len(units) > 1 else ""
    return (
        f"Muon owners: each of {len(matrices)} matrices orthogonalised once, by one of {ranks} ranks{teams}{apart} "
        f"(max/mean Newton-Schulz FLOPs {slowest * ranks / total:.2f}); per rank, matrices/FLOPs: {shares}"
    )


def step_units(partitions: PartitionMap, names: list[str]) -> list[list[str]]:
    """The matrices ``names`` (in their order) by step unit, the flat buffers whose updates one exchange
    orthogonalises: at ZeRO-3 each buffer (DeepSpeed's stage-3 optimizer steps one sub-group per ``step`` call), else
    each parameter group's buffers (one ``step`` call, one exchange per group)."""
    unit_of: dict[str, int] = {}
    for f in partitions.of(set(names)):
        unit = f.buffer if partitions.zero_stage == 3 else partitions.groups[f.buffer]
        if unit_of.setdefault(f.name, unit) != unit:
            raise ConfigError(
                f"optim.name=muon: DeepSpeed steps parts of {f.name} in separate optimizer steps (flat buffers "
                "stepped apart), a layout the Muon owner split cannot serve; use optim.name=adamw, or another "
                "parallel.zero_stage"
            )
    units: dict[int, list[str]] = {}
    for name in names:
        if name in unit_of:
            units.setdefault(unit_of[name], []).append(name)
    return [units[unit] for unit in sorted(units)]


@dataclass(frozen=True)
class Exchange:
    """What this rank sends and receives to orthogonalise the matrices of a set of flat buffers: each rank's
    elements of each block (a matrix, or one team member's columns of it) to the block's rank (``gather``: (buffer,
    piece) sent; (block, piece) received), the block's result back to every rank that holds some of it
    (``scatter``: (block, piece) sent; (buffer, piece, matrix) received), in the order of the ranks, with the element
    counts per rank (``*_splits``). ``blocks``: this rank's, (matrix, member); ``teams``: every split matrix of
    these buffers, whose Newton-Schulz all ranks step through together."""

    blocks: tuple[tuple[Matrix, int], ...]
    gather_send: tuple[tuple[int, Piece], ...]
    gather_send_splits: tuple[int, ...]
    gather_recv: tuple[tuple[int, Piece], ...]
    gather_recv_splits: tuple[int, ...]
    scatter_send: tuple[tuple[int, Piece], ...]
    scatter_send_splits: tuple[int, ...]
    scatter_recv: tuple[tuple[int, Piece, Matrix], ...]
    scatter_recv_splits: tuple[int, ...]
    teams: tuple[Matrix, ...] = ()


def plan_exchange(matrices: dict[str, Matrix], fragments: list[Fragment], rank: int, world: int) -> Exchange:
    """The :class:`Exchange` of ``fragments`` (every rank's, of the buffers stepped together) for ``rank``. Ranks
    holding the same elements (ZeRO-0's replicas) send them once: the copy of the block's rank, else the lowest
    rank's."""
    order = {name: i for i, name in enumerate(matrices)}

    def shard(f: Fragment) -> int:
        return f.tp_rank if matrices[f.name].tp_dim is not None else 0

    unique: dict[tuple, Fragment] = {}
    for f in fragments:
        unique.setdefault((f.name, shard(f), f.start, f.numel), f)
    _check_cover(matrices, list(unique.values()), shard)
    present = {f.name for f in fragments}
    # links of a fragment to a block, with their pieces, by (the fragment's rank, the block's rank)
    scatter: dict[tuple[int, int], list] = {}
    sources: dict[tuple, tuple] = {}
    for f in sorted(fragments, key=lambda f: f.rank):
        m = matrices[f.name]
        for member, owner in enumerate(m.team):
            pieces = fragment_pieces(m, f, member)
            if not pieces:
                continue
            key = (order[f.name], member, shard(f), f.start)
            link = (key, f, member, pieces)
            scatter.setdefault((f.rank, owner), []).append(link)
            held = sources.get(key + (f.numel,))
            if held is None or (held[1].rank != owner and f.rank == owner):
                sources[key + (f.numel,)] = link
    gather: dict[tuple[int, int], list] = {}
    for link in sources.values():
        gather.setdefault((link[1].rank, matrices[link[1].name].team[link[2]]), []).append(link)
    blocks = [(m, j) for m in matrices.values() if m.name in present for j, r in enumerate(m.team) if r == rank]
    index = {(m.name, j): b for b, (m, j) in enumerate(blocks)}

    def links(table: dict, src: int, dst: int) -> list:
        out = []
        for _, f, member, pieces in sorted(table.get((src, dst), []), key=lambda link: link[0]):
            out += [(f, member, matrices[f.name], held, into) for held, into in pieces]
        return out

    gather_send, gather_recv, scatter_send, scatter_recv = [], [], [], []
    splits: list[list[int]] = [[], [], [], []]
    for other in range(world):
        out = links(gather, rank, other)
        gather_send += [(f.buffer, held) for f, _, _, held, _ in out]
        into = links(gather, other, rank)
        gather_recv += [(index[m.name, j], block) for _, j, m, _, block in into]
        back = links(scatter, other, rank)
        scatter_send += [(index[m.name, j], block) for _, j, m, _, block in back]
        mine = links(scatter, rank, other)
        scatter_recv += [(f.buffer, held, m) for f, _, m, held, _ in mine]
        for i, part in enumerate((out, into, back, mine)):
            splits[i].append(sum(piece.numel for _, _, _, piece, _ in part))
    return Exchange(
        tuple(blocks),
        tuple(gather_send),
        tuple(splits[0]),
        tuple(gather_recv),
        tuple(splits[1]),
        tuple(scatter_send),
        tuple(splits[2]),
        tuple(scatter_recv),
        tuple(splits[3]),
        tuple(m for m in matrices.values() if m.name in present and len(m.team) > 1),
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

    Bound to an engine (:meth:`bind`), each matrix is orthogonalised once, by its owner rank or split across a team
    of ranks: ``matrices`` (by name, teams assigned), ``partitions`` (DeepSpeed's map of which rank holds which
    elements in which flat buffer). Unbound, every matrix is orthogonalised where it is stepped. Counted: whole
    matrices orthogonalised (``ns_calls``), team members' parts (``ns_parts``) and the FLOPs of both
    (``ns_flops``, :func:`newton_schulz_flops` per iteration; a member's part its share of it).
    ``cpu_bf16_matmul``: how bf16 Newton-Schulz multiplies on a CPU (``train.cpu_bf16_matmul``)."""

    def __init__(self, groups: list[dict], fused: bool = False, cpu_bf16_matmul: str = "auto") -> None:
        super().__init__(groups, {})
        self.cpu_bf16_matmul = cpu_bf16_matmul
        self.partitions: PartitionMap | None = None
        self.matrices: dict[str, Matrix] = {}
        self.ns_calls = self.ns_parts = self.ns_flops = 0
        self._exchanges: dict[tuple[int, ...], Exchange] = {}
        self._tp_dims = {id(p): g["tp_dim"] for g in self.param_groups if g["use_muon"] for p in g["params"]}
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    _check_matrix(p, param_shape(p))  # (ZeRO-3 built partitioned: the shape it keeps aside)
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._adamw = torch.optim.AdamW(adam_groups, fused=fused) if adam_groups else None

    def bind(self, module: nn.Module, partitions: PartitionMap, tp: int) -> str:
        """Orthogonalise each matrix of ``module`` once, at its owner or its team (``flops.balance_teams`` over all
        ranks within each step unit, :func:`step_units`), from the fragments ``partitions`` maps; the run log's line
        on the owners. ``tp``: the tensor-parallel degree the matrices' ``tp_dim`` splits by."""
        named = [(name, p) for name, p in module.named_parameters() if id(p) in self._tp_dims]
        unmapped = [name for name, _ in named if name not in partitions.shapes]
        if unmapped:
            raise ConfigError(
                f"optim.name=muon: DeepSpeed steps {unmapped[0]} (and {len(unmapped) - 1} more matrices) inside a "
                "buffer its partition map does not know, a layout the Muon owner split cannot serve; use "
                "optim.name=adamw, or another precision / parallel.zero_stage"
            )
        shards = [(name, partitions.shapes[name], self._tp_dims[id(p)]) for name, p in named]
        unsplit = [Matrix(name, shape, dim, tp if dim is not None else 1, (0,)) for name, shape, dim in shards]
        by_name = {m.name: m for m in unsplit}
        units = []
        for names in step_units(partitions, list(by_name)):
            unit = [by_name[name] for name in names]
            costs = [newton_schulz_flops(m.shape) for m in unit]
            teams = balance_teams(costs, partitions.world_size, [min(m.shape) for m in unit])
            units.append([replace(m, team=team) for m, team in zip(unit, teams)])
        self.matrices = {m.name: m for unit in units for m in unit}
        self.partitions, self._exchanges = partitions, {}
        for unit in units:  # (the cover check)
            plan_exchange(self.matrices, partitions.of({m.name for m in unit}), 0, partitions.world_size)
        return owner_line(units, partitions.world_size)

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
            if group["use_muon"] and group["params"]:
                with self._matmuls(group)():
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

    def _matmuls(self, group: dict) -> Callable[[], AbstractContextManager]:
        dtype = torch.bfloat16 if group["ns_dtype"] == "bf16" else torch.float32
        return matmul_context(gemms_as_fp32(self.cpu_bf16_matmul, group["params"][0].device, dtype))

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
        """Send each rank's elements of the matrices in the flat buffers ``updates`` (buffer number: the tensor
        stepped, its update) to the ranks of their blocks, orthogonalise there, send each rank its elements of the
        results back and step them."""
        key = tuple(sorted(updates))
        exchange = self._exchanges.get(key)
        if exchange is None:
            fragments = [f for f in self.partitions.of(set(self.matrices)) if f.buffer in updates]
            exchange = plan_exchange(self.matrices, fragments, _rank(), self.partitions.world_size)
            self._exchanges[key] = exchange
        first = next(iter(updates.values()))[1]
        dtype, device = first.dtype, first.device
        flat = {b: update.view(-1) for b, (_, update) in updates.items()}
        sent = first.new_empty(sum(exchange.gather_send_splits))
        _pack(sent, [(piece, flat[b]) for b, piece in exchange.gather_send])
        del flat
        received = _all_to_all(sent, exchange.gather_recv_splits, exchange.gather_send_splits)
        del sent
        blocks: list[torch.Tensor | None] = []
        for m, j in exchange.blocks:
            r0, r1, c0, c1 = m.block(j)
            blocks.append(torch.empty(r1 - r0, c1 - c0, dtype=dtype, device=device))
        _unpack(received, [(piece, blocks[i].view(-1)) for i, piece in exchange.gather_recv])
        del received
        if exchange.teams:
            self._orthogonalize_in_teams(exchange, blocks, group, first)
        else:
            for i in range(len(blocks)):
                orthogonal = self.orthogonalize(blocks[i], group["ns_steps"], group["ns_dtype"])
                blocks[i] = orthogonal.to(dtype).contiguous()  # (a tall matrix's comes back transposed)
                del orthogonal
        sent = first.new_empty(sum(exchange.scatter_send_splits))
        _pack(sent, [(piece, blocks[i].view(-1)) for i, piece in exchange.scatter_send])
        del blocks
        received = _all_to_all(sent, exchange.scatter_recv_splits, exchange.scatter_send_splits)
        del sent
        at = 0
        for b, piece, m in exchange.scatter_recv:
            rate = _adjust_lr(group["lr"], group["adjust_lr_fn"], m.shape)
            result = received.narrow(0, at, piece.numel).view(piece.rows, piece.cols)
            piece.of(updates[b][0].view(-1)).add_(result, alpha=-rate)
            at += piece.numel

    def _orthogonalize_in_teams(self, exchange: Exchange, blocks: list, group: dict, like: torch.Tensor) -> None:
        """Newton-Schulz on this rank's blocks of split matrices (:func:`newton_schulz_member`), in step with every
        other rank: each exchange one ``all_to_all_single`` over the world, in fp32, for all teams at once (a rank
        in no team sends and receives nothing, as often). The rank's whole matrices are iterated between them, one
        iteration before each iteration's first exchange (:func:`newton_schulz_steps`), so that each rank's work
        between two exchanges follows its share of the FLOPs. Each block replaced by its result, in ``like``'s
        dtype."""
        steps, world = group["ns_steps"], self.partitions.world_size
        running = []  # (block, matrix, the member's iteration)
        wholes = []  # (block, the whole matrix's iteration)
        for i, (m, j) in enumerate(exchange.blocks):
            if len(m.team) == 1:
                self.ns_calls += 1
                self.ns_flops += steps * newton_schulz_flops(blocks[i].shape)
                wholes.append((i, newton_schulz_steps(blocks[i], steps, group["ns_dtype"])))
                blocks[i] = None
            else:
                x = blocks[i].T if m.transposed else blocks[i]
                side, rows = x.size(0), _cuts(x.size(0), len(m.team))
                self.ns_parts += 1
                self.ns_flops += steps * (4 * side * side * x.size(1) + 2 * rows[j] * side * side)
                running.append((i, m, newton_schulz_member(x, rows, j, steps, group["ns_dtype"])))
                blocks[i] = x = None  # (the iteration holds it)
        messages = [next(g) for _, _, g in running]

        def iterate() -> None:  # (one iteration of each whole matrix; its result once done)
            for i, g in list(wholes):
                try:
                    next(g)
                except StopIteration as done:
                    blocks[i] = done.value.to(like.dtype).contiguous()
                    wholes.remove((i, g))

        iterate()  # (their norms)
        for phase in range(1 + 3 * steps):
            if phase % 3 == 1:
                iterate()
            out: list[list[torch.Tensor]] = [[] for _ in range(world)]  # to each rank
            sizes: list[list[int]] = [[] for _ in range(world)]  # from each rank
            for (_, m, _), (sends, expects) in zip(running, messages):
                for r, piece, n in zip(m.team, sends, expects):
                    out[r].append(piece)
                    sizes[r].append(n)
            del messages
            sent = torch.empty(sum(t.numel() for ts in out for t in ts), dtype=torch.float32, device=like.device)
            at = 0
            for t in (t for ts in out for t in ts):
                sent.narrow(0, at, t.numel()).copy_(t.reshape(-1))
                at += t.numel()
            send_splits = tuple(sum(t.numel() for t in ts) for ts in out)
            del out
            received = _all_to_all(sent, tuple(map(sum, sizes)), send_splits)
            del sent
            starts = [sum(map(sum, sizes[:r])) for r in range(world)]
            taken = [0] * world
            messages = []
            for i, m, g in running:
                got = []
                for r in m.team:
                    n = sizes[r][taken[r]]
                    got.append(received.narrow(0, starts[r], n))
                    starts[r], taken[r] = starts[r] + n, taken[r] + 1
                try:
                    messages.append(g.send(got))
                except StopIteration as done:
                    assert phase == 3 * steps
                    blocks[i] = (done.value.T if m.transposed else done.value).to(like.dtype).contiguous()
                del got
            del received
        while wholes:
            iterate()

    def orthogonalize(self, update: torch.Tensor, steps: int, dtype: str) -> torch.Tensor:
        self.ns_calls += 1
        self.ns_flops += steps * newton_schulz_flops(update.shape)
        if dtype == "bf16":
            return _zeropower_via_newtonschulz(update, NS_COEFFICIENTS, steps, NS_EPS)
        return newton_schulz_fp32(update, steps)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _pack(sent: torch.Tensor, pieces: list[tuple[Piece, torch.Tensor]]) -> None:
    """Each piece of its flat tensor into ``sent``, one after another."""
    at = 0
    for piece, flat in pieces:
        sent.narrow(0, at, piece.numel).view(piece.rows, piece.cols).copy_(piece.of(flat))
        at += piece.numel


def _unpack(received: torch.Tensor, pieces: list[tuple[Piece, torch.Tensor]]) -> None:
    """``received``, one piece after another, into each piece of its flat tensor."""
    at = 0
    for piece, flat in pieces:
        piece.of(flat).copy_(received.narrow(0, at, piece.numel).view(piece.rows, piece.cols))
        at += piece.numel


def _cuts(n: int, k: int) -> list[int]:
    """``n`` in ``k`` near-equal parts."""
    return [n * (j + 1) // k - n * j // k for j in range(k)]


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


def newton_schulz_steps(update: torch.Tensor, steps: int, dtype: str) -> Generator[None, None, torch.Tensor]:
    """:meth:`MuonWithAdamW.orthogonalize`'s iteration (torch's in bf16, :func:`newton_schulz_fp32`), the same
    operations, paused after the norm and after each iteration but the last: ``steps`` + 1 ``next`` calls, the last
    returning the result."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16() if dtype == "bf16" else update.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        yield
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        del gram
    return x.T if tall else x


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


def newton_schulz_member(
    x: torch.Tensor, rows: list[int], member: int, steps: int, dtype: str
) -> Generator[tuple[list[torch.Tensor], list[int]], list[torch.Tensor], torch.Tensor]:
    """Member ``member``'s part of :meth:`MuonWithAdamW.orthogonalize`'s iteration (``dtype``: bf16, torch's, or
    fp32) on an m x n matrix X (m <= n) whose columns a team splits: ``x``, its block X_i of them (m x n_i);
    ``rows``, how the team splits m. X is divided by the norm from every member's sum of squares; then, per
    iteration, member j sums its ``rows[j]`` rows of every member's X_i X_iᵀ (in member order) into those rows of
    A = X Xᵀ, computes the same rows of B = bA + cA² from all of A, and every member takes X_i <- aX_i + B X_i.
    Each row of A and B is computed at one member and sent to all: every member uses the same A and B, bit for bit.
    Yields, at each of its 1 + 3 x ``steps`` exchanges, what it sends each member and how many elements it gets
    from each; is sent what each member sent it (1-D, fp32, in member order); returns its block of the result."""
    a, b, c = NS_COEFFICIENTS
    k, side, first = len(rows), x.size(0), sum(rows[:member])
    x = x.bfloat16() if dtype == "bf16" else x.float()
    got = yield [x.float().square().sum().view(1)] * k, [1] * k
    x = x / torch.cat(got).sum().sqrt().to(x.dtype).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        got = yield list(gram.split(rows)), [rows[member] * side] * k
        del gram
        total = got[0].clone()
        for part in got[1:]:
            total += part
        got = yield [total.to(x.dtype)] * k, [r * side for r in rows]
        del total
        gram = torch.cat([part.view(r, side) for part, r in zip(got, rows)]).to(x.dtype)
        mine = gram.narrow(0, first, rows[member])
        got = yield [torch.addmm(mine, mine, gram, beta=b, alpha=c)] * k, [r * side for r in rows]
        del gram, mine
        update = torch.cat([part.view(r, side) for part, r in zip(got, rows)]).to(x.dtype)
        del got
        x = torch.addmm(x, update, x, beta=a)
        del update
    return x
