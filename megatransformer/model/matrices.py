"""The model's hidden matrices: what matrix optimizers (Muon) update, read from the model's structure, never
from tensor shapes (which ZeRO flattens)."""

from __future__ import annotations

from torch import nn

from megatransformer.model.head import LMHead


def hidden_matrix_names(model: nn.Module) -> set[str]:
    """Names of the weights of the model's ``nn.Linear`` modules (attention and feed-forward projections), except
    the output head's and any shared with an embedding."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, LMHead))}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return {
        name for name, p in model.named_parameters() if p.requires_grad and id(p) in linear and id(p) not in embeddings
    }
