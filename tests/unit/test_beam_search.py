"""Beam search: equal to greedy with one beam, exact on a search space small enough to enumerate, the same
with and without the KV cache, and token for token transformers' beam search under its length penalty."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from support.models import llama_model, tiny_config

from megatransformer.model import build_model, generate
from megatransformer.model.beam import beam_search, length_penalty

START = 0  # decoder start token of the encoder-decoder models here


def tiny(arch: str, vocab: int = 64, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random model with peaked next-token distributions (large init), so the search has real choices."""
    cfg = tiny_config(arch=arch, n_kv_heads=None, d_ff=64, vocab_size=vocab, init_std=0.3, **overrides)
    torch.manual_seed(seed)
    return build_model(cfg).eval()


def prompts(vocab: int, rows: int = 2, length: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


def common_eos(model, ids: torch.Tensor) -> int:
    """A token greedy decoding emits after a few steps: as EOS it makes hypotheses finish mid-search."""
    return int(generate(model, ids[:1], 4, decoder_start_id=START)[0, 3])


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("form", ["gnmt", "hf"])
def test_one_beam_is_greedy(arch, form):
    model = tiny(arch)
    ids = prompts(64)
    eos = common_eos(model, ids)
    greedy = generate(model, ids, 12, eos_id=eos, decoder_start_id=START).tolist()
    for row, hyp in zip(greedy, beam_search(model, ids, 12, 1, eos, 0.6, form, decoder_start_id=START)):
        expected = row[: row.index(eos) + 1] if eos in row else row
        assert hyp.tokens == expected


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("position", ["rope", "alibi"])  # ALiBi: its bias reads the cached key positions
def test_cached_beam_search_equals_uncached(arch, position):
    model = tiny(arch, position=position)
    ids = prompts(64, rows=3)
    eos = common_eos(model, ids)
    cached = beam_search(model, ids, 10, 4, eos, 0.6, decoder_start_id=START)
    uncached = beam_search(model, ids, 10, 4, eos, 0.6, decoder_start_id=START, use_cache=False)
    assert [h.tokens for h in cached] == [h.tokens for h in uncached]
    assert [h.score for h in cached] == pytest.approx([h.score for h in uncached], abs=1e-5)
    assert len({tuple(h.tokens) for h in cached}) > 1  # the rows of the batch are searched apart


def sequence_log_prob(model, prompt: torch.Tensor, tokens: list[int], arch: str) -> float:
    """Summed log-probability of ``tokens`` after ``prompt``, from one uncached forward."""
    target = torch.tensor([tokens])
    if arch == "decoder":
        logits = model(torch.cat([prompt[None], target], dim=1))[0, prompt.shape[0] - 1 : -1]
    else:
        logits = model(prompt[None], torch.tensor([[START] + tokens[:-1]]))[0]
    return logits.float().log_softmax(-1).gather(-1, target[0, :, None]).sum().item()


VOCAB, STEPS, EOS = 5, 3, 4  # the exhaustive search's space
PROMPT = torch.tensor([1, 2, 3, 1])


@functools.cache
def every_sequence(arch: str) -> tuple[torch.nn.Module, dict[tuple[int, ...], float]]:
    """A model of vocabulary 5 and every sequence of at most 3 new tokens it may return (ended by EOS, or cut
    at the limit) with its summed log-probability, by brute force (once per arch: the length penalties below
    divide the same sums)."""
    model = tiny(arch, vocab=VOCAB, seed=3)
    candidates = [list(seq) + [EOS] for n in range(STEPS) for seq in itertools.product(range(VOCAB - 1), repeat=n)]
    candidates += [list(seq) for seq in itertools.product(range(VOCAB), repeat=STEPS) if EOS not in seq[:-1]]
    return model, {tuple(c): sequence_log_prob(model, PROMPT, c, arch) for c in candidates}


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("form,alpha", [("gnmt", 0.6), ("gnmt", 2.0), ("hf", 1.0), ("hf", 0.0), ("hf", -1.0)])
def test_enough_beams_find_the_best_sequence_of_all(arch, form, alpha):
    """Every sequence scored by brute force under the length penalty; beam search with as many beams as there
    are sequences returns the best one."""
    model, log_probs = every_sequence(arch)
    scored = {c: log_prob / length_penalty(len(c), alpha, form) for c, log_prob in log_probs.items()}
    best = max(scored, key=scored.get)
    runner_up = sorted(scored.values())[-2]
    assert scored[best] - runner_up > 1e-4  # a unique optimum: the comparison below means something
    hyp = beam_search(model, PROMPT[None], STEPS, len(scored), EOS, alpha, form, decoder_start_id=START)[0]
    assert tuple(hyp.tokens) == best
    assert hyp.score == pytest.approx(scored[best], abs=1e-5)
    # the exhaustive beam scores at least what a single beam finds
    narrow = beam_search(model, PROMPT[None], STEPS, 1, EOS, alpha, form, decoder_start_id=START)[0]
    assert narrow.score <= hyp.score + 1e-6


def test_length_penalty_forms():
    assert length_penalty(7, 0.6, "gnmt") == pytest.approx((12 / 6) ** 0.6)
    assert length_penalty(7, 1.0, "hf") == 7.0
    with pytest.raises(ValueError, match="gnmt"):
        length_penalty(3, 1.0, "fairseq")


# ------------------------------------------------------------------------------ parity with transformers

transformers = pytest.importorskip("transformers")


def transformers_beam(theirs, ids: torch.Tensor, eos: int, max_new_tokens: int, alpha: float) -> list[list[int]]:
    out = theirs.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        num_beams=4,
        length_penalty=alpha,
        early_stopping=True,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=eos,
    )[:, ids.shape[1] :]
    return [row[: row.index(eos) + 1] if eos in row else row for row in out.tolist()]


@pytest.mark.parametrize("alpha", [1.0, 0.0, 2.0])
def test_beam_search_equals_transformers(alpha):
    """Rows of a batch searched together, as transformers does; EOS is a token the model likes, so that
    hypotheses finish at different steps and the finishing rules decide."""
    _, ours, theirs = llama_model()
    finished_early = 0
    for seed in range(4):
        ids = prompts(512, rows=3, length=6, seed=seed)
        eos = int(generate(ours, ids[:1], 3)[0, 2])
        expected = transformers_beam(theirs, ids, eos, 12, alpha)
        got = [h.tokens for h in beam_search(ours, ids, 12, 4, eos, alpha, "hf")]
        assert got == expected, seed
        finished_early += sum(eos in row for row in got)
    assert finished_early >= 1  # the finishing rules were exercised, not only the length limit


def test_beam_decode_batches_sources_of_equal_length(tiny_data):
    """``eval --bleu`` decodes sources of equal length together: the same translations as one at a time."""
    from data_pipeline.settings import DataSettings
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.config import RunConfig
    from megatransformer.inference import Loaded, beam_decode

    model = tiny("encoder_decoder", vocab=512)
    cfg = RunConfig(model=model.config, data=DataSettings(seq_len=32), objective="prefix_lm")
    loaded = Loaded(cfg, model, load_tokenizer(tiny_data.tokenizer), tiny_data.tokenizer)
    sources = [row.tolist() for row in prompts(512, rows=5, length=4)] + [[7, 8], [9, 10], [11, 12, 13]]
    together = beam_decode(loaded, sources, 3, 0.6, "gnmt", max_new_tokens=10, batch_size=8)
    alone = [beam_decode(loaded, [s], 3, 0.6, "gnmt", max_new_tokens=10)[0] for s in sources]
    assert together == alone
    assert len({tuple(t) for t in together}) > 1
