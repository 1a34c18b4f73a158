"""Sliding-window attention (model.attention_window): every core equals the eager reference, packed and
unpacked, with and without GQA; the chunked core touches only the keys inside the window; flash-attn's
``window_size`` is checked on tests/support/flash_reference.py here and on the real kernel on GPUs."""

from __future__ import annotations

import pytest
import torch
from support import attention as attention_support
from support.attention import flat, qkv

from megatransformer.batch import PAD_SEGMENT
from megatransformer.config import ConfigError, ModelConfig, load_config
from megatransformer.flops import model_size
from megatransformer.model import attention, build_model, chunked_attention
from megatransformer.model.attention import BACKENDS, KVCache, eager_core
from megatransformer.model.beam import beam_search
from megatransformer.model.generate import generate
from megatransformer.model.masks import AttentionMask, self_attention_mask
from megatransformer.model.positions import Alibi, alibi_slopes

B, H, T, D, WINDOW = 2, 4, 19, 8, 5
PACKED = torch.tensor([[1] * 7 + [2] * 5 + [3] * 4 + [0] * 3, [1] * 10 + [2] * 9])
MASKS = {  # name: (mask, query length, key length)
    "causal": lambda: (self_attention_mask(True), T, T),
    "bidirectional": lambda: (self_attention_mask(False), T, T),
    "packed_causal": lambda: (self_attention_mask(True, PACKED), T, T),
    "packed_bidirectional": lambda: (self_attention_mask(False, PACKED), T, T),
    "cached_prefill": lambda: (self_attention_mask(True, q_offset=9), 6, 15),
    "cached_decode": lambda: (self_attention_mask(True, q_offset=14), 1, 15),
}


def values_and_grads(core, q, k, v, mask: AttentionMask, *alibi: Alibi):
    """Outputs and q/k/v gradients at the queries that carry loss (padding queries' outputs are free)."""
    return attention_support.values_and_grads(core, q, k, v, mask, *alibi, weight_seed=5)


def assert_close(got, want, atol=2e-6, grad_atol=None):
    """values_and_grads' results alike: outputs within ``atol``, gradients within ``grad_atol`` (or ``atol``)."""
    for name, a, b in zip(("out", "dq", "dk", "dv"), flat(got), flat(want)):
        tolerance = atol if name == "out" or grad_atol is None else grad_atol
        assert torch.allclose(a.float(), b.float(), atol=tolerance), (name, (a.float() - b.float()).abs().max())


def test_the_window_is_mistrals_for_causal_and_symmetric_for_bidirectional_masks():
    i, j = torch.arange(T).view(-1, 1), torch.arange(T).view(1, -1)
    causal = self_attention_mask(True).with_window(WINDOW).dense(T, T, torch.device("cpu"))[0, 0]
    assert torch.equal(causal, (i - WINDOW < j) & (j <= i))
    both = self_attention_mask(False).with_window(WINDOW).dense(T, T, torch.device("cpu"))[0, 0]
    assert torch.equal(both, (i - j).abs() < WINDOW)
    packed = self_attention_mask(True, PACKED).with_window(WINDOW).dense(T, T, torch.device("cpu"))[1, 0]
    same_document = PACKED[1].view(-1, 1) == PACKED[1].view(1, -1)
    assert torch.equal(packed, causal & same_document)


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "flash"])
@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("kv_heads", [H, 2])
def test_every_core_equals_eager_with_a_window(reference_flash, backend, name, kv_heads):
    mask, q_len, k_len = MASKS[name]()
    mask = mask.with_window(WINDOW)
    q, k, v = qkv(q_len, k_len, kv_heads=kv_heads)
    assert_close(values_and_grads(BACKENDS[backend], q, k, v, mask), values_and_grads(eager_core, q, k, v, mask))


@pytest.mark.parametrize("backend", ["sdpa", "chunked", "flash"])
@pytest.mark.parametrize("name", ["causal", "packed_bidirectional", "cached_prefill"])
def test_every_core_equals_eager_with_a_window_and_alibi(reference_flash, backend, name):
    mask, q_len, k_len = MASKS[name]()
    mask = mask.with_window(WINDOW)
    positions = torch.arange(k_len).expand(B, -1)
    alibi = Alibi(alibi_slopes(H), positions[:, k_len - q_len :], positions)
    q, k, v = qkv(q_len, k_len, kv_heads=2)
    assert_close(
        values_and_grads(BACKENDS[backend], q, k, v, mask, alibi),
        values_and_grads(eager_core, q, k, v, mask, alibi),
        atol=1e-5,
    )


@pytest.mark.parametrize("name", ["causal", "packed_bidirectional", "cached_prefill"])
def test_flex_equals_eager_with_a_window(name):
    """Forward only: FlexAttention has no backward pass on CPU."""
    mask, q_len, k_len = MASKS[name]()
    mask = mask.with_window(WINDOW)
    q, k, v = (t.detach() for t in qkv(q_len, k_len, kv_heads=2))
    keep = 1 if mask.q_segments is None else (mask.q_segments != PAD_SEGMENT).view(B, 1, -1, 1)
    got, want = (BACKENDS[core](q, k, v, mask, 0.0) * keep for core in ("flex", "eager"))
    assert torch.allclose(got, want, atol=2e-6), (got - want).abs().max()


@pytest.mark.parametrize("causal", [True, False])
def test_the_chunked_core_computes_scores_only_inside_the_window(monkeypatch, causal):
    """Each chunk of 16 queries meets at most 16 + window - 1 keys (both ways for bidirectional masks), so
    time and memory grow with length x window, not length squared."""
    seen = []
    scores = chunked_attention._scores

    def spy(q_rows, keys, *args):
        seen.append(keys.shape[1])
        return scores(q_rows, keys, *args)

    monkeypatch.setattr(chunked_attention, "_scores", spy)
    length, window, chunk = 256, 8, 16
    mask = self_attention_mask(causal).with_window(window)
    q, k, v = qkv(length, length, kv_heads=2)
    got = chunked_attention.chunked_core(q, k, v, mask, 0.0, chunk=chunk)
    got.sum().backward()
    assert max(seen) == chunk + (window - 1) * (1 if causal else 2)
    assert len(seen) == 2 * length // chunk  # forward and backward
    assert torch.allclose(got, eager_core(q, k, v, mask, 0.0), atol=2e-6)


def test_a_window_does_not_combine_with_a_prefix():
    with pytest.raises(ValueError, match="attention_window does not combine with a bidirectional prefix"):
        self_attention_mask(True, prefix_len=torch.tensor([3, 4])).with_window(WINDOW)
    with pytest.raises(ConfigError, match="model.attention_window does not combine with objective=prefix_lm"):
        load_config(None, ["objective=prefix_lm", "model.attention_window=64"])


# ----------------------------------------------------------------------------------------- the model


def small(arch: str, backend: str, window: int | None = WINDOW, kv_heads: int = 2, **options) -> ModelConfig:
    return ModelConfig(
        **options,
        arch=arch,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=kv_heads,
        d_ff=64,
        vocab_size=64,
        max_seq_len=32,
        attention_window=window,
        attention_backend=backend,
    )


def same_model(cfg: ModelConfig, reference: torch.nn.Module) -> torch.nn.Module:
    model = build_model(cfg).eval()
    model.load_state_dict(reference.state_dict())
    return model


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
@pytest.mark.parametrize("backend", ["sdpa", "chunked", "flash"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_windowed_models_equal_eager_packed_and_unpacked(reference_flash, arch, backend, kv_heads):
    torch.manual_seed(0)
    eager = build_model(small(arch, "eager", kv_heads=kv_heads)).eval()
    model = same_model(small(arch, backend, kv_heads=kv_heads), eager)
    ids = torch.randint(0, 64, (B, T))
    positions = torch.cat([torch.arange(n) for n in (7, 5, 4, 3, 10, 9)]).view(B, T)
    batches = [{"input_ids": ids}, {"input_ids": ids, "segment_ids": PACKED, "position_ids": positions}]
    if arch == "encoder_decoder":
        for batch in batches:
            batch["decoder_input_ids"] = ids.flip(1)
        batches[1].update(decoder_segment_ids=PACKED, decoder_position_ids=positions)
    with torch.no_grad():
        for batch in batches:
            want, got = eager(**batch), model(**batch)
            if "segment_ids" in batch:
                keep = (PACKED != PAD_SEGMENT).unsqueeze(-1)
                want, got = want * keep, got * keep
            assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_a_window_changes_the_model_only_beyond_its_width():
    torch.manual_seed(0)
    unwindowed = build_model(small("decoder", "chunked", window=None)).eval()
    windowed = same_model(small("decoder", "chunked"), unwindowed)
    ids = torch.randint(0, 64, (B, T))
    with torch.no_grad():
        full, local = unwindowed(ids), windowed(ids)
    assert torch.allclose(full[:, :WINDOW], local[:, :WINDOW], atol=1e-6)
    assert not torch.allclose(full[:, WINDOW:], local[:, WINDOW:], atol=1e-3)


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
def test_generation_with_a_kv_cache_equals_generation_without(backend):
    torch.manual_seed(0)
    model = build_model(small("decoder", backend)).eval()
    prompt = torch.randint(0, 64, (B, 7))
    cached = generate(model, prompt, 12, use_cache=True)
    assert torch.equal(cached, generate(model, prompt, 12, use_cache=False))


def recorded_caches(model: torch.nn.Module) -> list[list[KVCache]]:
    """The caches the model makes from now on, as it makes them."""
    made, make = [], model.new_caches

    def recording(*args):
        made.append(make(*args))
        return made[-1]

    model.new_caches = recording
    return made


@pytest.mark.parametrize(
    "arch, position, backend",
    [
        ("decoder", "rope", "chunked"),
        ("decoder", "rope", "sdpa"),
        ("decoder", "rope", "eager"),
        ("decoder", "alibi", "chunked"),
        ("decoder", "learned", "chunked"),
        ("encoder_decoder", "sinusoidal", "chunked"),
    ],
)
def test_a_windowed_kv_cache_holds_only_the_window_and_gives_the_logits_of_the_whole_sequence(arch, position, backend):
    """Decoding past the window one token at a time: the cache keeps window - 1 keys per layer, positions go
    on counting from the start, and every step's logits are those of one forward over the whole sequence."""
    torch.manual_seed(0)
    model = build_model(small(arch, backend, position=position)).eval()
    ids = torch.randint(0, 64, (B, 26))
    caches = model.new_caches(B, 26)

    def forward(part: torch.Tensor, **kwargs) -> torch.Tensor:  # (an encoder-decoder decodes ids after ids)
        return model.decode(part, model.encode(ids), **kwargs) if arch == "encoder_decoder" else model(part, **kwargs)

    with torch.no_grad():
        whole = forward(ids)
        steps = [forward(ids[:, :7], caches=caches)] + [forward(ids[:, t : t + 1], caches=caches) for t in range(7, 26)]
    assert torch.allclose(torch.cat(steps, 1), whole, atol=1e-5)
    assert all(cache.k.shape[2] == cache.length == WINDOW - 1 and cache.seen == 26 for cache in caches)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_sampling_and_beams_with_a_windowed_cache_decode_as_without_a_cache(arch):
    torch.manual_seed(0)
    model = build_model(small(arch, "chunked")).eval()
    made = recorded_caches(model)
    prompt, new = torch.randint(0, 64, (B, 7)), 20
    start = {"decoder_start_id": 1} if arch == "encoder_decoder" else {}

    def sampled(use_cache: bool) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        return generate(model, prompt, new, temperature=1.0, generator=generator, use_cache=use_cache, **start)

    assert torch.equal(sampled(True), sampled(False))
    assert all(cache.k.shape[2] == WINDOW - 1 for cache in made[0])
    beams = [beam_search(model, prompt, 12, 3, None, use_cache=use, **start) for use in (True, False)]
    assert [h.tokens for h in beams[0]] == [h.tokens for h in beams[1]]


def test_a_window_wider_than_the_generation_keeps_a_plain_cache():
    model = build_model(small("decoder", "chunked", window=30)).eval()
    made = recorded_caches(model)
    generate(model, torch.randint(0, 64, (B, 7)), 12)
    assert all(cache.window is None and cache.k.shape[2] == 19 for cache in made[0])


# ------------------------------------------------------------------------------ the real kernel (GPU)

gpu = pytest.mark.gpu
needs_flash = pytest.mark.skipif(
    not torch.cuda.is_available() or attention.flash_attn_module() is None,
    reason="needs CUDA and the flash-attn package (pip install flash-attn --no-build-isolation); CPU machines check "
    "window_size against tests/support/flash_reference.py",
)


@gpu
@needs_flash
@pytest.mark.parametrize("name", MASKS)
def test_real_flash_attn_window_equals_eager(name):
    mask, q_len, k_len = MASKS[name]()
    mask = mask.with_window(WINDOW).to("cuda")
    q, k, v = qkv(q_len, k_len, kv_heads=2, device="cuda", dtype=torch.bfloat16)
    flash = values_and_grads(attention.flash_core, q, k, v, mask)
    eager = values_and_grads(eager_core, *(t.detach().float().requires_grad_() for t in (q, k, v)), mask)
    assert_close(flash, eager, atol=2e-2, grad_atol=5e-2)


def test_flops_count_the_keys_inside_the_window():
    for arch, keys in (("decoder", WINDOW), ("encoder", 2 * WINDOW - 1)):
        full, local = (model_size(small(arch, "auto", window), 64).flops_per_token for window in (None, WINDOW))
        assert full - local == pytest.approx(3 * 4 * (64 - keys) * 32 * 2)  # d_model 32, 2 layers
