"""Model family: shapes for every option, masks (causal, prefix, packed, padding), backends, caches, init."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F
from support.models import TINY, tiny_config

from megatransformer.model import TP_PLAN, build_model, generate
from megatransformer.model.attention import BACKENDS, eager_core, flash_core
from megatransformer.model.masks import AttentionMask, self_attention_mask

VOCAB = TINY["vocab_size"]


def model_for(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return build_model(tiny_config(**overrides)).eval()


def tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def run(model, ids, **kwargs):
    if model.config.arch == "encoder_decoder":
        return model(ids, decoder_input_ids=kwargs.pop("decoder_input_ids", ids[:, :5]), **kwargs)
    return model(ids, **kwargs)


OPTIONS = [
    dict(zip(("norm", "position", "ffn", "norm_position"), combo))
    for combo in itertools.product(
        ("layernorm", "rmsnorm"), ("sinusoidal", "learned", "rope"), ("relu", "gelu", "swiglu"), ("pre", "post")
    )
]


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(map(str, o.values())))
def test_shapes_every_arch_and_option(arch, options):
    model = model_for(arch=arch, bias=options["norm"] == "layernorm", **options)
    ids = tokens(2, 12)
    logits = run(model, ids)
    expected_len = 5 if arch == "encoder_decoder" else 12
    assert logits.shape == (2, expected_len, VOCAB)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_attention_variants_mha_gqa_mqa(kv_heads):
    model = model_for(n_kv_heads=kv_heads)
    attn = model.decoder.layers[0].self_attn
    assert attn.k_proj.out_features == kv_heads * 8
    assert run(model, tokens(2, 12)).shape == (2, 12, VOCAB)


def test_tied_and_untied_and_shared_embeddings():
    tied = model_for(tie_embeddings=True)
    assert tied.lm_head.weight is tied.embed_tokens.weight
    untied = model_for(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.embed_tokens.weight
    shared = model_for(arch="encoder_decoder", share_embeddings=True)
    assert shared.decoder_embed_tokens is None and shared.lm_head.weight is shared.embed_tokens.weight
    separate = model_for(arch="encoder_decoder", share_embeddings=False)
    assert separate.lm_head.weight is separate.decoder_embed_tokens.weight


def test_embedding_scale_multiplies_by_sqrt_d():
    model = model_for(scale_embeddings=True)
    ids = tokens(1, 4)
    assert torch.allclose(model.embed_tokens(ids), model.embed_tokens.weight[ids] * math.sqrt(32))
    assert model.embed_tokens.weight.std().item() == pytest.approx(32**-0.5, rel=0.1)


def test_post_ln_has_no_final_norm_and_pre_ln_has_one():
    assert model_for(norm_position="post").decoder.norm is None
    assert model_for(norm_position="pre").decoder.norm is not None
    assert model_for(norm_position="pre", final_norm=False).decoder.norm is None


def test_depth_scaled_init():
    torch.manual_seed(0)
    model = build_model(tiny_config(d_model=256, n_heads=4, d_ff=512, n_layers=8, init_std=0.02))
    layer = model.decoder.layers[0]
    assert layer.self_attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert layer.self_attn.o_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert layer.ffn.down_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)


def test_dropout_active_only_in_training():
    model = model_for(dropout=0.5, attention_dropout=0.5)
    ids = tokens(2, 12)
    assert torch.equal(run(model, ids), run(model, ids))
    model.train()
    assert not torch.equal(run(model, ids), run(model, ids))


def test_activation_checkpointing_gives_same_gradients():
    ids = tokens(2, 12)
    grads = []
    for checkpointing in (False, True):
        model = model_for(activation_checkpointing=checkpointing).train()
        run(model, ids).sum().backward()
        grads.append(model.decoder.layers[0].self_attn.q_proj.weight.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


# ------------------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal"])
def test_causal_no_future_leakage(position):
    model = model_for(position=position)
    ids = tokens(1, 16)
    changed = ids.clone()
    changed[0, 9] = (ids[0, 9] + 1) % VOCAB
    a, b = run(model, ids), run(model, changed)
    assert torch.allclose(a[:, :9], b[:, :9], atol=1e-6)
    assert not torch.allclose(a[:, 9:], b[:, 9:], atol=1e-4)


def test_prefix_lm_prefix_is_bidirectional_suffix_is_causal():
    model = model_for()
    ids, prefix = tokens(2, 16), torch.tensor([6, 10])

    def logits_after_change(pos):
        changed = ids.clone()
        changed[:, pos] = (ids[:, pos] + 1) % VOCAB
        return run(model, ids, prefix_len=prefix), run(model, changed, prefix_len=prefix)

    a, b = logits_after_change(4)  # inside both prefixes: every position may change, the first does
    assert not torch.allclose(a[:, 0], b[:, 0], atol=1e-4)
    a, b = logits_after_change(12)  # in both suffixes: only positions >= 12 change
    assert torch.allclose(a[:, :12], b[:, :12], atol=1e-6)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-4)
    a, b = logits_after_change(8)  # prefix of row 1, suffix of row 0
    assert torch.allclose(a[0, :8], b[0, :8], atol=1e-6)
    assert not torch.allclose(a[1, :8], b[1, :8], atol=1e-4)


def test_per_document_prefixes_of_a_packed_row():
    """prefix_len per query: each packed document has its own bidirectional prefix and stays isolated."""
    model = model_for()
    ids = tokens(1, 16)
    segments, positions = packed_row([7, 9], 16)
    ends = torch.tensor([[3] * 7 + [7 + 5] * 9])  # doc 1: prefix 0..2, doc 2: prefix 7..11

    def change(pos):
        changed = ids.clone()
        changed[0, pos] = (ids[0, pos] + 1) % VOCAB
        kwargs = dict(segment_ids=segments, position_ids=positions, prefix_len=ends)
        return run(model, ids, **kwargs)[0], run(model, changed, **kwargs)[0]

    a, b = change(10)  # in doc 2's prefix: doc 2 changes from its start, doc 1 not at all
    assert torch.allclose(a[:7], b[:7], atol=1e-6) and not torch.allclose(a[7], b[7], atol=1e-4)
    a, b = change(13)  # in doc 2's suffix: only positions >= 13 change
    assert torch.allclose(a[:13], b[:13], atol=1e-6)
    a, b = change(2)  # in doc 1's prefix: doc 1 changes from its start, doc 2 not at all
    assert not torch.allclose(a[0], b[0], atol=1e-4) and torch.allclose(a[7:], b[7:], atol=1e-6)
    alone = run(model, ids[:, 7:], prefix_len=torch.tensor([5]))[0]
    packed = run(model, ids, segment_ids=segments, position_ids=positions, prefix_len=ends)[0]
    assert torch.allclose(packed[7:], alone, atol=1e-5)


def test_a_constant_per_query_prefix_equals_the_per_row_prefix():
    model = model_for()
    ids = tokens(2, 12)
    per_row = run(model, ids, prefix_len=torch.tensor([4, 9]))
    per_query = run(model, ids, prefix_len=torch.tensor([[4] * 12, [9] * 12]))
    assert torch.equal(per_row, per_query)


def packed_row(doc_lengths, total):
    segments, positions = [], []
    for i, n in enumerate(doc_lengths, start=1):
        segments += [i] * n
        positions += list(range(n))
    pad = total - len(segments)
    return torch.tensor([segments + [0] * pad]), torch.tensor([positions + [0] * pad])


@pytest.mark.parametrize("arch", ["decoder", "encoder"])
@pytest.mark.parametrize("position", ["rope", "learned"])
def test_packed_documents_are_isolated_and_positions_restart(arch, position):
    model = model_for(arch=arch, position=position)
    ids = tokens(1, 16)
    segments, positions = packed_row([5, 7], 16)
    packed = run(model, ids, segment_ids=segments, position_ids=positions)
    first_alone = run(model, ids[:, :5])
    second_alone = run(model, ids[:, 5:12])
    assert torch.allclose(packed[:, :5], first_alone, atol=1e-5)
    assert torch.allclose(packed[:, 5:12], second_alone, atol=1e-5)


def test_padding_does_not_change_real_tokens():
    model = model_for(arch="encoder")
    ids = tokens(1, 10)
    padded = torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    segments = torch.tensor([[1] * 10 + [0] * 6])
    assert torch.allclose(run(model, padded, segment_ids=segments)[:, :10], run(model, ids), atol=1e-5)


def test_encoder_decoder_packed_examples_are_isolated():
    model = model_for(arch="encoder_decoder")
    src, tgt = tokens(1, 12), tokens(1, 8, seed=2)
    enc_seg, enc_pos = packed_row([7, 5], 12)
    dec_seg, dec_pos = packed_row([3, 4], 8)
    packed = model(
        src, tgt, position_ids=enc_pos, segment_ids=enc_seg, decoder_position_ids=dec_pos, decoder_segment_ids=dec_seg
    )
    second = model(src[:, 7:12], tgt[:, 3:7])
    assert torch.allclose(packed[:, 3:7], second, atol=1e-5)


def random_masks(batch: int, length: int) -> dict[str, AttentionMask]:
    segments, _ = packed_row([5, 6, 3], length)
    return {
        "causal": self_attention_mask(True),
        "bidirectional": self_attention_mask(False),
        "prefix": self_attention_mask(True, prefix_len=torch.tensor([3, 11])[:batch]),
        "packed_causal": self_attention_mask(True, segments.expand(batch, -1)),
        "packed_bidirectional": self_attention_mask(False, segments.expand(batch, -1)),
        "packed_prefix": self_attention_mask(
            True,
            segments.expand(batch, -1),
            torch.tensor([[2] * 5 + [9] * 6 + [14] * 3 + [0] * (length - 14)]).expand(batch, -1),
        ),
    }


@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
@pytest.mark.parametrize(
    "mask_name", ["causal", "bidirectional", "prefix", "packed_causal", "packed_bidirectional", "packed_prefix"]
)
def test_backends_agree_with_eager_reference(backend, mask_name):
    batch, heads, kv_heads, length, dim = 2, 4, 2, 16, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=gen) for _ in range(2))
    mask = random_masks(batch, length)[mask_name]
    expected = eager_core(q, k, v, mask, 0.0)
    assert torch.allclose(BACKENDS[backend](q, k, v, mask, 0.0), expected, atol=1e-5)


def test_whole_model_agrees_across_backends_on_packed_prefix_batch():
    ids = tokens(2, 16)
    segments, positions = packed_row([9, 7], 16)
    kwargs = dict(segment_ids=segments.expand(2, -1), position_ids=positions.expand(2, -1))
    with torch.no_grad():  # FlexAttention has no backward on CPU
        reference = run(model_for(attention_backend="eager"), ids, **kwargs)
        for backend in ("sdpa", "flex"):
            assert torch.allclose(run(model_for(attention_backend=backend), ids, **kwargs), reference, atol=1e-5)


def test_auto_backend_choices(monkeypatch):
    from megatransformer.model import attention

    segments = torch.tensor([[1, 1, 2, 2]])
    packed, prefix = self_attention_mask(True, segments), self_attention_mask(True, prefix_len=torch.tensor([2]))
    cross = attention.AttentionMask(False, segments, segments.clone())
    cached_prefix = self_attention_mask(True, prefix_len=torch.tensor([2]), q_offset=4)
    bf16, fp32 = torch.bfloat16, torch.float32
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    choose = attention.auto_backend
    assert [choose("cpu", fp32), choose("cpu", bf16, packed), choose("cpu", bf16, dropout=0.1)] == [
        "chunked",
        "chunked",
        "sdpa",
    ]
    assert [choose("cuda", bf16), choose("cuda", torch.float16, packed), choose("cuda", fp32)] == [
        "flash",
        "flash",
        "sdpa",
    ]
    # every training mask reaches flash-attn; a prefix behind a KV cache and odd head sizes do not
    assert [choose("cuda", bf16, prefix), choose("cuda", bf16, cross)] == ["flash", "flash"]
    assert [choose("cuda", bf16, cached_prefix), choose("cuda", bf16, head_dim=512)] == ["sdpa", "sdpa"]
    assert (
        attention.describe_backend("auto", "cuda", bf16, 0.0)
        == "attention: auto -> flash for every mask on cuda in bfloat16"
    )
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)
    assert choose("cuda", bf16) == "sdpa"
    assert "pip install flash-attn --no-build-isolation" in attention.describe_backend("auto", "cuda", bf16, 0.0)
    assert attention.describe_backend("sdpa", "cpu", fp32, 0.0) == "attention: sdpa"
    assert (
        attention.describe_backend("auto", "cpu", bf16, 0.0)
        == "attention: auto -> chunked for every mask on cpu in bfloat16"
    )


def test_auto_on_cpu_trains_with_chunked_and_with_sdpa_under_dropout():
    ids = tokens(2, 16)
    for dropout, same_as in ((0.0, "chunked"), (0.1, "sdpa")):
        grads = []
        for backend in ("auto", same_as):
            model = model_for(attention_backend=backend, attention_dropout=dropout).train()
            torch.manual_seed(1)  # the same dropout masks
            run(model, ids).float().pow(2).mean().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert torch.equal(grads[0], grads[1]), same_as


def test_flex_backward_on_cpu_is_refused_with_the_fix():
    model = model_for(attention_backend="flex").train()
    with pytest.raises(ValueError, match="attention_backend=sdpa"):
        run(model, tokens(1, 8))


def test_gqa_with_one_kv_head_equals_multi_query_attention():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 10, 8, generator=gen)
    k, v = torch.randn(2, 1, 10, 8, generator=gen), torch.randn(2, 1, 10, 8, generator=gen)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    # MQA written out: every query head attends to the single shared key/value head by broadcasting.
    scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~causal, float("-inf"))
    mqa = scores.softmax(-1) @ v
    for backend in ("sdpa", "eager"):
        assert torch.allclose(BACKENDS[backend](q, k, v, self_attention_mask(True), 0.0), mqa, atol=1e-6)


def test_dense_mask_never_has_an_empty_row():
    segments = torch.tensor([[1, 1, 0, 0], [0, 2, 2, 0]])
    mask = self_attention_mask(True, segments)
    assert mask.dense(4, 4, torch.device("cpu")).any(dim=-1).all()


def test_flash_backend_without_flash_attn_says_how_to_fix():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises((RuntimeError, ValueError), match="flash"):
        flash_core(q, q, q, self_attention_mask(True), 0.0)


# ------------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=20, top_p=0.9)])
def test_kv_cache_generation_equals_no_cache(arch, sampling):
    model = model_for(arch=arch)
    prompt = tokens(2, 7)
    outs = []
    for use_cache in (True, False):
        gen = torch.Generator().manual_seed(3)
        outs.append(generate(model, prompt, 12, use_cache=use_cache, decoder_start_id=0, generator=gen, **sampling))
    assert outs[0].shape == (2, 12)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("use_cache", [True, False])
def test_prefix_lm_generation_reads_the_prompt_bidirectionally(use_cache):
    model = model_for()
    prompt = tokens(2, 7)
    full = torch.full((2,), 7)
    out = generate(model, prompt, 5, prefix_lm=True, use_cache=use_cache)
    expected = prompt
    for _ in range(5):  # greedy by hand, the prompt as the prefix of every forward
        next_token = model(expected, prefix_len=full)[:, -1].argmax(-1)
        expected = torch.cat([expected, next_token[:, None]], dim=1)
    assert torch.equal(out, expected[:, 7:])
    assert not torch.allclose(model(prompt, prefix_len=full)[:, -1], model(prompt)[:, -1])


def test_generation_stops_at_eos_and_pads_finished_rows():
    model = model_for()
    prompt = tokens(2, 5)
    greedy = generate(model, prompt, 8, temperature=0.0)
    eos = int(greedy[0, 2])
    out = generate(model, prompt, 8, temperature=0.0, eos_id=eos)
    first = (out[0] == eos).nonzero()[0].item()
    assert (out[0, first:] == eos).all()


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_runs_the_output_head_on_the_last_position_alone(arch, use_cache):
    """(A prompt's logits over a large vocabulary, [B, T, V], would outweigh the model's activations.)"""
    model = model_for(arch=arch)
    prompt = tokens(2, 7)
    head_rows = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(out.shape[1]))
    try:
        generate(model, prompt, 4, use_cache=use_cache, decoder_start_id=0)
    finally:
        hook.remove()
    assert head_rows == [1] * 4
    if arch == "decoder":
        last, every = model(prompt, logits_to_keep=1), model(prompt)
    else:
        memory = model.encode(prompt)
        last, every = model.decode(prompt, memory, logits_to_keep=1), model.decode(prompt, memory)
    assert last.shape == (2, 1, VOCAB)
    torch.testing.assert_close(last, every[:, -1:])  # (a GEMM of one row rounds as one of seven may not)


def test_top_k_one_is_greedy():
    model = model_for()
    prompt = tokens(2, 5)
    assert torch.equal(generate(model, prompt, 6, temperature=1.0, top_k=1), generate(model, prompt, 6))


# ----------------------------------------------------------------------------------- tensor parallel


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_tp_plan_covers_every_projection_once(arch):
    model = model_for(arch=arch)
    for name, _param in model.named_parameters():
        matches = [kind for pattern, kind in TP_PLAN.items() if re.match(pattern, name)]
        if re.search(r"_proj\.weight$", name):
            assert len(matches) == 1, name
        else:
            assert not matches, name


def test_model_runs_unchanged_on_a_tensor_parallel_shard():
    """Slicing the heads of q/k/v/o (as AutoTP does) and summing the shards' outputs gives the full output."""
    model = model_for(n_heads=4, n_kv_heads=2)
    attn = model.decoder.layers[0].self_attn
    x = torch.randn(2, 6, 32)
    full = attn(x, self_attention_mask(True))
    total = torch.zeros_like(full)
    for rank in range(2):
        shard = type(attn)(32, 4, 2, False, 0.0, "sdpa")  # built whole, then sliced, as AutoTP does
        rows_q, rows_kv = slice(rank * 16, rank * 16 + 16), slice(rank * 8, rank * 8 + 8)
        shard.q_proj.weight.data = attn.q_proj.weight[rows_q]
        shard.k_proj.weight.data = attn.k_proj.weight[rows_kv]
        shard.v_proj.weight.data = attn.v_proj.weight[rows_kv]
        shard.o_proj.weight.data = attn.o_proj.weight[:, rows_q]
        total += shard(x, self_attention_mask(True))
    assert torch.allclose(total, full, atol=1e-6)


def test_loss_decreases_when_overfitting_one_batch():
    model = model_for().train()
    ids = tokens(4, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.5


@pytest.mark.parametrize(
    "arch,tied", [("decoder", True), ("decoder", False), ("encoder", True), ("encoder_decoder", True)]
)
def test_labels_give_the_loss_of_the_logits_and_its_gradients(arch, tied):
    """Given labels, a model returns the summed token loss from its fused head (no logits) and the same
    gradients for every parameter as the cross-entropy of its logits (tied head and embedding included)."""
    import torch.nn.functional as F

    model = model_for(arch=arch, tie_embeddings=tied).train()
    inputs = {"input_ids": tokens(2, 12)}
    labels = tokens(2, 12, seed=2)
    if arch == "encoder_decoder":
        inputs["decoder_input_ids"] = tokens(2, 7, seed=3)
        labels = tokens(2, 7, seed=4)
    labels[0, :3] = -100

    def loss_and_grads(loss):
        model.zero_grad()
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    plain = loss_and_grads(F.cross_entropy(model(**inputs).float().flatten(0, 1), labels.flatten(), reduction="sum"))
    fused = loss_and_grads(model(**inputs, labels=labels))
    torch.testing.assert_close(fused[0], plain[0])
    assert fused[1].keys() == plain[1].keys()
    for name, grad in plain[1].items():
        torch.testing.assert_close(fused[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)
