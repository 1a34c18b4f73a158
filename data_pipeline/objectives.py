"""Objectives: turn a window of tokens into one training sample (numpy arrays, see megatransformer.batch).

How each objective lays out its tokens, instruction examples, seeding, decoder start tokens: docs/data.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data_pipeline import DataError
from data_pipeline.settings import ObjectiveArgs
from data_pipeline.tokenizer import TokenizerInfo
from megatransformer.batch import IGNORE_INDEX

Sample = dict[str, np.ndarray]


@dataclass
class Window:
    tokens: np.ndarray  # int64
    segments: np.ndarray  # document (or example) number per token: 1, 2, ...
    prompt: np.ndarray | None = None  # bool per token: part of an instruction example's prompt


def doc_positions(segments: np.ndarray) -> np.ndarray:
    """Position of each token inside its document (restarting at 0 at each document start)."""
    starts = np.ones(len(segments), dtype=bool)
    starts[1:] = segments[1:] != segments[:-1]
    index = np.arange(len(segments))
    return index - np.maximum.accumulate(np.where(starts, index, 0))


def pad_to(array: np.ndarray, length: int, value: int) -> np.ndarray:
    if len(array) == length:
        return array.astype(np.int64, copy=False)
    out = np.full(length, value, dtype=np.int64)
    out[: len(array)] = array
    return out


def split_segments(window: Window) -> list[np.ndarray]:
    return np.split(window.tokens, _segment_starts(window))


def _segment_starts(window: Window) -> np.ndarray:
    return np.flatnonzero(window.segments[1:] != window.segments[:-1]) + 1


def decoder_start_id(tok: TokenizerInfo, objective: str) -> int:
    """The token the decoder starts from: BOS for prefix_lm, PAD for span_corruption (T5), else the other."""
    first, second = ("bos", "pad") if objective == "prefix_lm" else ("pad", "bos")
    for role in (first, second):
        if getattr(tok, f"{role}_id") is not None:
            return getattr(tok, f"{role}_id")
    raise DataError(f"tokenizer {tok.path} has neither a pad nor a bos token to start the decoder with")


class Objective:
    layout: str = "packed"
    window: int
    overlap: int = 0  # tokens shared by consecutive windows of one document
    min_tokens: int = 1  # shorter pieces are dropped (rows and examples layouts)
    doc_eos: bool = True  # append EOS to every document before cutting it
    packed: bool = True  # examples layout: several examples per row
    capacity: tuple[int, int] = (0, 0)  # examples layout: (encoder, decoder) tokens per row
    random: bool = True  # build() draws from its generator

    def cost(self, n: int) -> tuple[int, int]:
        """examples layout: the (encoder, decoder) tokens an example of n raw tokens takes, at most."""
        raise NotImplementedError

    def build(self, window: Window, rng: np.random.Generator) -> Sample:
        raise NotImplementedError


def padding_token(tok: TokenizerInfo) -> int:
    return tok.pad_id if tok.pad_id is not None else tok.require("eos", "padding (the tokenizer has no pad)")


class Autoregressive(Objective):
    """Next-token prediction, loss on every real token but prompts; labels never cross a document boundary."""

    overlap = 1  # the last token of a window is the first input of the next: every token gets predicted
    random = False

    def __init__(self, seq_len: int, tok: TokenizerInfo, packed: bool) -> None:
        self.seq_len, self.window, self.min_tokens = seq_len, seq_len + 1, 2
        self.layout = "packed" if packed else "rows"
        self.pad = padding_token(tok)

    def build(self, window: Window, rng: np.random.Generator) -> Sample:
        tokens, segments = window.tokens, window.segments
        learn = segments[1:] == segments[:-1]
        if window.prompt is not None:
            learn &= ~window.prompt[1:]
        labels = np.where(learn, tokens[1:], IGNORE_INDEX)
        n, T = len(tokens) - 1, self.seq_len
        return {
            "input_ids": pad_to(tokens[:-1], T, self.pad),
            "labels": pad_to(labels, T, IGNORE_INDEX),
            "segment_ids": pad_to(segments[:-1], T, 0),
            "position_ids": pad_to(doc_positions(segments[:n]), T, 0),
        }


class MaskedLM(Objective):
    """BERT: select mask_prob of the non-special tokens; of those mask / random / keep; loss on the selected."""

    min_tokens = 2  # (rows) a lone EOS piece has nothing to predict

    def __init__(self, seq_len: int, tok: TokenizerInfo, packed: bool, args: ObjectiveArgs) -> None:
        self.seq_len, self.window, self.args = seq_len, seq_len, args
        self.layout = "packed" if packed else "rows"
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
        if a.mask_prob > 0 and candidates.any() and not selected.any():  # never an empty target
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


def split_range(n: int, args: ObjectiveArgs) -> tuple[int, int]:
    """The prefix lengths allowed for n tokens: [low, high], within [1, n-1]."""
    low = min(max(1, int(round(args.prefix_min * n))), n - 1)
    high = min(max(low, int(round(args.prefix_max * n))), n - 1)
    return low, high


def split_point(n: int, args: ObjectiveArgs, rng: np.random.Generator) -> int:
    """A prefix length drawn uniformly from split_range(n)."""
    low, high = split_range(n, args)
    return int(rng.integers(low, high + 1))


class PrefixLM(Objective):
    """Decoder-only: a bidirectional prefix, causal after it, loss only after it.

    ``prefix_len`` is per position (see megatransformer.model.masks): where the prefix of the position's
    document ends. Text rows are split once at a random point (documents wholly inside the prefix are context
    only; labels never cross a document boundary); with ``data.pack: false`` a row holds one document, padded.
    An instruction example's prefix is its prompt, so a packed row holds several examples, each with its own
    prefix."""

    overlap = 1

    def __init__(self, seq_len: int, tok: TokenizerInfo, packed: bool, args: ObjectiveArgs) -> None:
        self.seq_len, self.window, self.args, self.min_tokens = seq_len, seq_len + 1, args, 3
        self.layout = "packed" if packed else "rows"
        self.pad = padding_token(tok)

    def build(self, window: Window, rng: np.random.Generator) -> Sample:
        tokens, segments, T = window.tokens, window.segments, self.seq_len
        n = len(tokens) - 1  # input length
        learn = segments[1:] == segments[:-1]
        if window.prompt is None:
            prefix = split_point(n, self.args, rng)
            learn[: prefix - 1] = False  # position prefix-1 (the last in the prefix) predicts token prefix
            ends = np.full(T, prefix)
        else:
            learn &= ~window.prompt[1:]
            ends = pad_to(prompt_ends(segments[:n], window.prompt[:n]), T, 0)
        return {
            "input_ids": pad_to(tokens[:-1], T, self.pad),
            "labels": pad_to(np.where(learn, tokens[1:], IGNORE_INDEX), T, IGNORE_INDEX),
            "segment_ids": pad_to(segments[:-1], T, 0),
            "position_ids": pad_to(doc_positions(segments[:n]), T, 0),
            "prefix_len": ends,
        }


def prompt_ends(segments: np.ndarray, prompt: np.ndarray) -> np.ndarray:
    """For every token, the row index where its document's prompt ends (prompts lead their documents)."""
    is_start = np.r_[True, segments[1:] != segments[:-1]]
    starts, piece = np.flatnonzero(is_start), np.cumsum(is_start) - 1
    return (starts + np.add.reduceat(prompt.astype(np.int64), starts))[piece]


class EncoderDecoderObjective(Objective):
    """Builds one (source, target) pair per example and packs the pairs of a window side by side."""

    layout = "examples"

    name: str

    def __init__(self, seq_len: int, tok: TokenizerInfo, packed: bool) -> None:
        self.seq_len, self.packed = seq_len, packed
        self.pad, self.start = padding_token(tok), decoder_start_id(tok, self.name)

    def example(self, tokens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def build(self, window: Window, rng: np.random.Generator) -> Sample:
        if window.prompt is None:
            pairs = [self.example(piece, rng) for piece in split_segments(window)]
        else:  # instruction examples: the prompt is the source, the completion the target
            starts = _segment_starts(window)
            pieces = zip(np.split(window.tokens, starts), np.split(window.prompt, starts))
            pairs = [(tokens[prompt], tokens[~prompt]) for tokens, prompt in pieces]
        return encoder_decoder_sample(pairs, self.start, self.pad, *self.capacity)

    def largest_window(self) -> int:
        """The most raw tokens one example may hold so that it fits a row."""

        def fits(n: int) -> bool:
            return all(c <= cap for c, cap in zip(self.cost(n), self.capacity))

        if not fits(self.min_tokens):
            raise DataError(f"data.seq_len={self.seq_len} is too short for an encoder-decoder example")
        n = self.min_tokens
        while fits(n + 1):
            n += 1
        return n


def encoder_decoder_sample(
    pairs: list[tuple[np.ndarray, np.ndarray]], start: int, pad: int, src_len: int, tgt_len: int
) -> Sample:
    """Examples side by side: example k is segment k of the encoder and of the decoder."""

    def side(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        segments = np.concatenate([np.full(len(p), k + 1) for k, p in enumerate(parts)])
        return segments, np.concatenate([np.arange(len(p)) for p in parts])

    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
    src_seg, src_pos = side(sources)
    tgt_seg, tgt_pos = side(targets)
    shifted = np.concatenate([x for t in targets for x in ([start], t[:-1])])
    return {
        "input_ids": pad_to(np.concatenate(sources), src_len, pad),
        "segment_ids": pad_to(src_seg, src_len, 0),
        "position_ids": pad_to(src_pos, src_len, 0),
        "decoder_input_ids": pad_to(shifted, tgt_len, pad),
        "decoder_segment_ids": pad_to(tgt_seg, tgt_len, 0),
        "decoder_position_ids": pad_to(tgt_pos, tgt_len, 0),
        "labels": pad_to(np.concatenate(targets), tgt_len, IGNORE_INDEX),
    }


class Seq2SeqPrefixLM(EncoderDecoderObjective):
    """Encoder-decoder prefix-LM: a document piece is split at a random point; the prefix is the encoder
    input, the rest the decoder target (ending in the document's EOS when the piece holds its end)."""

    name = "prefix_lm"
    min_tokens = 2

    def __init__(self, seq_len: int, tok: TokenizerInfo, packed: bool, args: ObjectiveArgs) -> None:
        super().__init__(seq_len, tok, packed)
        tok.require("eos", "objective=prefix_lm")
        self.args, self.capacity = args, (seq_len, seq_len)
        self.window = self.largest_window()

    def cost(self, n: int) -> tuple[int, int]:
        low, high = split_range(n, self.args)
        return high, n - low

    def example(self, tokens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        prefix = split_point(len(tokens), self.args, rng)
        return tokens[:prefix], tokens[prefix:]


def span_lengths(raw_len: int, density: float, mean_span: float) -> tuple[int, int]:
    """(noise tokens, noise spans) for raw_len tokens, as in T5: at least one of each, never all noise."""
    noise = min(max(int(round(raw_len * density)), 1), raw_len - 1)
    spans = max(min(int(round(noise / mean_span)), noise, raw_len - noise), 1)
    return noise, spans


def span_corruption_cost(n: int, args: ObjectiveArgs) -> tuple[int, int]:
    """The (input, target) tokens of a span-corruption example of n raw tokens: the kept tokens and a sentinel a
    span, the noise and a sentinel a span, EOS ending both."""
    noise, spans = span_lengths(n, args.noise_density, args.mean_noise_span_length)
    return n - noise + spans + 1, noise + spans + 1


def span_corruption_window(seq_len: int, args: ObjectiveArgs) -> tuple[int, int]:
    """(raw tokens of the longest span-corruption example whose input fits ``seq_len``, that example's target
    tokens: the decoder's length of a row)."""
    if span_corruption_cost(SpanCorruption.min_tokens, args)[0] > seq_len:
        raise DataError(f"data.seq_len={seq_len} is too short for an encoder-decoder example")
    n = SpanCorruption.min_tokens
    while span_corruption_cost(n + 1, args)[0] <= seq_len:
        n += 1
    return n, span_corruption_cost(n, args)[1]


def random_segmentation(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """Split ``total`` items into ``parts`` non-empty runs at random; returns the run lengths."""
    cuts = np.sort(rng.choice(total - 1, size=parts - 1, replace=False) + 1) if parts > 1 else []
    return np.diff(np.concatenate(([0], cuts, [total]))).astype(np.int64)


class SpanCorruption(EncoderDecoderObjective):
    """T5: noise spans replaced by unique sentinels in the input and listed after them in the target, EOS
    ending both. Lengths are computed per example from its raw length, so no example is ever truncated:
    ``window`` is the longest piece whose input fits ``seq_len``; ``target_len`` is that piece's target."""

    name = "span_corruption"
    min_tokens = 2
    doc_eos = False  # the example's own EOS ends input and target

    def __init__(self, seq_len: int, tok: TokenizerInfo, packed: bool, args: ObjectiveArgs) -> None:
        super().__init__(seq_len, tok, packed)
        self.args, self.eos = args, tok.require("eos", "objective=span_corruption")
        self.window, self.target_len = span_corruption_window(seq_len, args)
        self.capacity = (seq_len, self.target_len)
        spans = span_lengths(self.window, args.noise_density, args.mean_noise_span_length)[1]
        if len(tok.sentinel_ids) < spans:
            raise DataError(
                f"span_corruption at seq_len={seq_len} needs {spans} sentinel tokens, tokenizer "
                f"{tok.path} has {len(tok.sentinel_ids)}; train one with more (--sentinels)"
            )
        self.sentinels = np.array(tok.sentinel_ids, dtype=np.int64)

    def cost(self, n: int) -> tuple[int, int]:
        return span_corruption_cost(n, self.args)

    def noise_mask(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Alternating kept and noise runs (starting with kept), run lengths random, counts as span_lengths."""
        noise, spans = span_lengths(n, self.args.noise_density, self.args.mean_noise_span_length)
        noise_runs = random_segmentation(noise, spans, rng)
        keep_runs = random_segmentation(n - noise, spans, rng)
        runs = np.stack([keep_runs, noise_runs], axis=1).reshape(-1)
        return np.repeat(np.tile([False, True], spans), runs)

    def example(self, tokens: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        noise = self.noise_mask(len(tokens), rng)
        span_start = noise.copy()
        span_start[1:] &= ~noise[:-1]
        span_id = np.cumsum(span_start) - 1
        source = np.where(span_start, self.sentinels[np.maximum(span_id, 0)], tokens)[~noise | span_start]
        # target: each span's sentinel followed by the span's tokens
        target = np.insert(tokens, np.flatnonzero(span_start), self.sentinels[span_id[span_start]])
        in_target = np.insert(noise, np.flatnonzero(span_start), True)
        return np.append(source, self.eos), np.append(target[in_target], self.eos)


def build_objective(
    name: str, arch: str, seq_len: int, pack: bool, tok: TokenizerInfo, args: ObjectiveArgs
) -> Objective:
    if name == "autoregressive":
        return Autoregressive(seq_len, tok, pack)
    if name == "masked_lm":
        return MaskedLM(seq_len, tok, pack, args)
    if name == "prefix_lm":
        if arch == "encoder_decoder":
            return Seq2SeqPrefixLM(seq_len, tok, pack, args)
        return PrefixLM(seq_len, tok, pack, args)
    if name == "span_corruption":
        return SpanCorruption(seq_len, tok, pack, args)
    raise DataError(f"unknown objective {name!r}")
