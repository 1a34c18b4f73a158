"""z-loss (``train.z_loss``): ``coefficient * logsumexp(logits)^2`` of every loss token added to the loss, in the
fused head (with and without autograd) as in the plain formula, for every architecture; nothing computed at 0."""

from __future__ import annotations

import pytest
import torch
from support.models import tiny_config

from megatransformer.batch import IGNORE_INDEX
from megatransformer.model import build_model
from megatransformer.model.head import linear_cross_entropy, plain_cross_entropy

COEFFICIENT = 0.05  # large enough that the z-loss's gradient is far from rounding


def head_inputs(tokens: int = 50, d: int = 16, vocab: int = 40):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, d, generator=gen)
    weight = torch.randn(vocab, d, generator=gen) * 0.5
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::7] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("chunk_logits", [40 * 8, 1 << 23])  # 7 chunks, one chunk
def test_the_fused_z_loss_and_its_gradients_equal_the_plain_formula(label_smoothing, chunk_logits):
    hidden, weight, labels = head_inputs()
    results = []
    for fused in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            loss, z = linear_cross_entropy(h, w, labels, label_smoothing, chunk_logits, z_loss=COEFFICIENT)
        else:
            loss, z = plain_cross_entropy(h @ w.t(), labels, label_smoothing, z_loss=COEFFICIENT)
        (loss * 3.0).backward()
        results.append((loss.detach(), z, h.grad, w.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    loss, z, *_ = results[0]
    lse = torch.logsumexp(hidden @ weight.t(), -1)[labels != IGNORE_INDEX]
    torch.testing.assert_close(z, COEFFICIENT * lse.square().sum())
    assert not z.requires_grad
    cross_entropy = linear_cross_entropy(hidden, weight, labels, label_smoothing, chunk_logits)
    torch.testing.assert_close(loss - z, cross_entropy)
    # the z-loss changes the gradients: it pulls the normalizer towards 1
    h = hidden.clone().requires_grad_()
    linear_cross_entropy(h, weight, labels, label_smoothing, chunk_logits).backward()
    assert not torch.allclose(h.grad, results[0][2], atol=1e-4)


def test_without_autograd_the_fused_z_loss_is_the_same():
    hidden, weight, labels = head_inputs()
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, labels, chunk_logits=40 * 8, z_loss=COEFFICIENT)
    want = plain_cross_entropy(hidden @ weight.t(), labels, z_loss=COEFFICIENT)
    torch.testing.assert_close(got, want)


def test_at_zero_nothing_is_computed_and_the_loss_is_unchanged():
    """No z-loss op runs (no square of the normalizer) and the head returns the plain loss tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    hidden, weight, labels = head_inputs()
    h = hidden.clone().requires_grad_()
    with Ops() as ops:
        loss = linear_cross_entropy(h, weight, labels)
        loss.backward()
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0
    assert not [name for name in ops.names if name.startswith("pow") or name.startswith("square")]
    with Ops() as with_z:
        linear_cross_entropy(hidden.clone().requires_grad_(), weight, labels, z_loss=COEFFICIENT)[0].backward()
    assert len(with_z.names) > len(ops.names)
    torch.testing.assert_close(loss, plain_cross_entropy(hidden @ weight.t(), labels))


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_every_architecture_adds_the_z_loss_of_its_loss_tokens(arch):
    """The model's loss with a z-loss is its cross-entropy plus the coefficient times the squared logsumexp of
    the logits it returns, over the tokens that take a loss."""
    torch.manual_seed(0)
    model = build_model(tiny_config(arch=arch, init_std=0.5)).train()
    ids = torch.randint(0, 97, (2, 10))
    labels = torch.randint(0, 97, (2, 10))
    labels[:, :3] = IGNORE_INDEX
    batch = {"input_ids": ids} | ({"decoder_input_ids": ids.flip(1)} if arch == "encoder_decoder" else {})
    loss, z = model(**batch, labels=labels, z_loss=COEFFICIENT)
    loss.backward()
    with torch.no_grad():
        lse = torch.logsumexp(model(**batch).float(), -1)
        cross_entropy = model(**batch, labels=labels)
    torch.testing.assert_close(z, COEFFICIENT * lse[labels != IGNORE_INDEX].square().sum())
    torch.testing.assert_close(loss.detach(), cross_entropy + z)
    assert z > 0 and all(p.grad is not None for p in model.parameters())
