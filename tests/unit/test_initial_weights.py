"""Initial weights from one generator per parameter (model/transformer.init_weights): a build's values depend on
the seed alone, not on where, in what order or how its parameters are made; init_from's lazy weights."""

from __future__ import annotations

import torch
from support.models import run_config, tiny_config

from megatransformer.checkpoint import load_weights, write_weights_checkpoint
from megatransformer.model import build_model
from megatransformer.model.transformer import ARCHITECTURES, INIT_BLOCK_ELEMENTS, init_weights


def test_the_seed_alone_decides_the_weights():
    cfg = tiny_config(tie_embeddings=False, bias=True)
    a, b, c = build_model(cfg, 3), build_model(cfg, 3), build_model(cfg, 4)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), name
        if "norm" not in name and not name.endswith("bias"):
            assert not torch.equal(p, r), name
    torch.manual_seed(0)
    d = build_model(cfg)
    torch.manual_seed(0)
    assert all(torch.equal(p, q) for p, q in zip(d.parameters(), build_model(cfg).parameters()))


def test_a_parameter_written_in_another_order_in_bf16_through_a_fill_gets_the_same_values():
    cfg = tiny_config()
    reference = build_model(cfg, 5)
    model = ARCHITECTURES[cfg.arch](cfg).to(torch.bfloat16)
    pending = []

    def fill(param, write):  # as a ZeRO-3 rank does: write a whole copy, then keep it (here: later, reversed)
        pending.append((param, write))

    init_weights(model, cfg, 5, fill=fill)
    assert pending, "no parameter went through the fill"
    for param, write in reversed(pending):
        whole = torch.empty_like(param)
        write(whole)
        param.data.copy_(whole)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q.to(torch.bfloat16)), name


def test_a_tensor_larger_than_a_block_is_drawn_block_by_block_and_still_normal():
    cfg = tiny_config(vocab_size=INIT_BLOCK_ELEMENTS // 32 + 7, d_model=32)
    table = build_model(cfg, 1).embed_tokens.weight
    head, tail = table[: INIT_BLOCK_ELEMENTS // 32], table[INIT_BLOCK_ELEMENTS // 32 :]
    assert not torch.equal(head[:7], tail)  # (a block's generator is its own)
    assert abs(table.std().item() - cfg.init_std) < 0.05 * cfg.init_std


def test_lazy_weights_read_each_tensor_on_lookup_as_the_eager_ones(tmp_path):
    cfg = run_config()
    weights = build_model(cfg.model, 2).state_dict()
    path = write_weights_checkpoint(tmp_path / "w", cfg, weights)
    _, eager = load_weights(path)
    _, lazy = load_weights(path, lazy=True)
    assert sorted(lazy) == sorted(eager) and len(lazy) == len(eager)
    for name in eager:
        assert torch.equal(lazy[name], eager[name]), name
