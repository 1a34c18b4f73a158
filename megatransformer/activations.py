"""Activation memory of one micro batch on one rank, estimated from the config (``megatransformer info``).

Counts the tensors each block keeps for its backward pass, per position the rank holds (1/sequence_parallel
of each sequence): docs/sequence_parallel.md derives the counts. Attention cores that keep no L x L scores
(chunked, flash-attn) are assumed; with ``activation_checkpointing`` each block keeps its input only, plus one
block's tensors while it is recomputed; with ``mlp_tiles`` no block keeps its MLP's hidden activations, and
one tile of them lives while it is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatransformer.config import ModelConfig, RunConfig

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ActivationEstimate:
    positions: int  # positions of one micro batch this rank holds (both stacks of an encoder-decoder)
    bytes: int  # activations kept for the backward pass


def mlp_hidden_values(cfg: ModelConfig) -> int:
    """The MLP's hidden activations per position: gate, up and their product (swiglu), or up and its
    activation."""
    return 3 * cfg.d_ff if cfg.ffn == "swiglu" else 2 * cfg.d_ff


def block_values(cfg: ModelConfig, cross_attention: bool = False, exchanged: bool = False) -> int:
    """Values one block keeps per position: the attention sub-layer's norm input and output, q, k, v, the
    core's output (with QK-norm q and k before their norms too) and, ``exchanged`` (Ulysses), the
    whole-sequence q, k, v and output of this rank's heads, the same count again; the MLP's norm input and
    output and, untiled, its hidden activations."""
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    attention = 2 * d + (2 * d + 2 * kv) * (2 if exchanged else 1)  # norm in/out; q, out, k, v
    if cfg.qk_norm:  # the queries and keys before their norms
        attention += d + kv
    hidden = mlp_hidden_values(cfg) if cfg.mlp_tiles == 1 else 0
    return attention * (2 if cross_attention else 1) + 2 * d + hidden


def activation_estimate(cfg: RunConfig, micro_batch: int) -> ActivationEstimate:
    """Bytes of activations one rank keeps for a micro batch of ``micro_batch`` rows of ``data.seq_len``."""
    m, sp = cfg.model, cfg.parallel.sequence_parallel
    local = micro_batch * cfg.data.seq_len // sp
    stacks = [(m.n_layers, False)] + ([(m.decoder_layers, True)] if m.arch == "encoder_decoder" else [])
    per_layer = [block_values(m, cross, exchanged=sp > 1) for _, cross in stacks]
    if m.activation_checkpointing:  # each block's input, and one block at a time recomputed
        values = sum(layers for layers, _ in stacks) * m.d_model + max(per_layer)
    else:
        values = sum(layers * v for (layers, _), v in zip(stacks, per_layer))
    values += 2 * m.d_model * len(stacks)  # embeddings and final norm; the fused loss keeps the hidden gradient
    kept = local * values
    if m.mlp_tiles > 1:  # one tile's hidden activations, recomputed in the backward pass
        kept += local * mlp_hidden_values(m) // m.mlp_tiles
    return ActivationEstimate(local * len(stacks), kept * BYTES[cfg.precision])
