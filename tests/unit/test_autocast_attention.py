"""fp32 weights under bf16 autocast: queries, keys and values reach the attention core in one dtype.

CPU autocast runs the same model code as CUDA autocast (``auto`` picks its core from the autocast dtype), so
the dtypes are checked here; the ``gpu`` test runs flash-attn itself on them.
"""

from __future__ import annotations

import pytest
import torch
from support.models import tiny_config

from megatransformer.model import attention, build_model

ARCHS = ("decoder", "encoder", "encoder_decoder")


def tiny_model(device: str = "cpu", **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(tiny_config(**{"position": "rope", **overrides})).to(device)


def record_core_dtypes(model: torch.nn.Module) -> list[tuple[torch.dtype, ...]]:
    """Wrap every attention module's core; the list fills with the (q, k, v) dtypes of each call."""
    seen = []
    for module in model.modules():
        if isinstance(module, attention.Attention):

            def core(q, k, v, *args, _inner=module.core, **kwargs):
                seen.append((q.dtype, k.dtype, v.dtype))
                return _inner(q, k, v, *args, **kwargs)

            module.core = core
    return seen


def forward(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if model.config.arch == "encoder_decoder":
        return model(ids, decoder_input_ids=ids)
    return model(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_attention_cores_see_the_autocast_dtype_with_fp32_weights(arch):
    model = tiny_model(arch=arch)
    seen = record_core_dtypes(model)
    ids = torch.randint(0, 97, (2, 12))
    with torch.autocast("cpu", torch.bfloat16):
        forward(model, ids).float().sum().backward()
    assert seen and set(seen) == {(torch.bfloat16,) * 3}


def test_cached_decoding_under_autocast_keeps_one_dtype():
    model = tiny_model().eval()
    seen = record_core_dtypes(model)
    ids = torch.randint(0, 97, (2, 6))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        caches = model.new_caches(2, 8)
        model(ids, caches=caches)
        model(ids[:, :1], caches=caches)
    assert set(seen) == {(torch.bfloat16,) * 3}


def test_rope_keeps_the_input_dtype_and_rotates_in_fp32():
    from megatransformer.model.positions import Rotary, apply_rope

    cos, sin = Rotary(8, 10000.0)(torch.arange(300).view(1, -1), torch.float32)
    x = torch.randn(1, 2, 300, 8)
    rotated = apply_rope(x.bfloat16(), cos, sin)
    assert rotated.dtype == torch.bfloat16
    assert torch.equal(rotated, apply_rope(x.bfloat16().float(), cos, sin).bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or attention.flash_attn_module() is None,
    reason="needs CUDA and the flash-attn package (pip install flash-attn --no-build-isolation)",
)
@pytest.mark.parametrize("arch", ARCHS)
def test_flash_attn_under_cuda_autocast_with_fp32_weights_equals_sdpa(arch):
    flash, sdpa = (
        tiny_model("cuda", arch=arch, attention_backend="flash"),
        tiny_model("cuda", arch=arch, attention_backend="sdpa"),
    )
    ids = torch.randint(0, 97, (2, 12), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        out, expected = forward(flash, ids).float(), forward(sdpa, ids).float()
        out.sum().backward()
    assert torch.allclose(out, expected, atol=3e-2, rtol=3e-2)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in flash.parameters() if p.requires_grad)
