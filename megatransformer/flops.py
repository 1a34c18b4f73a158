"""Parameter counts and training FLOPs per token, from the model the config describes.

FLOPs follow the usual convention (Kaplan et al.; PaLM appendix B): a matmul with a weight of N elements
costs 2N FLOPs per token forward and 4N backward, so 6N in training; attention scores and the weighted sum
add 2 * 2 * seq_len * d per layer and token forward (x3 for training), counted for the full L x L square.
For an encoder-decoder model "a token" is one position of either stack (source and target lengths equal).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
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

    def as_dict(self) -> dict:
        return asdict(self)


def model_size(cfg: ModelConfig, seq_len: int | None = None) -> ModelSize:
    from megatransformer.model import build_model

    seq_len = seq_len or cfg.max_seq_len
    with torch.device("meta"):
        model = build_model(cfg)
    params = {id(p): p.numel() for p in model.parameters()}
    embeddings = {id(m.weight): m.weight.numel() for m in model.modules()
                  if isinstance(m, nn.Embedding) or type(m).__name__ == "LearnedPositions"}
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    if cfg.arch == "encoder_decoder":
        attention_layers = cfg.n_layers + 2 * cfg.decoder_layers  # encoder self, decoder self + cross
        stacks = 2
    else:
        attention_layers, stacks = cfg.n_layers, 1
    # per position: each stack's matmuls see its own positions; attention: 4 * L * d per layer forward
    matmul = 6 * linear / stacks
    attention = 3 * 4 * seq_len * cfg.d_model * attention_layers / stacks
    return ModelSize(
        params=sum(params.values()),
        non_embedding_params=sum(params.values()) - sum(embeddings.values()),
        flops_per_token=matmul + attention,
        seq_len=seq_len,
    )
