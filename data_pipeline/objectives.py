"""Objectives: turn a window of tokens into one training sample (numpy arrays, see megatransformer.batch).

Each objective declares how it wants its tokens (``window`` tokens per sample, packed across documents
or one document per row, and how many tokens consecutive windows share) and builds a sample with a
random generator seeded per sample, so results depend neither on batch size nor on worker count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data_pipeline import DataError
from data_pipeline.tokenizer import TokenizerInfo
from megatransformer.batch import IGNORE_INDEX
from megatransformer.config import ObjectiveArgs

Sample = dict[str, np.ndarray]


@dataclass
class Window:
    tokens: np.ndarray  # int64
    segments: np.ndarray  # document number per token, 1, 2, ... (0: none)


def doc_positions(segments: np.ndarray) -> np.ndarray:
    """Position of each token inside its document (restarting at 0 at each document start)."""
    starts = np.r_[True, segments[1:] != segments[:-1]]
    index = np.arange(len(segments))
    return index - np.maximum.accumulate(np.where(starts, index, 0))


def pad_to(array: np.ndarray, length: int, value: int) -> np.ndarray:
    return np.pad(array, (0, length - len(array)), constant_values=value)


class Objective:
    window: int
    overlap: int = 0
    packed: bool = True
    min_tokens: int = 1  # shorter rows are skipped (rows mode)

    def build(self, window: Window, rng: np.random.Generator) -> Sample:
        raise NotImplementedError


class Autoregressive(Objective):
    """Next-token prediction; labels never cross a document boundary."""

    overlap = 1

    def __init__(self, seq_len: int, tok: TokenizerInfo, packed: bool) -> None:
        self.seq_len, self.window, self.packed, self.min_tokens = seq_len, seq_len + 1, packed, 2
        self.pad = tok.pad_id if tok.pad_id is not None else tok.require("eos", "padding")

    def build(self, window: Window, rng: np.random.Generator) -> Sample:
        tokens, segments = window.tokens, window.segments
        labels = np.where(segments[1:] == segments[:-1], tokens[1:], IGNORE_INDEX)
        n, T = len(tokens) - 1, self.seq_len
        return {
            "input_ids": pad_to(tokens[:-1], T, self.pad),
            "labels": pad_to(labels, T, IGNORE_INDEX),
            "segment_ids": pad_to(segments[:-1], T, 0),
            "position_ids": pad_to(doc_positions(segments[:n]), T, 0),
        }


class MaskedLM(Objective):
    """BERT: select mask_prob of the non-special tokens; of those mask / random / keep; loss on the selected."""

    def __init__(self, seq_len: int, tok: TokenizerInfo, packed: bool, args: ObjectiveArgs) -> None:
        self.seq_len, self.window, self.packed, self.args = seq_len, seq_len, packed, args
        self.mask_id = tok.require("mask", "objective=masked_lm")
        self.pad = tok.pad_id if tok.pad_id is not None else self.mask_id
        special = np.zeros(tok.vocab_size, dtype=bool)
        special[list(tok.special_ids)] = True
        self.special = special
        self.normal_ids = np.flatnonzero(~special)

    def build(self, window: Window, rng: np.random.Generator) -> Sample:
        tokens, segments, T = window.tokens, window.segments, self.seq_len
        a = self.args
        candidates = ~self.special[tokens]
        selected = candidates & (rng.random(len(tokens)) < a.mask_prob)
        if candidates.any() and not selected.any():  # never an empty target
            selected[rng.choice(np.flatnonzero(candidates))] = True
        roll = rng.random(len(tokens))
        inputs = tokens.copy()
        inputs[selected & (roll < a.mask_token_prob)] = self.mask_id
        random_pos = selected & (roll >= a.mask_token_prob) & (roll < a.mask_token_prob + a.random_token_prob)
        inputs[random_pos] = rng.choice(self.normal_ids, size=int(random_pos.sum()))
        return {
            "input_ids": pad_to(inputs, T, self.pad),
            "labels": pad_to(np.where(selected, tokens, IGNORE_INDEX), T, IGNORE_INDEX),
            "segment_ids": pad_to(segments, T, 0),
            "position_ids": pad_to(doc_positions(segments), T, 0),
        }


def split_point(n: int, args: ObjectiveArgs, rng: np.random.Generator) -> int:
    """A prefix length in [1, n-1] drawn uniformly between prefix_min and prefix_max of n."""
    low = min(max(1, int(round(args.prefix_min * n))), n - 1)
    high = min(max(low, int(round(args.prefix_max * n))), n - 1)
    return int(rng.integers(low, high + 1))


class PrefixLM(Objective):
    """Decoder-only: bidirectional prefix, causal suffix, loss on the suffix only. One document per row."""

    packed = False
    overlap = 1

    def __init__(self, seq_len: int, tok: TokenizerInfo, args: ObjectiveArgs) -> None:
        self.seq_len, self.window, self.args, self.min_tokens = seq_len, seq_len + 1, args, 3
        self.pad = tok.pad_id if tok.pad_id is not None else tok.require("eos", "padding")

    def build(self, window: Window, rng: np.random.Generator) -> Sample:
        tokens, T = window.tokens, self.seq_len
        n = len(tokens) - 1  # input length
        prefix = split_point(n, self.args, rng)
        labels = tokens[1:].copy()
        labels[: prefix - 1] = IGNORE_INDEX  # position prefix-1 predicts the first suffix token
        return {
            "input_ids": pad_to(tokens[:-1], T, self.pad),
            "labels": pad_to(labels, T, IGNORE_INDEX),
            "segment_ids": pad_to(np.ones(n, dtype=np.int64), T, 0),
            "position_ids": pad_to(np.arange(n), T, 0),
            "prefix_len": np.array(prefix),
        }


class Seq2SeqPrefixLM(Objective):
    """Encoder-decoder prefix-LM: the prefix is the encoder input, the rest the decoder target (ending in the
    document's EOS when the row holds the document's end).

    The decoder input is the target shifted right, starting with the BOS token (PAD if there is none).
    """

    packed = False

    def __init__(self, seq_len: int, tok: TokenizerInfo, args: ObjectiveArgs) -> None:
        self.seq_len, self.window, self.args, self.min_tokens = seq_len, seq_len, args, 2
        self.eos = tok.require("eos", "objective=prefix_lm")
        self.pad = tok.pad_id if tok.pad_id is not None else self.eos
        self.start = tok.bos_id if tok.bos_id is not None else self.pad

    def build(self, window: Window, rng: np.random.Generator) -> Sample:
        tokens, T = window.tokens, self.seq_len
        prefix = split_point(len(tokens), self.args, rng)
        target = tokens[prefix:][:T]
        return encoder_decoder_sample(tokens[:prefix], target, self.start, self.pad, T, T)


def encoder_decoder_sample(source, target, start: int, pad: int, src_len: int, tgt_len: int) -> Sample:
    return {
        "input_ids": pad_to(source, src_len, pad),
        "segment_ids": pad_to(np.ones(len(source), dtype=np.int64), src_len, 0),
        "position_ids": pad_to(np.arange(len(source)), src_len, 0),
        "decoder_input_ids": pad_to(np.r_[start, target[:-1]], tgt_len, pad),
        "decoder_segment_ids": pad_to(np.ones(len(target), dtype=np.int64), tgt_len, 0),
        "decoder_position_ids": pad_to(np.arange(len(target)), tgt_len, 0),
        "labels": pad_to(target, tgt_len, IGNORE_INDEX),
    }


def span_lengths(raw_len: int, density: float, mean_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) for a window of raw_len tokens, as in T5."""
    noise = min(max(int(round(raw_len * density)), 1), raw_len - 1)
    spans = max(min(int(round(noise / mean_span)), noise), 1)
    return noise, spans


def span_corruption_lengths(seq_len: int, density: float, mean_span: float) -> tuple[int, int]:
    """The longest raw window whose corrupted input (with EOS) fits seq_len, and its target length."""
    raw = seq_len
    while True:
        noise, spans = span_lengths(raw + 1, density, mean_span)
        if raw + 1 - noise + spans + 1 > seq_len:
            break
        raw += 1
    noise, spans = span_lengths(raw, density, mean_span)
    return raw, noise + spans + 1


def random_segmentation(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """Split ``total`` items into ``parts`` non-empty runs at random; returns the run lengths."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False)) if parts > 1 else []
    return np.diff(np.r_[0, cuts, total]).astype(np.int64)


class SpanCorruption(Objective):
    """T5: noise spans replaced by unique sentinels in the input and listed after them in the target.

    Windows are packed across documents (as T5 does) and sized so that no sample is truncated or padded;
    the decoder starts from the PAD token, as in T5.
    """

    def __init__(self, seq_len: int, tok: TokenizerInfo, args: ObjectiveArgs) -> None:
        self.args, self.seq_len = args, seq_len
        self.window, self.target_len = span_corruption_lengths(seq_len, args.noise_density,
                                                               args.mean_noise_span_length)
        self.noise, self.spans = span_lengths(self.window, args.noise_density, args.mean_noise_span_length)
        self.eos = tok.require("eos", "objective=span_corruption")
        if len(tok.sentinel_ids) < self.spans:
            raise DataError(f"span_corruption at seq_len={seq_len} needs {self.spans} sentinel tokens, tokenizer "
                            f"{tok.path} has {len(tok.sentinel_ids)}; train it with more (--sentinels)")
        self.sentinels = np.array(tok.sentinel_ids)
        self.pad = tok.pad_id if tok.pad_id is not None else self.eos

    def noise_mask(self, rng: np.random.Generator) -> np.ndarray:
        noise_runs = random_segmentation(self.noise, self.spans, rng)
        keep_runs = random_segmentation(self.window - self.noise, self.spans, rng)
        runs = np.stack([keep_runs, noise_runs], axis=1).reshape(-1)
        return np.repeat(np.tile([False, True], self.spans), runs)

    def build(self, window: Window, rng: np.random.Generator) -> Sample:
        tokens = window.tokens
        noise = self.noise_mask(rng)
        span_start = noise & ~np.r_[False, noise[:-1]]
        span_id = np.cumsum(span_start) - 1
        source = np.where(span_start, self.sentinels[span_id], tokens)[~noise | span_start]
        pieces = []
        for i, start in enumerate(np.flatnonzero(span_start)):
            end = start + np.argmin(np.r_[noise[start:], False])
            pieces += [self.sentinels[i], *tokens[start:end]]
        source = np.r_[source, self.eos]
        target = np.array(pieces + [self.eos], dtype=np.int64)
        return encoder_decoder_sample(source, target, self.pad, self.pad, self.seq_len, self.target_len)


def build_objective(name: str, arch: str, seq_len: int, pack: bool, tok: TokenizerInfo,
                    args: ObjectiveArgs) -> Objective:
    if name == "autoregressive":
        return Autoregressive(seq_len, tok, pack)
    if name == "masked_lm":
        return MaskedLM(seq_len, tok, pack, args)
    if name == "prefix_lm":
        return Seq2SeqPrefixLM(seq_len, tok, args) if arch == "encoder_decoder" else PrefixLM(seq_len, tok, args)
    if name == "span_corruption":
        return SpanCorruption(seq_len, tok, args)
    raise DataError(f"unknown objective {name!r}")
