"""ALiBi (``model.position=alibi``): the paper's slopes, every attention backend against ``eager`` (forward and
gradients) for causal, packed and prefix-LM masks, cached generation, tensor-parallel shards, and which
``transformers`` families take it.

flash-attn needs CUDA: on CPU ``flash_core`` runs on ``tests/support/flash_reference.py`` (flash-attn's
documented ``alibi_slopes`` contract); the ``gpu``-marked tests at the end run the real kernel.
"""

from __future__ import annotations

import pytest
import torch
from support import flash_reference
from support.attention import (
    SELF_MASKS,
    B,
    H,
    T,
    alibi_config,
    assert_close_in_bf16,
    assert_same,
    document_positions,
    needs_flash,
    packed_batch,
    qkv,
    real_queries,
    values_and_grads,
)

from megatransformer.batch import PAD_SEGMENT
from megatransformer.config import ConfigError, validate
from megatransformer.model import build_model, generate
from megatransformer.model.attention import BACKENDS, eager_core
from megatransformer.model.masks import batch_masks, self_attention_mask
from megatransformer.model.positions import Alibi, alibi_slopes
from megatransformer.model.tp_plan import assign_head_offsets


def test_slopes_are_the_papers_for_8_and_12_heads():
    assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]  # 1/2, 1/4, ..., 1/256
    twelve = alibi_slopes(12)
    # the closest power of two (8), then every other slope of 16 heads: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5
    expected = [2.0**-i for i in range(1, 9)] + [2.0 ** -(i / 2) for i in (1, 3, 5, 7)]
    assert torch.allclose(twelve, torch.tensor(expected), rtol=1e-6, atol=0)
    assert alibi_slopes(16).tolist() == pytest.approx([2.0 ** -(i / 2) for i in range(1, 17)], rel=1e-6)
    assert twelve.dtype == torch.float32


def test_bias_is_minus_slope_times_distance_within_a_document():
    positions = torch.tensor([[0, 1, 2, 0, 1]])  # two packed documents
    bias = Alibi(torch.tensor([0.5, 0.25]), positions, positions).bias()
    assert bias.shape == (1, 2, 5, 5)
    assert bias[0, 0, 2].tolist() == [-1.0, -0.5, 0.0, -1.0, -0.5]  # |2 - k| / 2
    assert bias[0, 1, 0].tolist() == [0.0, -0.25, -0.5, 0.0, -0.25]  # symmetric for bidirectional attention


# ------------------------------------------------------------------------------- every core vs eager


def alibi_for(mask, heads: int = H, q_offset: int = 0, kv_len: int = T) -> Alibi:
    q_pos = document_positions(mask.q_segments)
    if q_offset:  # new queries after a cache of q_offset positions
        keys = torch.arange(kv_len).expand(B, -1)
        return Alibi(alibi_slopes(heads), keys[:, q_offset:], keys)
    return Alibi(alibi_slopes(heads), q_pos, q_pos)


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "flash"])
@pytest.mark.parametrize("name", SELF_MASKS)
def test_every_core_equals_eager_with_alibi(reference_flash, backend, name):
    mask = SELF_MASKS[name]()
    alibi = alibi_for(mask)
    q, k, v = qkv()
    kwargs = {"chunk": 4} if backend == "chunked" else {}  # several chunks per row, bias rebuilt in each
    want = values_and_grads(eager_core, q, k, v, mask, alibi)
    assert_same(values_and_grads(BACKENDS[backend], q, k, v, mask, alibi, **kwargs), want)
    if name in ("causal", "packed_causal"):  # the bias matters: without it the outputs differ
        assert not torch.allclose(values_and_grads(eager_core, q, k, v, mask, None)[0], want[0], atol=1e-3)


@pytest.mark.parametrize("name", ["causal", "bidirectional", "packed_causal", "packed_prefix_per_document"])
def test_flex_equals_eager_with_alibi_forward(name):
    """FlexAttention has no backward on CPU: the forward (score_mod) only."""
    mask = SELF_MASKS[name]()
    alibi = alibi_for(mask)
    q, k, v = (t.detach() for t in qkv())
    with torch.no_grad():
        got, want = BACKENDS["flex"](q, k, v, mask, 0.0, alibi), eager_core(q, k, v, mask, 0.0, alibi)
    keep = real_queries(mask, T)
    assert torch.allclose(got * keep, want * keep, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "flash"])
def test_cores_with_a_kv_cache_equal_eager_with_alibi(reference_flash, backend):
    mask = self_attention_mask(True, q_offset=9)  # 6 new queries after 9 cached positions
    alibi = alibi_for(mask, q_offset=9, kv_len=15)
    q, k, v = qkv(q_len=6, k_len=15)
    kwargs = {"chunk": 4} if backend == "chunked" else {}
    assert_same(
        values_and_grads(BACKENDS[backend], q, k, v, mask, alibi, **kwargs),
        values_and_grads(eager_core, q, k, v, mask, alibi),
    )


def test_flash_reference_applies_the_documented_bias():
    """One sequence of 2 queries over 3 keys, bottom-right aligned: bias -slope * |i + 3 - 2 - j|."""
    q = torch.zeros(2, 1, 4)  # zero scores: the softmax is the bias alone
    k, v = torch.zeros(3, 1, 4), torch.eye(3, 4).unsqueeze(1)
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    out = flash_reference.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 3, alibi_slopes=torch.tensor([1.0]))
    expected = torch.tensor([[-1.0, 0.0, -1.0], [-2.0, -1.0, 0.0]]).softmax(-1)  # rows: distances to keys
    assert torch.allclose(out[:, 0, :3], expected)


# ------------------------------------------------------------------------------------------ the model


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
@pytest.mark.parametrize("backend", ["sdpa", "chunked", "flash"])
def test_models_equal_eager_on_packed_prefix_batches(reference_flash, arch, backend):
    """Whole models on a packed batch (prefix-LM documents for the decoder), with the per-batch host masks
    (flash's varlen problems included): logits of real positions and every parameter gradient match."""
    batch = packed_batch(arch)
    masks = batch_masks(arch, batch, varlen=True)
    segments = batch.get("decoder_segment_ids", batch["segment_ids"])
    keep = (segments != PAD_SEGMENT).unsqueeze(-1)
    results = []
    for name in ("eager", backend):
        torch.manual_seed(0)
        model = build_model(alibi_config(arch, attention_backend=name))
        logits = model(**batch, masks=masks) * keep
        logits.square().sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, atol=1e-4), name


def test_a_packed_document_sees_what_it_would_see_alone():
    """Positions restart per document and attention stops at its boundary: the bias is the same."""
    torch.manual_seed(0)
    model = build_model(alibi_config()).eval()
    ids = torch.randint(0, 64, (1, 12))
    segments = torch.tensor([[1] * 5 + [2] * 7])
    with torch.no_grad():
        packed = model(ids, position_ids=document_positions(segments)[:1], segment_ids=segments)
        alone = model(ids[:, 5:])
    assert torch.allclose(packed[:, 5:], alone, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "chunked"])
def test_cached_decoding_equals_the_full_forward(backend):
    """Logits of a prompt and then one token at a time through the KV cache equal one full forward, far
    past max_seq_len (16): ALiBi has no position table."""
    torch.manual_seed(0)
    model = build_model(alibi_config(attention_backend=backend)).eval()
    ids = torch.randint(0, 64, (2, 40))
    with torch.no_grad():
        full = model(ids)
        caches = model.new_caches(2, 40)
        steps = [model(ids[:, :7], caches=caches)] + [model(ids[:, t : t + 1], caches=caches) for t in range(7, 40)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5)


@pytest.mark.parametrize(
    "arch, kwargs", [("decoder", {}), ("decoder", {"prefix_lm": True}), ("encoder_decoder", {"decoder_start_id": 1})]
)
def test_cached_generation_equals_uncached(arch, kwargs):
    torch.manual_seed(0)
    model = build_model(alibi_config(arch)).eval()
    prompt = torch.randint(0, 64, (2, 9))
    cached = generate(model, prompt, 30, use_cache=True, **kwargs)
    uncached = generate(model, prompt, 30, use_cache=False, **kwargs)
    assert cached.shape == (2, 30) and torch.equal(cached, uncached)


def test_tensor_parallel_shards_take_their_own_heads_slopes():
    """A shard holding heads 3..5 of 6 (rank 1 of 2) computes exactly those heads of the whole module."""
    torch.manual_seed(0)
    model = build_model(alibi_config(n_kv_heads=6))
    attn = model.decoder.layers[0].self_attn
    x, positions = torch.randn(1, 10, 48), torch.arange(10).view(1, -1)
    alibi = Alibi(alibi_slopes(6), positions, positions)
    mask = self_attention_mask(True)
    whole = attn.core  # heads of the whole module, before o_proj
    q, k, v = (attn._heads(p(x)) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    want = whole(q, k, v, mask, 0.0, alibi)[:, 3:]
    assign_head_offsets(model, rank=1, size=2)
    assert attn.head_offset == 3
    shard = alibi.heads(attn.head_offset, 3)
    got = whole(q[:, 3:], k[:, 3:], v[:, 3:], mask, 0.0, shard)
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(whole(q[:, 3:], k[:, 3:], v[:, 3:], mask, 0.0, alibi.heads(0, 3)), want, atol=1e-3)


def test_seq_len_beyond_max_seq_len_is_allowed_only_without_a_position_table():
    raw = {"model": alibi_config().model_dump(), "data": {"seq_len": 64}}
    assert validate(raw).data.seq_len == 64
    raw["model"]["position"] = "learned"
    with pytest.raises(ConfigError, match="exceeds model.max_seq_len"):
        validate(raw)


def test_no_transformers_family_takes_alibi():
    """Llama (RoPE) and GPT-2 (learned positions) both name ALiBi as what blocks them."""
    from megatransformer.hf import GPT2, LLAMA

    llama = alibi_config(norm="rmsnorm", ffn="swiglu", bias=False)
    gpt2 = alibi_config(n_kv_heads=6, norm="layernorm", ffn="gelu", bias=True, tie_embeddings=True)
    assert LLAMA.incompatibility(llama) == "model.position=alibi (Llama needs rope)"
    assert GPT2.incompatibility(gpt2) == "model.position=alibi (GPT-2 needs learned)"


# ------------------------------------------------------------------------------ the real kernel (GPU)


def on_cuda(alibi: Alibi) -> Alibi:
    return Alibi(alibi.slopes.cuda(), alibi.q_positions.cuda(), alibi.k_positions.cuda())


@pytest.mark.gpu
@needs_flash
@pytest.mark.parametrize("name", [*SELF_MASKS, "cached"])
def test_real_flash_attn_alibi_equals_eager(name):
    """flash-attn's alibi_slopes (bf16) against eager in fp32, forward and gradients, for every mask."""
    q_len, k_len = (6, 15) if name == "cached" else (T, T)
    if name == "cached":
        mask = self_attention_mask(True, q_offset=9)
        alibi = alibi_for(mask, q_offset=9, kv_len=15)
    else:
        mask = SELF_MASKS[name]()
        alibi = alibi_for(mask)
    mask, alibi = mask.to("cuda"), on_cuda(alibi)
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_() for t in qkv(q_len, k_len))
    flash = values_and_grads(BACKENDS["flash"], q, k, v, mask, alibi)
    eager = values_and_grads(eager_core, *(t.detach().float().requires_grad_() for t in (q, k, v)), mask, alibi)
    assert_close_in_bf16(flash, eager)


@pytest.mark.gpu
@needs_flash
def test_real_flash_attn_alibi_model_equals_eager_on_a_packed_prefix_batch():
    batch = {k: v.cuda() for k, v in packed_batch("decoder").items()}
    masks = batch_masks("decoder", {k: v.cpu() for k, v in batch.items()}, varlen=True).to("cuda")
    keep = (batch["segment_ids"] != PAD_SEGMENT).unsqueeze(-1)
    logits = {}
    for name in ("eager", "flash"):
        torch.manual_seed(0)
        model = build_model(alibi_config(attention_backend=name)).cuda()
        with torch.autocast("cuda", torch.bfloat16, enabled=name == "flash"), torch.no_grad():
            logits[name] = model(**batch, masks=masks).float() * keep
    assert torch.allclose(logits["flash"], logits["eager"], atol=5e-2)


def test_activation_checkpointing_recomputes_with_the_bias():
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = build_model(alibi_config(attention_backend="chunked", activation_checkpointing=recompute)).train()
        model(torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])
