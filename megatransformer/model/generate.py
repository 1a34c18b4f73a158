"""Autoregressive generation: greedy or sampled (temperature, top-k, top-p), with or without KV cache.

Decoder-only models continue ``input_ids`` (a prefix-LM reads them as its bidirectional prefix, as in
training); encoder-decoder models encode ``input_ids`` once, cache the cross-attention keys/values, and decode
from ``decoder_start_id``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import torch

from megatransformer.model.transformer import EncoderDecoderLM, EncoderLM, LanguageModel


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row from [B, V] logits; temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # keeps the token that crosses p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def stream(
    model: LanguageModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    decoder_start_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    prefix_lm: bool = False,
    agreed: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row ([B]) until max_new_tokens or every row has produced eos_id.
    ``prefix_lm``: a decoder attends bidirectionally over the prompt (for models trained with prefix_lm).
    ``agreed``: the tokens each step takes, from those it picked (processes that decode together take one's)."""
    step = _step_function(model, input_ids, prefix_lm)
    state = step(model, input_ids, None, use_cache, max_new_tokens, decoder_start_id)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for n in range(1, max_new_tokens + 1):
        token = sample_next(state.logits[:, -1], temperature, top_k, top_p, generator)
        if agreed is not None:
            token = agreed(token)
        if eos_id is not None:
            token = token.masked_fill(done, eos_id)
            done |= token == eos_id
        yield token
        if n == max_new_tokens or bool(done.all()):
            return
        state = step(model, input_ids, (state, token), use_cache, max_new_tokens, decoder_start_id)


def generate(model: LanguageModel, input_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """The new tokens, [B, N] (N <= max_new_tokens: stops early once every row has ended)."""
    tokens = list(stream(model, input_ids, max_new_tokens, **kwargs))
    if not tokens:
        return input_ids.new_zeros(input_ids.shape[0], 0)
    return torch.stack(tokens, dim=1)


def _step_function(model: LanguageModel, input_ids: torch.Tensor, prefix_lm: bool):
    """The function that runs one decoding step of ``model`` (see _decoder_step, _encoder_decoder_step)."""
    if isinstance(model, EncoderLM):
        raise ValueError("an encoder-only model does not generate text; use a decoder or encoder_decoder model")
    if isinstance(model, EncoderDecoderLM):
        return _encoder_decoder_step
    prefix_len = torch.full_like(input_ids[:, 0], input_ids.shape[1]) if prefix_lm else None
    return partial(_decoder_step, prefix_len=prefix_len)


class _State:
    def __init__(self, logits, tokens, caches=None, memory=None, memory_kvs=None) -> None:
        self.logits, self.tokens, self.caches = logits, tokens, caches
        self.memory, self.memory_kvs = memory, memory_kvs


def _decoder_step(model, prompt, previous, use_cache, max_new_tokens, _start, prefix_len=None):
    """With a cache, only the prompt's forward needs ``prefix_len``: later queries see every cached key."""
    if previous is None:
        caches = model.new_caches(prompt.shape[0], prompt.shape[1] + max_new_tokens) if use_cache else None
        return _State(model(prompt, caches=caches, prefix_len=prefix_len, logits_to_keep=1), prompt, caches)
    state, token = previous
    tokens = torch.cat([state.tokens, token[:, None]], dim=1)
    if use_cache:
        return _State(model(token[:, None], caches=state.caches, logits_to_keep=1), tokens, state.caches)
    return _State(model(tokens, prefix_len=prefix_len, logits_to_keep=1), tokens)


def _encoder_decoder_step(model, source, previous, use_cache, max_new_tokens, start_id):
    if previous is None:
        if start_id is None:
            raise ValueError("encoder-decoder generation needs decoder_start_id")
        memory = model.encode(source)
        tokens = source.new_full((source.shape[0], 1), start_id)
        caches = model.new_caches(source.shape[0], max_new_tokens + 1) if use_cache else None
        memory_kvs = model.project_memory(memory) if use_cache else None
        logits = model.decode(tokens, memory, caches=caches, memory_kvs=memory_kvs, logits_to_keep=1)
        return _State(logits, tokens, caches, memory, memory_kvs)
    state, token = previous
    tokens = torch.cat([state.tokens, token[:, None]], dim=1)
    if use_cache:
        logits = model.decode(
            token[:, None], state.memory, caches=state.caches, memory_kvs=state.memory_kvs, logits_to_keep=1
        )
    else:
        logits = model.decode(tokens, state.memory, logits_to_keep=1)
    return _State(logits, tokens, state.caches, state.memory, state.memory_kvs)
