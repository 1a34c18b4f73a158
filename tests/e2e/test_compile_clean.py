"""``train.compile`` traces the model's forward as one graph: no graph break in any attention core (nor in
multi-head latent attention's).

Each case is a training forward (loss head included) with the masks the trainer builds once per batch
(:func:`masks.batch_masks`): plain, packed documents, prefix-LM per document, and packed encoder-decoder
batches. flash-attn registers its kernels as PyTorch custom ops, opaque to the compiler; on CPU a custom
op over ``tests/support/flash_reference.py`` stands in for them, so that everything ``flash_core`` does around the
kernel (varlen problems, gathers, scatters) is traced here.
"""

from __future__ import annotations

import pytest
import torch
from support.flash_ops import FLASH_OPS
from support.models import tiny_config

from megatransformer.model import attention, build_model
from megatransformer.model.masks import batch_masks

T = 16
SEGMENTS = torch.tensor([[1] * 6 + [2] * 7 + [0] * 3, [1] * T])
BATCHES = {
    "plain": {},
    "packed": {"segment_ids": SEGMENTS},
    "prefix": {"segment_ids": SEGMENTS, "prefix_len": torch.tensor([[3] * 6 + [13] * 7 + [0] * 3, [5] * T])},
}


def graph_breaks(
    arch: str,
    backend: str,
    batch: dict[str, torch.Tensor],
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    **fields,
) -> int:
    cfg = tiny_config(arch=arch, position="rope", attention_backend=backend, **fields)
    torch.manual_seed(0)
    model = build_model(cfg).to(device, dtype)
    ids = torch.randint(0, 97, (2, T))
    batch = {"input_ids": ids, **batch}
    if arch == "encoder_decoder":
        batch |= {"decoder_input_ids": ids, "decoder_segment_ids": batch.get("segment_ids")}
    masks = batch_masks(arch, batch, varlen=backend == "flash").to(device)
    inputs = {name: batch[name].to(device) for name in ("input_ids", "decoder_input_ids") if name in batch}
    labels = ids.to(device)

    def loss(inputs):
        return model(**inputs, masks=masks, labels=labels)

    torch._dynamo.reset()
    return torch._dynamo.explain(loss)(inputs).graph_break_count


@pytest.fixture
def flash_ops(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_module", lambda: FLASH_OPS)


@pytest.mark.parametrize("backend", ["auto", "chunked", "sdpa"])
@pytest.mark.parametrize("kind", BATCHES)
def test_decoder_forward_compiles_without_graph_breaks(backend, kind):
    assert graph_breaks("decoder", backend, BATCHES[kind]) == 0


@pytest.mark.parametrize("kind", BATCHES)
def test_flash_core_around_the_kernel_compiles_without_graph_breaks(flash_ops, kind):
    assert graph_breaks("decoder", "flash", BATCHES[kind]) == 0


@pytest.mark.parametrize("backend", ["chunked", "sdpa", "flash"])
def test_packed_encoder_decoder_compiles_without_graph_breaks(flash_ops, backend):
    assert graph_breaks("encoder_decoder", backend, BATCHES["packed"]) == 0


# multi-head latent attention, values narrower than queries and keys (padded for chunked and flash-attn)
LATENT = dict(attention="mla", n_kv_heads=None, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6)


@pytest.mark.parametrize("backend", ["chunked", "sdpa", "flash"])
def test_latent_attention_compiles_without_graph_breaks(flash_ops, backend):
    assert graph_breaks("decoder", backend, BATCHES["prefix"], **LATENT) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the flash case also the flash-attn package)")
@pytest.mark.parametrize("backend", ["sdpa", "flash"])
@pytest.mark.parametrize("kind", BATCHES)
def test_cuda_cores_compile_without_graph_breaks(backend, kind):
    if backend == "flash" and attention.flash_attn_module() is None:
        pytest.skip("needs the flash-attn package (pip install flash-attn --no-build-isolation)")
    assert graph_breaks("decoder", backend, BATCHES[kind], "cuda", torch.bfloat16) == 0


def test_compiled_prefix_chunks_equal_the_eager_ones():
    """Compiled, a prefix chunk takes every key (its bound would be a new shape per batch): the same values."""
    model = build_model(tiny_config(position="rope", attention_backend="chunked"))
    ids = torch.randint(0, 97, (2, T))
    batch = {"input_ids": ids, **BATCHES["prefix"]}

    def loss_and_grads(forward):
        loss = forward(input_ids=ids, masks=batch_masks("decoder", batch), labels=ids)
        return [loss, *torch.autograd.grad(loss, list(model.parameters()))]

    eager = loss_and_grads(model)
    compiled = loss_and_grads(torch.compile(model, backend="eager"))
    for got, want in zip(compiled, eager, strict=True):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
