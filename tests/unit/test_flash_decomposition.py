"""flash-attn for every mask: the decomposition into varlen problems, checked on CPU against ``eager``.

flash-attn needs CUDA, so ``flash_core`` runs here on ``tests/support/flash_reference.py``, an obvious implementation
of the kernel's documented contract; the ``gpu``-marked tests at the end run the real kernel for every mask.
Outputs of padding queries carry no loss and are not compared (each backend fills them its own way).
"""

from __future__ import annotations

import pytest
import torch
from support.attention import (
    PACKED,
    SELF_MASKS,
    B,
    T,
    assert_close_in_bf16,
    assert_same,
    needs_flash,
    per_document_prefix,
    qkv,
    rows,
    values_and_grads,
)
from support.models import tiny_config

from megatransformer.model.attention import eager_core, flash_core
from megatransformer.model.masks import (
    AttentionMask,
    ModelMasks,
    batch_masks,
    cross_attention_mask,
    self_attention_mask,
    varlen_problems,
)


@pytest.mark.parametrize("name", SELF_MASKS)
def test_flash_decomposition_equals_eager_for_every_self_attention_mask(reference_flash, name):
    mask = SELF_MASKS[name]()
    q, k, v = qkv()
    assert_same(values_and_grads(flash_core, q, k, v, mask), values_and_grads(eager_core, q, k, v, mask))


def test_flash_decomposition_equals_eager_for_packed_cross_attention(reference_flash):
    decoder = rows([4, 3, 6, -6], [2, 9, 1, -7])
    encoder = torch.cat([rows([6, 2, 4, -7], [10, 1, 8])], dim=0)[:, :15]  # row 1: no padding keys
    mask = cross_attention_mask(decoder, encoder)
    q, k, v = qkv(q_len=T, k_len=15)
    assert_same(values_and_grads(flash_core, q, k, v, mask), values_and_grads(eager_core, q, k, v, mask))


def test_flash_with_a_kv_cache_is_bottom_right_aligned(reference_flash):
    mask = self_attention_mask(True, q_offset=9)  # 6 new queries after 9 cached positions
    q, k, v = qkv(q_len=6, k_len=15)
    assert_same(values_and_grads(flash_core, q, k, v, mask), values_and_grads(eager_core, q, k, v, mask))


def test_prefix_document_is_two_problems():
    segments = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 0]])
    prefix = torch.tensor([[2, 2, 2, 2, 7, 7, 7, 0]])  # doc 1: prefix 2 of 4; doc 2: all prefix; padding
    prefix_part, rest = varlen_problems(True, segments.numpy(), prefix.numpy(), (1, 8))
    assert not prefix_part.causal and prefix_part.q_index.tolist() == [0, 1, 4, 5, 6]
    assert prefix_part.cu_q.tolist() == prefix_part.cu_k.tolist() == [0, 2, 5]
    assert rest.causal and rest.q_index.tolist() == [2, 3, 7] and rest.k_index.tolist() == [0, 1, 2, 3, 7]
    assert rest.cu_q.tolist() == [0, 2, 3] and rest.cu_k.tolist() == [0, 4, 5]  # (doc 2 has no query here)
    assert (rest.max_q, rest.max_k, rest.cu_q.dtype) == (2, 4, torch.int32)


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_host_built_masks_equal_the_models_own(arch):
    """batch_masks (host, once per batch) gives the model exactly what it builds from its inputs."""
    from megatransformer.model import build_model

    cfg = tiny_config(arch=arch, d_ff=64, vocab_size=64, max_seq_len=32, attention_backend="chunked")
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 64, (B, T))
    batch = {"input_ids": ids, "segment_ids": PACKED, "position_ids": torch.zeros_like(ids)}
    if arch == "decoder":
        batch["prefix_len"] = per_document_prefix(PACKED, [[2, 6, 1], [7, 0]])
    if arch == "encoder_decoder":
        batch.update(decoder_input_ids=ids.flip(1), decoder_segment_ids=rows([4, 3, 6, -6], [2, 9, -8]))
    masks = batch_masks(arch, batch, varlen=True)
    assert isinstance(masks, ModelMasks)
    with torch.no_grad():
        assert torch.equal(model(**batch, masks=masks), model(**batch))


def test_host_masks_drop_the_segment_check_for_one_document_rows():
    ids = torch.zeros(B, T, dtype=torch.long)
    masks = batch_masks("decoder", {"input_ids": ids, "segment_ids": torch.ones(B, T, dtype=torch.long)}, True)
    assert masks.decoder.is_simple and masks.decoder.varlen is None


def test_host_masks_carry_varlen_problems_and_chunk_bounds():
    ids = torch.zeros(B, T, dtype=torch.long)
    prefix = per_document_prefix(PACKED, [[2, 6, 1], [7, 0]])
    mask = batch_masks("decoder", {"input_ids": ids, "segment_ids": PACKED, "prefix_len": prefix}, True).decoder
    lazy = AttentionMask(True, PACKED, PACKED, prefix)
    for built, computed in zip(mask.varlen, lazy.varlen_problems(B, T, T), strict=True):
        assert torch.equal(built.cu_q, computed.cu_q) and torch.equal(built.q_index, computed.q_index)
    assert mask.key_bounds.tolist() == prefix.amax(0).tolist()  # (host NumPy: no device read)
    assert mask.key_end(T, 0, 4, T) == max(4, int(prefix[:, :4].max()))


# ------------------------------------------------------------------------------ the real kernel (GPU)


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("name", [*SELF_MASKS, "cross", "cached"])
def test_real_flash_attn_equals_eager_for_every_mask(name):
    torch.manual_seed(0)
    q_len, k_len = {"cross": (T, 15), "cached": (6, 15)}.get(name, (T, T))
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_() for t in qkv(q_len, k_len))
    if name == "cross":
        mask = cross_attention_mask(rows([4, 3, 6, -6], [2, 9, 1, -7]), rows([6, 2, 4, -7], [10, 1, 8])[:, :15])
    elif name == "cached":
        mask = self_attention_mask(True, q_offset=9)
    else:
        mask = SELF_MASKS[name]()
    mask = mask.to("cuda")
    flash = values_and_grads(flash_core, q, k, v, mask)
    eager = values_and_grads(eager_core, *(t.detach().float().requires_grad_() for t in (q, k, v)), mask)
    assert_close_in_bf16(flash, eager)
