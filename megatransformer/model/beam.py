"""Beam search on the (KV-cached) decoding steps of ``model/generate.py``, batched over rows and beams.

Every row of ``input_ids`` gets ``K`` beams, run as ``rows * K`` rows of one batch; after each step the caches
are reordered so that each beam continues the history it was chosen from.

Hypotheses are kept as transformers keeps them with ``early_stopping=True`` (transformers 5,
``GenerationMixin._beam_search``), so that the ``hf`` penalty reproduces its output:
- each step ranks the 2K best continuations of a row's K running beams by summed log-probability;
- an EOS among the first K of them finishes a hypothesis (an EOS ranked lower is dropped); the first K
  others are the next step's beams; at the last allowed step the first K candidates all finish;
- a finished hypothesis scores ``sum log-prob / penalty(|Y|)``, |Y| the tokens it generated, EOS included
  (for a decoder the prompt does not count: transformers 5 uses ``cur_len + 1 - decoder_prompt_len``);
- a row keeps its K best finished hypotheses and stops as soon as it holds K; the best one is the result.

Length penalties: ``gnmt`` ``((5 + |Y|) / 6) ** alpha`` (Wu et al. 2016; Vaswani et al. 2017 used
alpha = 0.6) and ``hf`` ``|Y| ** alpha`` (transformers' ``length_penalty``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatransformer.model.generate import _State, _step_function
from megatransformer.model.transformer import LanguageModel

PENALTY_FORMS = ("gnmt", "hf")


@dataclass
class Hypothesis:
    tokens: list[int]  # the generated tokens, ending in EOS unless the length limit came first
    score: float  # summed log-probability / length penalty


def length_penalty(length: int, alpha: float, form: str = "gnmt") -> float:
    """The divisor of a hypothesis' summed log-probability; ``length`` counts its generated tokens."""
    if form == "gnmt":
        return ((5 + length) / 6) ** alpha
    if form == "hf":
        return float(length) ** alpha
    raise ValueError(f"length penalty form must be one of {PENALTY_FORMS}, got {form!r}")


@torch.no_grad()
def beam_search(
    model: LanguageModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    num_beams: int,
    eos_id: int | None,
    alpha: float = 0.6,
    form: str = "gnmt",
    decoder_start_id: int | None = None,
    use_cache: bool = True,
    prefix_lm: bool = False,
    agreed: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[Hypothesis]:
    """The best hypothesis of every row of ``input_ids`` ([B, L]: decoder prompts or encoder inputs, as in
    ``generate.stream``). ``agreed``: each step's ranked candidates (their scores, their places), from those it
    ranked (processes that search together take one's: every choice after follows from them alone)."""
    if num_beams < 1 or max_new_tokens < 1:
        raise ValueError(f"need num_beams >= 1 and max_new_tokens >= 1, got {num_beams} and {max_new_tokens}")
    length_penalty(1, alpha, form)  # checks the form before any forward
    rows, k = input_ids.shape[0], num_beams
    expanded = input_ids.repeat_interleave(k, dim=0)
    step = _step_function(model, expanded, prefix_lm)
    state = step(model, expanded, None, use_cache, max_new_tokens, decoder_start_id)
    scores = torch.full((rows, k), float("-inf"), device=input_ids.device)
    scores[:, 0] = 0.0  # all beams start alike: only the first one is live, or the K beams would be K copies
    histories: list[list[list[int]]] = [[[] for _ in range(k)] for _ in range(rows)]
    finished: list[list[Hypothesis]] = [[] for _ in range(rows)]
    for t in range(max_new_tokens):
        log_probs = torch.log_softmax(state.logits[:, -1].float(), dim=-1)
        vocab = log_probs.shape[-1]
        total = (scores.reshape(-1, 1) + log_probs).reshape(rows, k * vocab)
        top, index = total.topk(min(2 * k, k * vocab), dim=-1)
        if agreed is not None:
            top, index = agreed(top.contiguous()), agreed(index.contiguous())
        last = t + 1 == max_new_tokens
        divisor = length_penalty(t + 1, alpha, form)
        chosen: list[tuple[float, int, int]] = []  # (score, source row of the batch, token) for every beam
        for row, (row_top, row_index) in enumerate(zip(top.tolist(), index.tolist())):
            live: list[tuple[float, int, int]] = []
            if len(finished[row]) < k:
                for rank, (score, flat) in enumerate(zip(row_top, row_index)):
                    if score == float("-inf"):
                        break
                    beam, token = divmod(flat, vocab)
                    if token == eos_id or last:
                        if rank < k:
                            _keep(finished[row], Hypothesis(histories[row][beam] + [token], score / divisor), k)
                    elif len(live) < k:
                        live.append((score, beam, token))
            live += [(float("-inf"), 0, 0)] * (k - len(live))  # dead beams (a finished row, a tiny vocabulary)
            histories[row] = [histories[row][beam] + [token] for _, beam, token in live]
            chosen += [(score, row * k + beam, token) for score, beam, token in live]
        if last or all(len(hyps) == k for hyps in finished):
            break
        scores = torch.tensor([c[0] for c in chosen], device=scores.device).reshape(rows, k)
        source = torch.tensor([c[1] for c in chosen], device=input_ids.device)
        tokens = torch.tensor([c[2] for c in chosen], device=input_ids.device)
        state = step(model, expanded, (_reorder(state, source), tokens), use_cache, max_new_tokens, decoder_start_id)
    return [max(hyps, key=lambda h: h.score) for hyps in finished]


def _keep(hypotheses: list[Hypothesis], new: Hypothesis, k: int) -> None:
    """Add ``new`` to a row's finished hypotheses, keeping the best ``k``."""
    if len(hypotheses) < k or new.score > min(h.score for h in hypotheses):
        hypotheses.append(new)
        if len(hypotheses) > k:
            hypotheses.remove(min(hypotheses, key=lambda h: h.score))


def _reorder(state: _State, source: torch.Tensor) -> _State:
    """Beam i continues the history of batch row ``source[i]``: its tokens and its self-attention cache. The
    encoder memory is the same for all beams of a row and stays."""
    for cache in state.caches or []:
        cache.k[:, :, : cache.length] = cache.k[source, :, : cache.length]
        cache.v[:, :, : cache.length] = cache.v[source, :, : cache.length]
        cache.positions[:, : cache.length] = cache.positions[source, : cache.length]  # (ALiBi's key positions)
    state.tokens = state.tokens[source]
    return state
