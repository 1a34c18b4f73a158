"""flash-attn for every mask: the decomposition into varlen problems, checked on CPU against ``eager``.

flash-attn needs CUDA, so ``flash_core`` runs here on ``tests/flash_reference.py``, an obvious implementation
of the kernel's documented contract; the ``gpu``-marked tests at the end run the real kernel for every mask.
Outputs of padding queries carry no loss and are not compared (each backend fills them its own way).
"""

from __future__ import annotations

import pytest
import torch

import flash_reference
from megatransformer.batch import PAD_SEGMENT
from megatransformer.model import attention
from megatransformer.model.attention import eager_core, flash_core
from megatransformer.model.masks import (
    AttentionMask,
    ModelMasks,
    batch_masks,
    cross_attention_mask,
    self_attention_mask,
    varlen_problems,
)

B, H, KV, T, D = 2, 4, 2, 19, 8


def rows(*segment_rows: list[int]) -> torch.Tensor:
    """Segment ids from run lengths per row: rows([3, 2], [5]) -> [[1,1,1,2,2], [1,1,1,1,1]] (0 pads)."""
    out = torch.zeros(len(segment_rows), T, dtype=torch.long)
    for r, lengths in enumerate(segment_rows):
        at = 0
        for index, n in enumerate(lengths):
            out[r, at:at + n] = index + 1 if n > 0 else 0
            at += abs(n)
    return out


PACKED = rows([5, 6, 3, -5], [7, 12])  # row 0 ends in 5 padding positions
LEADING_PAD = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2, 0, 0, 3, 3, 3, 3, 3, 3, 0, 0]]).expand(B, -1).contiguous()


def per_document_prefix(segments: torch.Tensor, prefix: list[list[int]]) -> torch.Tensor:
    """[B, T] prefix ends: document k of row b has a prefix of prefix[b][k] tokens (0 for padding)."""
    ends = torch.zeros_like(segments)
    for b in range(segments.shape[0]):
        for k, length in enumerate(prefix[b]):
            where = (segments[b] == k + 1).nonzero().flatten()
            if len(where):
                ends[b, where] = int(where[0]) + length
    return ends


SELF_MASKS = {
    "causal": lambda: self_attention_mask(True),
    "bidirectional": lambda: self_attention_mask(False),
    "prefix_per_row": lambda: self_attention_mask(True, prefix_len=torch.tensor([3, 11])),
    "prefix_whole_row": lambda: self_attention_mask(True, prefix_len=torch.tensor([T, 0])),
    "packed_causal": lambda: self_attention_mask(True, PACKED),
    "packed_bidirectional": lambda: self_attention_mask(False, PACKED),
    "padding_inside": lambda: self_attention_mask(True, LEADING_PAD),
    "packed_prefix_per_row": lambda: self_attention_mask(True, PACKED, torch.tensor([4, 9])),
    "packed_prefix_per_document": lambda: self_attention_mask(
        True, PACKED, per_document_prefix(PACKED, [[2, 6, 1], [7, 0]])),  # a whole-prefix and a no-prefix doc
}


@pytest.fixture
def reference_flash(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_module", lambda: flash_reference.MODULE)


def qkv(q_len: int = T, k_len: int = T, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, q_len, D, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(B, KV, k_len, D, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(B, KV, k_len, D, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def real_queries(mask: AttentionMask, q_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, 1, Tq, 1] on ``device``: queries whose outputs carry loss (not padding)."""
    if mask.q_segments is None:
        return torch.ones(B, 1, q_len, 1, dtype=torch.bool, device=device)
    return (mask.q_segments != PAD_SEGMENT).view(B, 1, q_len, 1).to(device)


def values_and_grads(core, q, k, v, mask, *extra, **kwargs):
    """The core's outputs at real queries and q/k/v gradients of a random weighting of them (``extra``,
    ``kwargs``: more arguments of the core, e.g. an ALiBi bias); on the core's device, with the same
    weighting on every device."""
    out = core(q, k, v, mask, 0.0, *extra, **kwargs)
    keep = real_queries(mask, q.shape[2], out.device)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    (out * weights * keep).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach() * keep, grads


def assert_same(flash, eager, atol=1e-5):
    assert torch.allclose(flash[0], eager[0], atol=atol), (flash[0] - eager[0]).abs().max()
    for got, want in zip(flash[1], eager[1]):
        assert torch.allclose(got, want, atol=atol), (got - want).abs().max()


def assert_close_in_bf16(kernel, eager, tolerance=2e-2):
    """A bf16 kernel's outputs and gradients against fp32 eager, by error relative to each tensor's norm (bf16
    keeps 8 bits: ~4e-3 per element, and gradients summed over many keys scale with them)."""
    for got, want in zip((kernel[0], *kernel[1]), (eager[0], *eager[1])):
        error = (got.float() - want).norm() / want.norm()
        assert error < tolerance, f"relative error {error:.3g}"


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
    assert rest.causal and rest.q_index.tolist() == [2, 3, 7] and rest.k_index is None
    assert rest.cu_q.tolist() == [0, 2, 2, 3] and rest.cu_k.tolist() == [0, 4, 7, 8]
    assert (rest.max_q, rest.max_k, rest.cu_q.dtype) == (2, 4, torch.int32)


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_host_built_masks_equal_the_models_own(arch):
    """batch_masks (host, once per batch) gives the model exactly what it builds from its inputs."""
    from megatransformer.config import ModelConfig
    from megatransformer.model import build_model

    cfg = ModelConfig(arch=arch, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64,
                      max_seq_len=32, attention_backend="chunked")
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

gpu = pytest.mark.gpu
needs_flash = pytest.mark.skipif(
    not torch.cuda.is_available() or attention.flash_attn_module() is None,
    reason="needs CUDA and the flash-attn package (pip install flash-attn --no-build-isolation); CPU machines "
           "check the decomposition against tests/flash_reference.py above",
)


@gpu
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
