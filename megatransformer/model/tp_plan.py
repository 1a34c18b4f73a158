"""Tensor-parallel plan: which weights are split by output (column) or by input (row), as data.

Column-parallel q/k/v and gate/up projections produce a slice of the heads / FFN width on each rank;
the row-parallel o_proj and down_proj consume that slice and all-reduce their output. Attention sizes its
heads from the projection width, so the model code runs unchanged on a shard. Embeddings, norms and the
(tied) output head stay replicated. The same names serve self- and cross-attention. Multi-head latent
attention splits its heads after the up-projections (``q_b_proj``, ``kv_b_proj``); its latent projections
(``q_a_proj``, ``kv_a_proj``) and their norms stay whole on every rank. QK-norm's weights are replicated too,
but each rank applies them to its own heads only, so each rank's gradient is a part of the whole:
``PARTIAL_GRADIENTS`` names them, and training sums them over the tensor-parallel group. Rank r of ``size`` holds
heads [r * H / size, (r + 1) * H / size); per-head constants (ALiBi slopes) follow ``head_offset``.
"""

from __future__ import annotations

import re

from torch import nn

TP_PLAN: dict[str, str] = {
    r".*\.[qkv]_proj\.weight$": "column",
    r".*\.(q_b|kv_b)_proj\.weight$": "column",  # multi-head latent attention's up-projections
    r".*\.(gate|up)_proj\.weight$": "column",
    r".*\.o_proj\.weight$": "row",
    r".*\.down_proj\.weight$": "row",
}

# replicated weights applied to a rank's slice of the heads (transformers' "replicated_with_grad_allreduce")
PARTIAL_GRADIENTS = (r".*\.[qk]_norm\.weight$",)


def has_partial_gradient(name: str) -> bool:
    """Whether the replicated parameter ``name`` gets only its rank's part of its gradient under tensor
    parallelism (to be summed over the tensor-parallel group)."""
    return any(re.match(pattern, name) for pattern in PARTIAL_GRADIENTS)


def partition_dim(name: str, plan: dict[str, str] = TP_PLAN) -> int | None:
    """The dimension a parameter is split along under tensor parallelism, or None if it is replicated:
    column-parallel weights and biases by output (0), row-parallel weights by input (1); row biases whole."""
    weight = re.sub(r"\.bias$", ".weight", name)
    for pattern, kind in plan.items():
        if re.match(pattern, weight):
            if name.endswith(".bias"):
                return 0 if kind == "column" else None
            return 0 if kind == "column" else 1
    return None


def assign_head_offsets(model: nn.Module, rank: int, size: int) -> None:
    """Tell every attention module (those with a ``head_offset``) which of all heads its shard of the
    column-parallel ``q_proj`` holds, so that it picks those heads' ALiBi slopes."""
    for module in model.modules():
        if hasattr(module, "head_offset"):
            module.head_offset = rank * module.total_heads // size
