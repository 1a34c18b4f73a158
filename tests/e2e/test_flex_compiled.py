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


def test_flex_compiles_under_a_compiled_runs_evaluation_stance(recwarn):
    """A compiled run evaluates under ``eager_on_recompile`` (``TrainModule.plain_model``), where a frame that would
    compile again runs eagerly: FlexAttention run eagerly is its unfused reference, every score of every head held
    at once. Its kernel compiles still, new lengths after a first made dynamic: one compile more, not one a length."""
    from torch._dynamo.utils import counters

    from megatransformer.training.engine.compiled import eager_on_recompile

    mask = SELF_MASKS["causal"]()
    flex = BACKENDS["flex"]
    with torch.no_grad():
        flex(*(t.detach() for t in qkv(T, T)), mask, 0.0)  # (the step's length, compiled as a run would)
        frames = counters["frames"]["ok"]
        with eager_on_recompile():
            for length in (T - 3, T + 5, T - 7):
                q, k, v = (t.detach() for t in qkv(length, length))
                got, want = flex(q, k, v, mask, 0.0), eager_core(q, k, v, mask, 0.0)
                assert torch.allclose(got, want, atol=1e-5), (length, (got - want).abs().max())
    assert not [w for w in recwarn if "unfused implementation" in str(w.message)]
    assert counters["frames"]["ok"] - frames <= 2
