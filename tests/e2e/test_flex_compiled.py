"""The compiled FlexAttention kernel ``flex_core`` runs (the unit tests run FlexAttention's eager reference,
compiling nothing) equals the eager core for each kind of mask it is given: causal, packed documents with a
prefix per document, ALiBi's ``score_mod``, a sliding window, and new queries after a KV cache. Forward only:
FlexAttention has no backward pass on CPU."""

from __future__ import annotations

import pytest
import torch
from support.attention import SELF_MASKS, B, H, T, document_positions, qkv, real_queries

from megatransformer.model.attention import BACKENDS, eager_core
from megatransformer.model.masks import self_attention_mask
from megatransformer.model.positions import Alibi, alibi_slopes

CASES = {  # name: (mask, query length, key length, ALiBi)
    "causal": lambda: (SELF_MASKS["causal"](), T, T, False),
    "packed_prefix_per_document_alibi": lambda: (SELF_MASKS["packed_prefix_per_document"](), T, T, True),
    "packed_bidirectional_window": lambda: (SELF_MASKS["packed_bidirectional"]().with_window(5), T, T, False),
    "cached_prefill_window_alibi": lambda: (self_attention_mask(True, q_offset=9).with_window(5), 6, 15, True),
}


@pytest.mark.parametrize("name", CASES)
def test_compiled_flex_equals_eager(name):
    mask, q_len, k_len, with_alibi = CASES[name]()
    alibi = None
    if with_alibi:
        keys = torch.arange(k_len).expand(B, -1) if mask.q_segments is None else document_positions(mask.q_segments)
        alibi = Alibi(alibi_slopes(H), keys[:, k_len - q_len :], keys)
    q, k, v = (t.detach() for t in qkv(q_len, k_len))
    with torch.no_grad():
        got, want = BACKENDS["flex"](q, k, v, mask, 0.0, alibi), eager_core(q, k, v, mask, 0.0, alibi)
    keep = real_queries(mask, q_len)
    assert torch.allclose(got * keep, want * keep, atol=1e-5), (got - want).abs().max()
