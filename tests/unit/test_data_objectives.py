"""Objectives (batch builders): statistics on large batches, masks, sentinels, prefix/suffix loss masking,
short documents, and the loader's packing for each of them."""

from __future__ import annotations

import numpy as np
import pytest

from data_pipeline import DataError
from data_pipeline.objectives import (
    MaskedLM,
    PrefixLM,
    Seq2SeqPrefixLM,
    SpanCorruption,
    Window,
    build_objective,
    span_lengths,
)
from data_pipeline.settings import ObjectiveArgs
from megatransformer.batch import IGNORE_INDEX, MODEL_INPUT_KEYS
from megatransformer.config import validate
from megatransformer.training.data import build_run_loader as build_loader


def normal_tokens(tok, n, rng):
    ids = np.array(sorted(set(range(tok.vocab_size)) - tok.special_ids))
    return rng.choice(ids, size=n)


def one_doc(tokens):
    return Window(np.asarray(tokens, dtype=np.int64), np.ones(len(tokens), dtype=np.int64))


def loader_batches(tiny_data, tok, objective, arch, n=6, seq_len=64, **data):
    raw = {
        "model": {"arch": arch, "vocab_size": 512, "max_seq_len": 256, "d_model": 32, "n_heads": 2},
        "data": {"train": str(tiny_data.shards), "tokenizer": str(tiny_data.tokenizer), "seq_len": seq_len, **data},
        "objective": objective,
    }
    out = []
    for batch in build_loader(validate(raw), "valid", 8, 0, 1, tok):
        out.append({k: v.numpy() for k, v in batch.items()})
        if len(out) == n:
            break
    return out


# ------------------------------------------------------------------------------------ masked LM


def test_masked_lm_rates_on_a_large_batch(tok):
    rng = np.random.default_rng(0)
    objective = MaskedLM(512, tok, True, ObjectiveArgs())
    tokens = normal_tokens(tok, 512, rng)
    tokens[::50] = tok.eos_id  # specials are never selected
    selected = masked = random = kept = candidates = 0
    for i in range(100):
        s = objective.build(Window(tokens, np.ones(512, dtype=np.int64)), np.random.default_rng(i))
        sel = s["labels"] != IGNORE_INDEX
        assert not sel[tokens == tok.eos_id].any()
        assert (s["labels"][sel] == tokens[sel]).all()
        assert (s["input_ids"][~sel] == tokens[~sel]).all()  # only selected positions change
        candidates += (tokens != tok.eos_id).sum()
        selected += sel.sum()
        masked += (s["input_ids"][sel] == tok.mask_id).sum()
        kept += (s["input_ids"][sel] == tokens[sel]).sum()
        changed = sel & (s["input_ids"] != tok.mask_id) & (s["input_ids"] != tokens)
        random += changed.sum()
        assert not np.isin(s["input_ids"][changed], list(tok.special_ids)).any()
    assert abs(selected / candidates - 0.15) < 0.01
    assert abs(masked / selected - 0.8) < 0.02
    # a random replacement can draw the original token (1 / vocab): it then counts as kept
    assert abs(random / selected - 0.1) < 0.015
    assert abs(kept / selected - 0.1) < 0.015


def test_masked_lm_rates_are_configurable(tok):
    args = ObjectiveArgs(mask_prob=0.3, mask_token_prob=0.5, random_token_prob=0.5)
    objective = MaskedLM(1000, tok, True, args)
    tokens = normal_tokens(tok, 1000, np.random.default_rng(1))
    s = objective.build(one_doc(tokens), np.random.default_rng(2))
    sel = s["labels"] != IGNORE_INDEX
    assert abs(sel.mean() - 0.3) < 0.04
    assert abs((s["input_ids"][sel] == tok.mask_id).mean() - 0.5) < 0.08
    assert (s["input_ids"][sel] == tokens[sel]).mean() < 0.05  # no "keep" share left


def test_masked_lm_short_document_and_padding(tok):
    objective = MaskedLM(16, tok, False, ObjectiveArgs())
    s = objective.build(one_doc([300, 301, tok.eos_id]), np.random.default_rng(0))
    assert s["input_ids"].shape == (16,) and (s["segment_ids"][3:] == 0).all()
    assert (s["labels"] != IGNORE_INDEX).sum() >= 1  # never an empty target
    assert (s["labels"][3:] == IGNORE_INDEX).all() and (s["input_ids"][3:] == tok.pad_id).all()


def test_masked_lm_needs_a_mask_token(tok):
    no_mask = type(tok)(**{**tok.__dict__, "mask_id": None})
    with pytest.raises(DataError, match="no mask token"):
        MaskedLM(16, no_mask, True, ObjectiveArgs())


def test_masked_lm_through_the_loader(tiny_data, tok):
    for b in loader_batches(tiny_data, tok, "masked_lm", "encoder"):
        assert set(b) == {"input_ids", "labels", "segment_ids", "position_ids"}
        assert b["input_ids"].shape == b["labels"].shape == (8, 64)
        assert (b["segment_ids"] > 0).all()  # packed: no padding


# ------------------------------------------------------------------------------------ prefix LM


def test_prefix_lm_decoder_masks_the_prefix(tok):
    args = ObjectiveArgs(prefix_min=0.2, prefix_max=0.6)
    objective = PrefixLM(32, tok, True, args)
    tokens = normal_tokens(tok, 33, np.random.default_rng(0))
    seen = set()
    for i in range(200):
        s = objective.build(one_doc(tokens), np.random.default_rng(i))
        p = int(s["prefix_len"][0])
        assert (s["prefix_len"] == p).all()  # one prefix for the whole row
        seen.add(p)
        assert round(0.2 * 32) <= p <= round(0.6 * 32)
        assert (s["labels"][: p - 1] == IGNORE_INDEX).all()
        assert (s["labels"][p - 1 :] == tokens[p:]).all()  # the suffix, shifted: no loss on the prefix
        assert (s["input_ids"] == tokens[:-1]).all()
    assert len(seen) > 10


def test_prefix_lm_decoder_short_document(tok):
    s = PrefixLM(16, tok, False, ObjectiveArgs()).build(one_doc([300, 301, tok.eos_id]), np.random.default_rng(0))
    assert (s["prefix_len"] == 1).all()
    assert list(s["labels"][:2]) == [301, tok.eos_id] and (s["labels"][2:] == IGNORE_INDEX).all()
    assert (s["segment_ids"] == [1, 1] + [0] * 14).all()


@pytest.mark.parametrize("pack", [True, False])
def test_prefix_lm_decoder_through_the_loader(tiny_data, tok, pack):
    batches = loader_batches(tiny_data, tok, "prefix_lm", "decoder", pack=pack)
    for b in batches:
        assert b["prefix_len"].shape == (8, 64)
        assert set(b) >= {"input_ids", "labels", "prefix_len", "segment_ids", "position_ids"}
        for row in range(8):
            p, labels, ids, seg = b["prefix_len"][row, 0], b["labels"][row], b["input_ids"][row], b["segment_ids"][row]
            assert (b["prefix_len"][row] == p).all()
            assert (labels[: p - 1] == IGNORE_INDEX).all()
            same = (seg[1:] == seg[:-1]) & (seg[1:] > 0)
            after = np.arange(63) >= p - 1
            assert (labels[:-1][same & after] == ids[1:][same & after]).all()  # loss on every suffix token
            across = (seg[1:] != seg[:-1]) & (seg[1:] > 0) & (seg[:-1] > 0)
            assert (labels[:-1][across] == IGNORE_INDEX).all() and (labels[seg == 0] == IGNORE_INDEX).all()
        if pack:
            assert (b["segment_ids"] > 0).all()
        else:
            assert set(np.unique(b["segment_ids"])) <= {0, 1}


def test_prefix_lm_encoder_decoder_reassembles_the_piece(tiny_data, tok):
    for b in loader_batches(tiny_data, tok, "prefix_lm", "encoder_decoder"):
        assert_aligned_segments(b, tok, start=tok.bos_id)
        for row in range(8):
            for k in range(1, b["segment_ids"][row].max() + 1):
                source = b["input_ids"][row][b["segment_ids"][row] == k]
                target = b["labels"][row][b["decoder_segment_ids"][row] == k]
                assert len(source) >= 1 and len(target) >= 1
                text = tok.decode(np.r_[source, target])
                assert text and "<pad>" not in text


# ------------------------------------------------------------------------------------ span corruption


def reconstruct(source, target, sentinels: list[int], eos: int) -> list[int]:
    """Put the target's spans back at their sentinels in the source."""
    assert source[-1] == eos and target[-1] == eos
    spans, current = {}, None
    for t in target[:-1]:
        if t in sentinels:
            current = t
            spans[current] = []
        else:
            spans[current].append(t)
    out = []
    for t in source[:-1]:
        out.extend(spans[t] if t in sentinels else [t])
    return out


def test_span_corruption_sentinels_and_reconstruction(tok):
    objective = SpanCorruption(128, tok, True, ObjectiveArgs())
    n = objective.window
    tokens = normal_tokens(tok, n, np.random.default_rng(0))
    noise_total = spans_total = 0
    for i in range(200):
        source, target = objective.example(tokens, np.random.default_rng(i))
        assert len(source) <= 128 and len(target) == objective.target_len
        used = [t for t in source if t in tok.sentinel_ids]
        assert used == tok.sentinel_ids[: len(used)]  # unique, in order
        assert [t for t in target if t in tok.sentinel_ids] == used
        assert target[0] == tok.sentinel_ids[0]
        assert reconstruct(list(source), list(target), tok.sentinel_ids, tok.eos_id) == list(tokens)
        noise_total += len(target) - 1 - len(used)
        spans_total += len(used)
    assert abs(noise_total / (200 * n) - 0.15) < 0.01
    assert abs(noise_total / spans_total - 3.0) < 0.2


def test_span_corruption_lengths_fill_the_input(tok):
    for seq_len in (64, 512, 568):
        objective = SpanCorruption(seq_len, tok, True, ObjectiveArgs())
        src, tgt = objective.cost(objective.window)
        assert src == seq_len or objective.cost(objective.window + 1)[0] > seq_len
        assert src <= seq_len and tgt == objective.target_len
    t5 = SpanCorruption(512, tok, True, ObjectiveArgs())  # T5's numbers: 568 raw tokens -> 512 in, 114 out
    assert (t5.window, t5.target_len) == (568, 114)


def test_span_corruption_short_documents(tok):
    objective = SpanCorruption(64, tok, True, ObjectiveArgs())
    for n in (2, 3, 5, 9):
        tokens = normal_tokens(tok, n, np.random.default_rng(n))
        source, target = objective.example(tokens, np.random.default_rng(0))
        assert len(target) >= 3  # a sentinel, at least one noise token, EOS
        assert reconstruct(list(source), list(target), tok.sentinel_ids, tok.eos_id) == list(tokens)
        assert span_lengths(n, 0.15, 3.0)[0] < n  # never all noise


def test_span_corruption_needs_enough_sentinels(tok):
    few = type(tok)(**{**tok.__dict__, "sentinel_ids": tok.sentinel_ids[:3]})
    with pytest.raises(DataError, match="sentinel tokens"):
        SpanCorruption(512, few, True, ObjectiveArgs())


def assert_aligned_segments(b, tok, start):
    """Example k of a row is segment k on both sides; decoder inputs are the targets shifted right."""
    for row in range(b["input_ids"].shape[0]):
        enc, dec = b["segment_ids"][row], b["decoder_segment_ids"][row]
        assert set(enc[enc > 0]) == set(dec[dec > 0]) == set(range(1, enc.max() + 1))
        for k in range(1, enc.max() + 1):
            assert (b["position_ids"][row][enc == k] == np.arange((enc == k).sum())).all()
            assert (b["decoder_position_ids"][row][dec == k] == np.arange((dec == k).sum())).all()
            labels, inputs = b["labels"][row][dec == k], b["decoder_input_ids"][row][dec == k]
            assert inputs[0] == start and (inputs[1:] == labels[:-1]).all()
        assert (b["labels"][row][dec == 0] == IGNORE_INDEX).all()


def test_span_corruption_through_the_loader_keeps_every_token(tiny_data, tok):
    """Packed examples reassemble into the validation documents, in order: nothing truncated or lost
    (apart from one-token document tails, too short to corrupt)."""
    from data_pipeline.documents import read_documents

    docs = [d.text for i, d in enumerate(read_documents([str(tiny_data.corpus)])) if i % 10 == 9]
    stream = [t for d in docs for t in tok.encode(d)]
    batches = loader_batches(tiny_data, tok, "span_corruption", "encoder_decoder", n=10)
    rebuilt = []
    for b in batches:
        assert (
            b["input_ids"].shape == (8, 64)
            and b["labels"].shape[1] == SpanCorruption(64, tok, True, ObjectiveArgs()).target_len
        )
        assert_aligned_segments(b, tok, start=tok.pad_id)
        for row in range(8):
            enc, dec = b["segment_ids"][row], b["decoder_segment_ids"][row]
            for k in range(1, enc.max() + 1):
                rebuilt += reconstruct(
                    list(b["input_ids"][row][enc == k]), list(b["labels"][row][dec == k]), tok.sentinel_ids, tok.eos_id
                )
    pos = 0
    for t in rebuilt:  # rebuilt is the document stream with at most single-token gaps
        skip = 0
        while stream[pos] != t:
            pos, skip = pos + 1, skip + 1
        assert skip <= 1
        pos += 1
    assert len(rebuilt) > 0.97 * pos
    padding = np.mean([(b["segment_ids"] == 0).mean() for b in batches])
    assert padding < 0.1


# ------------------------------------------------------------------------------------ every objective


@pytest.mark.parametrize(
    "objective,arch",
    [
        ("autoregressive", "decoder"),
        ("masked_lm", "encoder"),
        ("prefix_lm", "decoder"),
        ("prefix_lm", "encoder_decoder"),
        ("span_corruption", "encoder_decoder"),
    ],
)
@pytest.mark.parametrize("pack", [True, False])
def test_every_objective_has_loss_in_every_row_and_model_keys(tiny_data, tok, objective, arch, pack):
    batches = loader_batches(tiny_data, tok, objective, arch, n=3, seq_len=32, pack=pack)
    for b in batches:
        assert set(b) - {"labels"} <= set(MODEL_INPUT_KEYS)
        assert ((b["labels"] != IGNORE_INDEX).sum(axis=1) > 0).all()
        assert all(v.dtype == np.int64 for v in b.values())
        assert b["input_ids"].max() < tok.vocab_size


def test_unpacked_rows_hold_one_document(tiny_data, tok):
    for b in loader_batches(tiny_data, tok, "autoregressive", "decoder", pack=False):
        assert set(np.unique(b["segment_ids"])) <= {0, 1}
    for b in loader_batches(tiny_data, tok, "span_corruption", "encoder_decoder", pack=False):
        assert b["segment_ids"].max() == 1


def test_build_objective_rejects_unknown(tok):
    with pytest.raises(DataError, match="unknown objective"):
        build_objective("nope", "decoder", 16, True, tok, ObjectiveArgs())
    assert isinstance(build_objective("prefix_lm", "encoder_decoder", 16, True, tok, ObjectiveArgs()), Seq2SeqPrefixLM)


@pytest.mark.parametrize(
    "objective,arch",
    [
        ("autoregressive", "decoder"),
        ("masked_lm", "encoder"),
        ("prefix_lm", "decoder"),
        ("prefix_lm", "encoder_decoder"),
        ("span_corruption", "encoder_decoder"),
    ],
)
def test_batches_feed_the_model(tiny_data, tok, objective, arch):
    """The batch contract end to end: the model takes every key but labels; the loss is finite."""
    import torch

    from megatransformer.model import build_model

    cfg = validate(
        {
            "model": {
                "arch": arch,
                "vocab_size": 512,
                "max_seq_len": 64,
                "d_model": 32,
                "n_heads": 2,
                "n_layers": 1,
                "d_ff": 64,
            },
            "data": {"train": str(tiny_data.shards), "tokenizer": str(tiny_data.tokenizer), "seq_len": 32},
            "objective": objective,
        }
    )
    batch = next(iter(build_loader(cfg, "train", 2, 0, 1, tok)))
    labels = batch.pop("labels")
    logits = build_model(cfg.model)(**batch)
    assert logits.shape == (*labels.shape, 512)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert torch.isfinite(loss)
