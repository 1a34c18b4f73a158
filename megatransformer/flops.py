"""Parameter counts and training FLOPs per token, from the model the config describes.

FLOPs follow the usual convention (Kaplan et al.; PaLM appendix B): a matmul with a weight of N elements
costs 2N FLOPs per token forward and 4N backward, so 6N in training; attention scores and the weighted sum
add 2 * 2 * seq_len * d per layer and token forward (x3 for training), counted for the full L x L square;
a sliding window narrows self-attention's square to a band of min(L, window) keys per query (causal) or
min(L, 2 * window - 1) (bidirectional).
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
    embeddings = {
        id(m.weight): m.weight.numel()
        for m in model.modules()
        if isinstance(m, nn.Embedding) or type(m).__name__ == "LearnedPositions"
    }
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    window = cfg.attention_window or seq_len
    causal_keys, bidirectional_keys = min(seq_len, window), min(seq_len, 2 * window - 1)
    if cfg.arch == "encoder_decoder":  # encoder self, decoder self + cross
        keys = cfg.n_layers * bidirectional_keys + cfg.decoder_layers * (causal_keys + seq_len)
        stacks = 2
    else:
        keys = cfg.n_layers * (causal_keys if cfg.arch == "decoder" else bidirectional_keys)
        stacks = 1
    # per position: each stack's matmuls see its own positions; attention: 4 * keys * d per layer forward
    matmul = 6 * linear / stacks
    attention = 3 * 4 * keys * cfg.d_model / stacks
    return ModelSize(
        params=sum(params.values()),
        non_embedding_params=sum(params.values()) - sum(embeddings.values()),
        flops_per_token=matmul + attention,
        seq_len=seq_len,
    )
