"""Multi-head latent attention: every core under every mask equals the textbook one, the cache holds the latent
and the RoPE key and its absorbed form equals the up-projected one, generation equals generation without a
cache, a tensor-parallel shard of the heads runs unchanged; the config's bad input is refused with one line.

The GPU cores (flash-attn, PyTorch's varlen_attn) run on tests/support/flash_reference.py here: the values are
zero-padded to the query/key width for them, which this checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.varlen
from support import flash_reference
from support.attention import PACKED, B, T, per_document_prefix
from support.models import tiny_config

from megatransformer.config import ConfigError, ModelConfig
from megatransformer.model import build_model
from megatransformer.model.generate import generate
from megatransformer.model.latent_attention import LatentAttention
from megatransformer.model.masks import self_attention_mask
from megatransformer.model.tp_plan import TP_PLAN, partition_dim

# value width 12 against a query/key width of 8 + 16 = 24; queries through their own latent
MLA = dict(attention="mla", kv_lora_rank=24, q_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)


def mla_config(**fields) -> ModelConfig:
    return tiny_config(**{"n_kv_heads": None, "max_seq_len": 32, **MLA, **fields})


def mla_model(seed: int = 0, **fields):
    torch.manual_seed(seed)
    return build_model(mla_config(**fields)).eval()


def with_backend(model, backend: str):
    """The same weights under another attention core."""
    other = build_model(model.config.model_copy(update={"attention_backend": backend}))
    other.load_state_dict(model.state_dict())
    return other.eval()


@pytest.fixture
def reference_varlen(monkeypatch):
    """PyTorch's varlen_attn (CUDA only) replaced by its documented contract."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1]  # one width: the values were padded
        return flash_reference.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=window_size[1] == 0, window_size=window_size
        )

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_attn)


MASKS = {  # (arch, model fields, forward inputs)
    "causal": ("decoder", {}, {}),
    "packed_documents": ("decoder", {}, {"segment_ids": PACKED}),
    "prefix_lm": ("decoder", {}, {"segment_ids": PACKED, "prefix_len": per_document_prefix(PACKED, [[2, 6], [7, 0]])}),
    "sliding_window": ("decoder", {"attention_window": 5}, {"segment_ids": PACKED}),
    "bidirectional_packed": ("encoder", {}, {"segment_ids": PACKED}),
    "bidirectional_window": ("encoder", {"attention_window": 4}, {}),
}
TRAINING_CORES = ["sdpa", "chunked", "flash", "varlen"]


def logits_and_grads(model, inputs: dict, training: bool = True):
    ids = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    if not training:
        with torch.no_grad():
            return model(ids, **inputs), {}
    model.zero_grad()
    logits = model(ids, **inputs)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4))
    keep = (inputs["segment_ids"] != 0).unsqueeze(-1) if "segment_ids" in inputs else 1  # padding carries no loss
    (logits * weights * keep).sum().backward()
    return (logits * keep).detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


SIMPLE_MASKS = ("causal", "bidirectional_window")  # no documents, no prefix: not varlen_attn's (auto's choice)


@pytest.mark.parametrize(
    "core, mask",
    [(core, mask) for core in TRAINING_CORES for mask in MASKS if core != "varlen" or mask not in SIMPLE_MASKS]
    + [("flex", "prefix_lm")],  # (FlexAttention takes values of their own width; each mask compiles for ~20 s)
)
def test_every_core_equals_eager_under_every_mask(reference_flash, reference_varlen, core, mask):
    arch, fields, inputs = MASKS[mask]
    eager = mla_model(arch=arch, attention_backend="eager", **fields)
    training = core in TRAINING_CORES  # (FlexAttention has no backward pass on CPU)
    want_logits, want_grads = logits_and_grads(eager, inputs, training)
    got_logits, got_grads = logits_and_grads(with_backend(eager, core), inputs, training)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("core", ["chunked", "flash"])
def test_values_wider_than_queries_and_keys_pad_those_instead(reference_flash, core):
    """Queries and keys zero-padded to the values' 40, the queries scaled to keep 1/sqrt(24): the same function."""
    inputs = {"segment_ids": PACKED}
    eager = mla_model(attention_backend="eager", v_head_dim=40)
    want_logits, want_grads = logits_and_grads(eager, inputs)
    got_logits, got_grads = logits_and_grads(with_backend(eager, core), inputs)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    "backend, widths",
    [("chunked", (24, 24, 24)), ("auto", (24, 24, 24)), ("sdpa", (24, 24, 12)), ("flex", (24, 24, 12))],
)
def test_only_cores_without_a_value_width_of_their_own_get_padded_values(monkeypatch, backend, widths):
    """Values 12 wide beside queries/keys of nope 16 + rope 8: padded to 24 where the core takes one width."""
    seen = []

    def core(q, k, v, mask, dropout, alibi):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return torch.zeros(*q.shape[:-1], v.shape[-1])

    model = mla_model(attention_backend=backend, n_layers=1)
    monkeypatch.setattr(model.decoder.layers[0].self_attn, "core", core)
    model(torch.zeros(1, 5, dtype=torch.long))
    assert seen == [widths]


@pytest.mark.parametrize("core", ["sdpa", "chunked", "eager"])
@pytest.mark.parametrize("fields", [{}, {"attention_window": 6}, {"q_lora_rank": None}], ids=["full", "window", "q"])
def test_the_cache_holds_the_latent_and_its_logits_equal_the_uncached_ones(core, fields):
    model = mla_model(attention_backend=core, **fields)
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = model(ids)
        caches = model.new_caches(2, 20)
        # a prompt (the up-projected form), a chunk onto it and single tokens (the absorbed form)
        parts = [model(ids[:, :7], caches=caches), model(ids[:, 7:11], caches=caches)]
        parts += [model(ids[:, t : t + 1], caches=caches) for t in range(11, 20)]
    held = 5 if "attention_window" in fields else 20
    assert caches[0].k.shape == (2, 1, held, 24) and caches[0].v.shape == (2, 1, held, 8)  # latent, RoPE key
    torch.testing.assert_close(torch.cat(parts, dim=1), whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_generation_with_the_latent_cache_equals_generation_without(arch):
    model = mla_model(seed=1, arch=arch, init_std=1.0)  # (peaked, varied next-token distributions)
    prompt = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(6))
    start = {"decoder_start_id": 1} if arch == "encoder_decoder" else {}
    cached = generate(model, prompt, 24, use_cache=True, **start)
    assert torch.equal(cached, generate(model, prompt, 24, use_cache=False, **start))
    assert len(set(cached[0].tolist())) > 3  # (not one token repeated)


def test_beam_search_reorders_the_latent_cache_like_any_other():
    from megatransformer.model.beam import beam_search

    model = mla_model(seed=1, init_std=1.0)
    prompt = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(7))
    cached = beam_search(model, prompt, 10, 4, None, 0.6)
    uncached = beam_search(model, prompt, 10, 4, None, 0.6, use_cache=False)
    assert [h.tokens for h in cached] == [h.tokens for h in uncached]
    # (the absorbed and the up-projected form sum in other orders: fp32 rounding, over logits of this large init)
    assert [h.score for h in cached] == pytest.approx([h.score for h in uncached], rel=1e-4)


def test_an_encoder_decoder_keeps_standard_cross_attention():
    model = mla_model(arch="encoder_decoder")
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attn, LatentAttention) and not isinstance(layer.cross_attn, LatentAttention)
    assert isinstance(model.encoder.layers[0].self_attn, LatentAttention)


def test_tp_plan_splits_the_heads_and_keeps_the_latents_whole():
    for q_lora in (20, None):
        model = mla_model(q_lora_rank=q_lora)
        for name, _ in model.named_parameters():
            if ".self_attn." not in name:
                continue
            kind = name.split(".self_attn.")[1]
            want = {
                "q_proj.weight": 0,
                "q_b_proj.weight": 0,
                "kv_b_proj.weight": 0,
                "o_proj.weight": 1,
            }.get(kind)
            assert partition_dim(name, TP_PLAN) == want, name


def test_mla_runs_unchanged_on_a_tensor_parallel_shard():
    """Slicing the heads of q_b/kv_b/o (as AutoTP does), latent projections whole, and summing the shards'
    outputs gives the full output (with and without the cache's absorbed form)."""
    cfg = mla_config(n_heads=4)
    torch.manual_seed(0)
    attn = LatentAttention(cfg).eval()
    x = torch.randn(2, 6, 32)
    rope = build_model(cfg).decoder.rotary(torch.arange(6).expand(2, -1), torch.float32)
    full = attn(x, self_attention_mask(True), rope)
    total = torch.zeros_like(full)
    qk, kv = 24, 16 + 12
    for rank in range(2):
        shard = LatentAttention(cfg)
        shard.load_state_dict(attn.state_dict())
        heads = slice(rank * 2, rank * 2 + 2)
        shard.q_b_proj.weight.data = attn.q_b_proj.weight.view(4, qk, -1)[heads].flatten(0, 1)
        shard.kv_b_proj.weight.data = attn.kv_b_proj.weight.view(4, kv, -1)[heads].flatten(0, 1)
        shard.o_proj.weight.data = attn.o_proj.weight.view(32, 4, 12)[:, heads].flatten(1)
        total += shard(x, self_attention_mask(True), rope)
    torch.testing.assert_close(total, full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"kv_lora_rank": 0}, "model.kv_lora_rank=0 must be > 0"),
        ({"q_lora_rank": 0}, "model.q_lora_rank=0 must be > 0"),
        ({"kv_lora_rank": None}, "model.attention=mla needs model.kv_lora_rank"),
        ({"qk_rope_head_dim": 7}, "model.qk_rope_head_dim=7 must be even"),
        ({"qk_rope_head_dim": 8, "qk_nope_head_dim": None}, None),  # nope = head dim 8 - 8: refused
        ({"position": "alibi"}, "model.attention=mla needs model.position=rope"),
        ({"n_kv_heads": 2}, "model.n_kv_heads=2 with model.attention=mla"),
        ({"qk_norm": True}, "model.qk_norm=true with model.attention=mla"),
    ],
)
def test_inconsistent_latent_dimensions_are_refused_with_one_line(fields, message):
    from megatransformer.config import validate

    model = {**tiny_config().model_dump(), **MLA, "n_kv_heads": None, "d_model": 32, "n_heads": 4, **fields}
    with pytest.raises(ConfigError) as err:
        validate({"model": model})
    text = str(err.value)
    assert "\n" not in text
    if message is None:
        assert "model.qk_rope_head_dim=8 is not smaller than the head dim d_model/n_heads=8" in text
    else:
        assert message in text


def test_latent_fields_are_refused_for_standard_attention():
    with pytest.raises(Exception, match="model.kv_lora_rank is for model.attention=mla"):
        tiny_config(kv_lora_rank=16)


def test_unset_head_slices_come_from_the_head_dim():
    cfg = ModelConfig(d_model=64, n_heads=4, attention="mla", kv_lora_rank=32)
    assert (cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (8, 8, 16)
    cfg = ModelConfig(d_model=64, n_heads=4, attention="mla", kv_lora_rank=32, qk_rope_head_dim=4)
    assert cfg.qk_nope_head_dim == 12


# ------------------------------------------------------------------------------------ megatransformer info


def test_attention_costs_count_each_kinds_parameters_flops_and_cache():
    from megatransformer.flops import attention_costs, model_size

    (mla,) = attention_costs(mla_config(n_layers=2), seq_len=16)
    assert mla.kind == "self (mla)" and mla.layers == 2
    assert mla.kv_cache_values_per_token == 2 * (24 + 8)  # the latent and the RoPE key, per layer
    one = LatentAttention(mla_config())
    assert mla.params == 2 * sum(p.numel() for p in one.parameters())
    linear = sum(p.numel() for name, p in one.named_parameters() if name.endswith("proj.weight"))
    assert mla.flops_per_token == 2 * (6 * linear + 3 * 2 * 16 * 4 * (16 + 8 + 12))  # heads x (nope + rope + v)

    (standard,) = attention_costs(tiny_config(), seq_len=16)
    assert standard.kind == "self (standard)" and standard.kv_cache_values_per_token == 2 * 2 * 2 * 8  # k, v
    assert model_size(tiny_config(), 16).flops_per_token > standard.flops_per_token

    assert attention_costs(mla_config(arch="encoder"))[0].kv_cache_values_per_token is None
    kinds = [cost.kind for cost in attention_costs(mla_config(arch="encoder_decoder"))]
    assert kinds == ["self (mla)", "cross (standard)"]


def test_the_run_log_judges_the_gpu_cores_by_the_width_they_see(monkeypatch):
    from megatransformer.model import attention
    from megatransformer.model.latent_attention import core_head_dim, describe_value_width

    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    for v_head_dim, core in ((12, "flash"), (28, "sdpa")):  # padded to 24, or queries/keys to 28 (not a multiple of 8)
        cfg = mla_config(v_head_dim=v_head_dim)
        line = attention.describe_backend("auto", "cuda", torch.bfloat16, 0.0, core_head_dim(cfg))
        assert line.startswith(f"attention: auto -> {core} for every mask"), line
    assert "queries/keys zero-padded to 28 for auto" in describe_value_width(mla_config(v_head_dim=28))
