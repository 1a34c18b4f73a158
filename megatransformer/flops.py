"""Parameter counts and training FLOPs per token, from the model the config describes.

FLOPs follow the usual convention (Kaplan et al.; PaLM appendix B): a matmul with a weight of N elements
costs 2N FLOPs per token forward and 4N backward, so 6N in training; attention scores and the weighted sum
add 2 * seq_len * (query/key + value width of all heads: 2 * d for standard attention, heads x (qk_nope + qk_rope
+ v) for multi-head latent attention) per layer and token forward (x3 for training), counted for the full
L x L square;
a sliding window narrows self-attention's square to a band of min(L, window) keys per query (causal) or
min(L, 2 * window - 1) (bidirectional).
For an encoder-decoder model "a token" is one position of either stack (source and target lengths equal).

Packed rows attend within each document only: :func:`documents_flops` counts each document's own square (as
Megatron-LM and torchtitan count document masks), the numerator of the trainer's MFU and ``bench/mfu.py``'s.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np
from torch import nn

from megatransformer.config import ModelConfig


@dataclass(frozen=True)
class ModelSize:
    params: int
    """All trainable parameters (tied tensors counted once)."""
    non_embedding_params: int
    """Without token and learned position embedding tables."""
    flops_per_token: float
    """Training (forward + backward) FLOPs per token at the given sequence length."""
    seq_len: int
    matmul_flops_per_token: float = 0.0
    """The weight matmuls' part of ``flops_per_token`` (6N per token for N weight elements)."""
    attention_flops_per_key: float | None = None
    """Self-attention's training FLOPs for one query and one key it attends to, all layers (None for an
    encoder-decoder model, whose cross-attention this does not describe)."""
    window: int | None = None
    causal: bool = True

    def keys(self, length: int) -> int:
        """The keys a query of a document of ``length`` positions is counted to attend to (its square's width)."""
        window = self.window or length
        return min(length, window) if self.causal else min(length, 2 * window - 1)

    def as_dict(self) -> dict:
        return asdict(self)


_ONE_BLOCK: dict[str, tuple[nn.Module, Callable[[str], int]]] = {}


def one_block_per_stack(cfg: ModelConfig) -> tuple[nn.Module, Callable[[str], int]]:
    """The model of ``cfg`` with one block per stack, on the meta device, and the copies of each of its
    parameters or modules (by name) the whole model holds: a block's, one per layer of its stack (the blocks
    of a stack are alike), so that sizes are counted without building thousands of blocks. Built once per
    configuration (the planner asks for it thousands of times a plan); callers only read it."""
    key = cfg.model_dump_json()
    if key not in _ONE_BLOCK:
        from megatransformer.model.transformer import build_shapes

        one = cfg.model_copy(update={"n_layers": 1, "n_decoder_layers": 1 if cfg.n_decoder_layers else None})
        decoder = cfg.decoder_layers if cfg.arch == "encoder_decoder" else cfg.n_layers
        layers = {"encoder": cfg.n_layers, "decoder": decoder}
        _ONE_BLOCK[key] = build_shapes(one), lambda name: layers[name.split(".")[0]] if ".layers.0." in name else 1
    return _ONE_BLOCK[key]


def model_size(cfg: ModelConfig, seq_len: int | None = None) -> ModelSize:
    seq_len = seq_len or cfg.max_seq_len
    model, copies = one_block_per_stack(cfg)
    params = {id(p): p.numel() * copies(name) for name, p in model.named_parameters()}
    embeddings = {
        id(m.weight): m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Embedding) or type(m).__name__ == "LearnedPositions"
    }
    linear = sum(m.weight.numel() * copies(name) for name, m in model.named_modules() if isinstance(m, nn.Linear))
    window = cfg.attention_window or seq_len
    causal_keys, bidirectional_keys = min(seq_len, window), min(seq_len, 2 * window - 1)
    self_width = score_width(cfg)
    if cfg.arch == "encoder_decoder":  # encoder self, decoder self + cross
        scores = (cfg.n_layers * bidirectional_keys + cfg.decoder_layers * causal_keys) * self_width
        scores += cfg.decoder_layers * seq_len * 2 * cfg.d_model
        stacks = 2
    else:
        scores = cfg.n_layers * (causal_keys if cfg.arch == "decoder" else bidirectional_keys) * self_width
        stacks = 1
    # per position: each stack's matmuls see its own positions; attention: 2 * keys * width per layer forward
    matmul = 6 * linear / stacks
    attention = 3 * 2 * scores / stacks
    return ModelSize(
        params=sum(params.values()),
        non_embedding_params=sum(params.values()) - sum(embeddings.values()),
        flops_per_token=matmul + attention,
        seq_len=seq_len,
        matmul_flops_per_token=matmul,
        attention_flops_per_key=None if stacks == 2 else 3 * 2 * cfg.n_layers * self_width,
        window=cfg.attention_window,
        causal=cfg.arch == "decoder",
    )


def documents_flops(size: ModelSize, lengths: Iterable[int]) -> float:
    """Training FLOPs of documents of these lengths, each attending within itself: the matmuls per token plus
    attention over each document's own square (``size.keys(length)`` keys per query). One document per row of
    ``size.seq_len`` gives ``flops_per_token`` per position; an encoder-decoder model counts ``flops_per_token``
    per position whatever its documents."""
    lengths = [int(n) for n in lengths]
    if size.attention_flops_per_key is None:
        return size.flops_per_token * sum(lengths)
    keys = sum(n * size.keys(n) for n in lengths)
    return size.matmul_flops_per_token * sum(lengths) + size.attention_flops_per_key * keys


def document_lengths(segments: np.ndarray | None, shape: tuple[int, int], pad: int = 0) -> list[int]:
    """The documents of a batch of rows: runs of equal segment ids in each row, padding (``pad``) left out;
    every row one document of its full length without segment ids."""
    rows, length = shape
    if segments is None:
        return [length] * rows
    lengths = []
    for row in np.asarray(segments).reshape(rows, length):
        starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        runs = np.diff(np.r_[starts, length])
        lengths += [int(n) for n, segment in zip(runs, row[starts], strict=True) if segment != pad]
    return lengths


def score_width(cfg: ModelConfig) -> int:
    """The query/key plus value width of all heads of self-attention, which scores and the weighted sum run over."""
    if cfg.attention == "mla":
        return cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return 2 * cfg.n_heads * cfg.head_dim


@dataclass(frozen=True)
class AttentionCost:
    """One kind of attention of a model, over all its layers."""

    kind: str
    """"self (standard)", "self (mla)" or "cross (standard)"."""
    layers: int
    params: int
    flops_per_token: float
    """Training FLOPs per position of the stack it runs in (projections and the L x L square)."""
    kv_cache_values_per_token: int | None
    """Values a KV cache holds per generated token, all layers (None: no cache, as for an encoder); cross-
    attention's are per source token, computed once."""

    def as_dict(self) -> dict:
        return asdict(self)


def attention_costs(cfg: ModelConfig, seq_len: int | None = None) -> list[AttentionCost]:
    """Parameters, training FLOPs per token and KV-cache size of each kind of attention ``cfg`` builds."""
    from megatransformer.model.transformer import kv_cache_dims

    seq_len = seq_len or cfg.max_seq_len
    model, copies = one_block_per_stack(cfg)
    window = cfg.attention_window or seq_len
    generates = cfg.arch != "encoder"
    heads, key_dim, value_dim = kv_cache_dims(cfg)
    stacks = [("encoder", model.encoder)] if hasattr(model, "encoder") else []
    stacks += [("decoder", model.decoder)] if hasattr(model, "decoder") else []
    costs = []
    for attribute, kind in (("self_attn", f"self ({cfg.attention})"), ("cross_attn", "cross (standard)")):
        modules = [  # (stack, the module of its one block, layers of the stack)
            (name, getattr(stack.layers[0], attribute), copies(f"{name}.layers.0."))
            for name, stack in stacks
            if hasattr(stack.layers[0], attribute)
        ]
        if not modules:
            continue
        count = sum(n for _, _, n in modules)
        params = sum(n * p.numel() for _, module, n in modules for p in module.parameters())
        linear = sum(
            n * m.weight.numel() for _, module, n in modules for m in module.modules() if isinstance(m, nn.Linear)
        )
        if attribute == "cross_attn":
            keys, width, cached = seq_len, 2 * cfg.d_model, 2 * cfg.d_model * count
        else:
            causal = [(name == "decoder", n) for name, _, n in modules]
            keys = sum(n * (min(seq_len, window) if c else min(seq_len, 2 * window - 1)) for c, n in causal) / count
            width = score_width(cfg)
            cached = heads * (key_dim + value_dim) * sum(n for c, n in causal if c) if generates else None
        stack_count = len({name for name, _, _ in modules})
        flops = (6 * linear + 3 * 2 * keys * width * count) / stack_count
        costs.append(AttentionCost(kind, count, params, flops, cached))
    return costs


def newton_schulz_flops(shape: tuple[int, int]) -> int:
    """FLOPs of one Newton-Schulz iteration on an m x n matrix (m <= n): X Xᵀ, then B = bA + cA², then BX."""
    m, n = sorted(shape)
    return 4 * m * m * n + 2 * m**3


def assign_owners(costs: list[int], ranks: int) -> list[int]:
    """The rank that orthogonalises each matrix whole: the costliest first, each to the least loaded rank (the
    lowest rank among equals), so the same on every rank."""
    return [team[0] for team in assign_teams(costs, ranks, [1] * len(costs))]


BALANCE = 1.1
"""The busiest rank's Newton-Schulz FLOPs over the mean that :func:`balance_teams` stops splitting at."""


def assign_teams(costs: list[int], ranks: int, sizes: list[int]) -> list[tuple[int, ...]]:
    """The ranks that orthogonalise each matrix, ``sizes[i]`` distinct ranks for matrix i, each doing
    ``costs[i] / sizes[i]`` (rounded up): the largest share first, each to the least loaded ranks (the lowest among
    equals), as sorted tuples; the same on every rank."""
    loads = [(0, r) for r in range(ranks)]  # (a heap of (load, rank))
    teams: list[tuple[int, ...]] = [()] * len(costs)
    shares = [-(-c // k) for c, k in zip(costs, sizes)]
    for i in sorted(range(len(costs)), key=lambda i: (-shares[i], i)):
        least = [heapq.heappop(loads) for _ in range(sizes[i])]
        teams[i] = tuple(sorted(r for _, r in least))
        for load, r in least:
            heapq.heappush(loads, (load + shares[i], r))
    return teams


def team_loads(costs: list[int], teams: list[tuple[int, ...]], ranks: int) -> list[int]:
    """Each rank's FLOPs under ``teams`` (a matrix's cost shared equally by its team, rounded up)."""
    loads = [0] * ranks
    for cost, team in zip(costs, teams):
        for r in team:
            loads[r] += -(-cost // len(team))
    return loads


def balance_teams(costs: list[int], ranks: int, limits: list[int] | None = None) -> list[tuple[int, ...]]:
    """Teams (:func:`assign_teams`) that bring the busiest rank within :data:`BALANCE` of the mean FLOPs with few
    ranks added to teams (each matrix's team at most ``limits[i]`` and ``ranks``): whole matrices if they do. Else
    the better (:func:`_better`) of two searches: growing, one rank at a time, the team of the busiest rank's
    costliest share while that lowers its load (or the number of ranks that carry it); and capping every share at s
    FLOPs (matrix i split into ceil(cost_i / s) ranks), s the largest of the costs divided by 2, 3, ... that
    reaches the target, found by bisection. Then, if the target holds, each team, the largest first, one rank
    smaller while it still does. Growing and shrinking try at most two assignments per matrix each (70B's 560
    matrices: 0.9 s at 256 ranks, 4 s at 512, 14 s at 1,024 in CPython). A function of the costs alone."""
    limits = [min(ranks, limit) for limit in (limits or [ranks] * len(costs))]
    target = BALANCE * sum(costs) / ranks
    tries = 2 * len(costs)  # (assignments the growing and the shrinking may try, each)

    def busiest(sizes: list[int]) -> tuple[int, list[int]]:
        teams = assign_teams(costs, ranks, sizes)
        loads = team_loads(costs, teams, ranks)
        return max(loads, default=0), loads

    whole = [1] * len(costs)
    if busiest(whole)[0] <= target:
        return assign_teams(costs, ranks, whole)
    grown = _grow(costs, ranks, limits, target, tries, busiest)
    shares = sorted({-(-c // k) for c, limit in zip(costs, limits) for k in range(2, limit + 1)}, reverse=True)

    def capped(share: int) -> list[int]:
        return [min(limit, -(-c // share)) for c, limit in zip(costs, limits)]

    low, high = 0, len(shares) - 1  # (the first share that reaches the target, or the last)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if busiest(capped(shares[middle]))[0] <= target else (middle + 1, high)
    found = [whole, grown] + ([capped(shares[low])] if shares else [])
    sizes = min(found, key=lambda sizes: _better(sizes, busiest(sizes)[0], target))
    if busiest(sizes)[0] <= target:
        budget = tries
        for i in sorted(range(len(costs)), key=lambda i: (-sizes[i], -costs[i], i)):
            while sizes[i] > 1 and budget > 0:
                trial, budget = sizes[:i] + [sizes[i] - 1] + sizes[i + 1 :], budget - 1
                if busiest(trial)[0] > target:
                    break
                sizes = trial
    return assign_teams(costs, ranks, sizes)


def _better(sizes: list[int], load: int, target: float) -> tuple:
    """The order of candidate team sizes: those that reach the target first, by the ranks they add to teams; then
    the others, by their busiest rank's load."""
    added = sum(size - 1 for size in sizes)
    return (0, added, load) if load <= target else (1, load, added)


def _grow(costs, ranks, limits, target, budget, busiest) -> list[int]:
    """Team sizes grown from whole matrices, one rank at a time: the busiest rank's costliest share that can grow and
    lowers its load, or the number of ranks at it; until the target holds, none does, or ``budget`` tries are spent."""
    sizes = [1] * len(costs)
    load, loads = busiest(sizes)
    best = load, loads.count(load)
    while best[0] > target and budget > 0:
        rank = loads.index(best[0])
        teams = assign_teams(costs, ranks, sizes)
        held = [i for i, team in enumerate(teams) if rank in team and sizes[i] < limits[i]]
        for i in sorted(held, key=lambda i: (-(-costs[i] // sizes[i]), i)):
            trial, budget = sizes[:i] + [sizes[i] + 1] + sizes[i + 1 :], budget - 1
            load, trial_loads = busiest(trial)
            if (load, trial_loads.count(load)) < best:
                sizes, loads, best = trial, trial_loads, (load, trial_loads.count(load))
                break
            if budget <= 0:
                break
        else:
            break
    return sizes
