"""The output head, and the training loss fused into it.

A plain head materialises the logits of every position, ``[tokens, vocab]`` in the compute dtype, then an fp32
copy for a stable cross-entropy, a same-sized log-softmax and, in the backward pass, a same-sized gradient:
at a 32k vocabulary and 8k tokens per micro batch that is 1 GiB per copy, the step's memory peak, and several
passes over memory that do no arithmetic. :func:`linear_cross_entropy` instead takes the hidden states and
the head's weight and walks the tokens in chunks: each chunk's logits are computed, turned into its loss and
into the gradient of that loss with respect to them, and dropped; the gradients with respect to the hidden
states and the weight are accumulated as it goes (the loss is a scalar, so they are known in the forward
pass; the backward only scales them), as Liger-Kernel's fused linear cross-entropy does on GPUs. The
arithmetic is the plain head's (same matmuls, the logits upcast to fp32 before the softmax), so the loss and
gradients agree with it to rounding.

The z-loss (PaLM, OLMo) adds ``coefficient * lse^2`` for each loss token, ``lse`` the logsumexp of its
logits (the log of the softmax normalizer Z), in the same pass: its gradient with respect to the logits is
``2 * coefficient * lse * softmax``, so a chunk's softmax is scaled by ``1 + 2 * coefficient * lse``. With a
coefficient of 0 none of it is computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatransformer.batch import IGNORE_INDEX

# logits per chunk, whatever the vocabulary, by device type (BENCHMARKS.md, bench/loss.py): on a CPU 8M (32 MiB
# in fp32) loses nothing to the plain head; on an H200 8M chunks ran at 0.35x the plain head's speed (32k
# vocabulary, 8k tokens; 0.14x at 128k: GEMMs of a few hundred rows), 128M at 0.71x (0.63x) in 0.59x (0.21x)
# of its memory
CHUNK_LOGITS = {"cpu": 1 << 23, "cuda": 1 << 27}


class LMHead(nn.Linear):
    """``nn.Linear(d_model, vocab, bias=False)`` that can also return the summed token loss of ``labels``
    without materialising the logits (its own forward, so ZeRO-3 gathers its weight for it)."""

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if labels is None:
            return super().forward(hidden)
        return linear_cross_entropy(
            hidden.flatten(0, -2), self.weight, labels.flatten(), label_smoothing, z_loss=z_loss
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float = 0.0,
    chunk_logits: int | None = None,
    z_loss: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="sum", ...)``, chunk by chunk.

    ``hidden``: [N, d]; ``weight``: [V, d]; ``labels``: [N], ``IGNORE_INDEX`` where no loss is taken. Returns
    the fp32 sum of the token losses; its gradient flows to ``hidden`` and ``weight``, whichever of them
    requires one (a frozen head's weight gets none computed). Without autograd (evaluation,
    ``torch.no_grad``) only the loss is computed. ``chunk_logits``: logits per chunk (default: the device's in
    ``CHUNK_LOGITS``). ``z_loss`` > 0: the pair (that sum plus the z-loss ``z_loss * lse^2`` of every loss
    token, the z-loss's sum alone, which carries no gradient); see :func:`plain_cross_entropy`.
    """
    if chunk_logits is None:
        chunk_logits = default_chunk_logits(hidden.device)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss, z_sum = _LinearCrossEntropy.apply(hidden, weight, labels, label_smoothing, chunk_logits, z_loss)
    else:
        loss, z_sum = chunked_loss_and_grads(hidden, weight, labels, label_smoothing, chunk_logits, z_loss)[:2]
    return (loss, z_sum) if z_loss else loss


def plain_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What :func:`linear_cross_entropy` computes, from materialised logits [N, V] with autograd: the summed
    token loss in fp32, with ``z_loss`` > 0 the pair (loss + z-loss, z-loss)."""
    logits = logits.float()
    loss = F.cross_entropy(logits, labels, reduction="sum", label_smoothing=label_smoothing)
    if not z_loss:
        return loss
    lse = torch.logsumexp(logits, dim=-1)
    z_sum = z_loss * torch.where(labels != IGNORE_INDEX, lse, 0.0).square().sum()
    return loss + z_sum, z_sum.detach()


def default_chunk_logits(device: torch.device) -> int:
    return CHUNK_LOGITS.get(device.type, CHUNK_LOGITS["cpu"])


def chunked_loss_and_grads(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    label_smoothing: float,
    chunk_logits: int,
    z_loss: float = 0.0,
    need_hidden_grad: bool = False,
    need_weight_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The summed loss (z-loss included), the z-loss's sum (0 when ``z_loss`` is 0) and the gradients asked for,
    with respect to ``hidden`` (in its dtype) and ``weight`` (fp32), one chunk of ``chunk_logits`` logits at a
    time (None for a gradient not asked for)."""
    vocab = weight.shape[0]
    rows = max(1, chunk_logits // vocab)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    z_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
    # the weight's gradient is summed over chunks in fp32 (each chunk's product is rounded to the compute
    # dtype once: the plain head rounds the whole sum once, so bf16 weight gradients differ by about one
    # bf16 rounding per chunk, ~2^-9 relative; the hidden states' gradients are the plain head's)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight_grad else None
    for start in range(0, hidden.shape[0], rows):
        h, y = hidden[start : start + rows], labels[start : start + rows]
        logits = F.linear(h, weight).float()
        keep = y != IGNORE_INDEX
        target = torch.where(keep, y, 0)
        lse = torch.logsumexp(logits, dim=-1)
        token_loss = lse - logits.gather(1, target[:, None]).squeeze(1)
        if label_smoothing:
            token_loss = (1 - label_smoothing) * token_loss + label_smoothing * (lse - logits.mean(dim=-1))
        if z_loss:
            token_z = z_loss * lse.square()
            z_sum += torch.where(keep, token_z, 0.0).sum()
            token_loss = token_loss + token_z
        loss += torch.where(keep, token_loss, 0.0).sum()
        if grad_hidden is None and grad_weight is None:
            continue
        # d(loss)/d(logits) = softmax - (1 - eps) * onehot - eps / V (+ 2 z lse softmax), zero where no loss is taken
        grad_logits = logits.sub_(lse[:, None]).exp_()
        if z_loss:
            grad_logits.mul_(lse.mul(2 * z_loss).add_(1)[:, None])
        grad_logits.scatter_add_(1, target[:, None], torch.full_like(lse[:, None], label_smoothing - 1))
        if label_smoothing:
            grad_logits.sub_(label_smoothing / vocab)
        grad_logits = grad_logits.mul_(keep[:, None]).to(h.dtype)
        if grad_hidden is not None:
            torch.mm(grad_logits, weight, out=grad_hidden[start : start + rows])
        if grad_weight is None:
            continue
        if h.dtype == grad_weight.dtype:
            grad_weight.addmm_(grad_logits.t(), h)  # (fp32: accumulated in place)
        else:
            grad_weight += grad_logits.t() @ h
    return loss, z_sum, grad_hidden, grad_weight


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss and the z-loss's part of it (no gradient), with the loss's gradients computed in the forward
    pass and scaled in the backward."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        label_smoothing: float,
        chunk_logits: int,
        z_loss: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss, z_sum, grad_hidden, grad_weight = chunked_loss_and_grads(
            hidden, weight, labels, label_smoothing, chunk_logits, z_loss, *ctx.needs_input_grad[:2]
        )
        # (the weight's kept in fp32: scaled by the loss's gradient before its one rounding)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(z_sum)
        return loss, z_sum

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_z: torch.Tensor | None):
        grad_hidden, grad_weight = ctx.saved_tensors
        # (an fp32 0-dim factor: each product is rounded once, to the gradient's dtype)
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None
