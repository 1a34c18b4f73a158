"""Initial weights from one generator per parameter (model/transformer.init_weights): a build's values depend on
the seed alone, not on where, in what order or how its parameters are made; init_from's lazy weights."""

from __future__ import annotations

import math
import threading

import pytest
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


def test_a_parameter_drawn_in_parts_in_another_order_in_bf16_through_a_fill_gets_the_same_values():
    cfg = tiny_config()
    reference = build_model(cfg, 5)
    model = ARCHITECTURES[cfg.arch](cfg).to(torch.bfloat16)
    pending = []

    def fill(param, draw):  # as ZeRO-3 ranks do: each draws its own part (here: later, in reverse, in 3 parts)
        pending.append((param, draw))

    init_weights(model, cfg, 5, fill=fill)
    assert pending, "no parameter went through the fill"
    for param, draw in reversed(pending):
        flat, part = param.data.view(-1), -(-param.numel() // 3)
        padded = torch.full((3 * part,), float("nan"), dtype=param.dtype)  # (the padding past the end stays)
        for start in range(0, 3 * part, part):
            draw(padded[start : start + part], param.shape, start)
        assert padded[param.numel() :].isnan().all()
        flat.copy_(padded[: param.numel()])
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
        flat = eager[name].reshape(-1)  # (a range that starts and ends inside rows, as a ZeRO-3 partition does)
        lo, hi = flat.numel() // 3 + 1, max(2 * flat.numel() // 3 - 1, flat.numel() // 3 + 1)
        assert torch.equal(lazy.flat(name, lo, hi), flat[lo:hi]) and torch.equal(lazy.flat(name, 0, 1), flat[:1])
        for dim in range(eager[name].dim()):  # (a tensor-parallel slice along each dimension, partitioned)
            if eager[name].shape[dim] % 2 == 0:
                part = eager[name].chunk(2, dim)[1].reshape(-1)
                lo, hi = part.numel() // 3 + 1, max(2 * part.numel() // 3 - 1, part.numel() // 3 + 1)
                assert torch.equal(lazy.flat(name, lo, hi, dim, 1, 2), part[lo:hi]), (name, dim)


def test_a_tensor_parallel_build_leaves_only_the_split_matrices_on_the_meta_device():
    """Every replicated parameter real with the one-rank build's values (an untied head and latent attention's
    down-projections are linear layers too), a tied head still the embedding's table; the split ones on meta."""
    from megatransformer.model.tp_plan import partition_dim
    from megatransformer.training.engine.construction import build_for_run

    tiny = dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=32)
    mla = dict(n_kv_heads=None, attention="mla", kv_lora_rank=32, q_lora_rank=24)
    for model_cfg in (tiny | dict(tie_embeddings=False, bias=True), tiny | mla, tiny):
        cfg = run_config(model=model_cfg, seed=3, parallel={"tensor_parallel": 2, "zero_stage": 1})
        model, reference = build_for_run(cfg, 1, {}), build_model(cfg.model, 3)
        for name, param in model.named_parameters():
            split = partition_dim(name) is not None
            assert param.is_meta == split, name
            assert split or torch.equal(param, reference.get_parameter(name)), name
        if cfg.model.tie_embeddings:
            assert model.lm_head.weight is model.embed_tokens.weight
        replicated_linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
        replicated_linear = [n for n in replicated_linear if partition_dim(f"{n}.weight") is None]
        assert bool(replicated_linear) == (cfg.model.attention == "mla"), replicated_linear  # (q_a_proj, kv_a_proj)


def test_a_replaced_parameter_takes_its_place_in_the_parameter_groups():
    from megatransformer.training.engine.construction import replace_parameter

    linear = torch.nn.Linear(2, 3, device="meta")
    old = linear.weight
    old.marked = True
    groups = [{"params": [linear.bias]}, {"params": [old]}]
    replace_parameter(linear, "weight", torch.ones(3, 2), groups)
    assert linear.weight is groups[1]["params"][0] is not old and linear.weight.marked
    assert torch.equal(linear.weight, torch.ones(3, 2)) and groups[0]["params"] == [linear.bias]
    flat = [linear.bias]
    replace_parameter(linear, "bias", torch.zeros(3), flat)
    assert flat[0] is linear.bias and not linear.bias.is_meta


@pytest.mark.parametrize("shape", [(10, 6), (9,), (4, 3, 6)], ids=["matrix", "vector", "three-d"])
@pytest.mark.parametrize("dim", [0, -1], ids=["rows", "last"])
def test_a_part_is_the_whole_draw_cut_and_a_part_of_rows_draws_only_its_blocks(monkeypatch, shape, dim):
    """Blocks of 12 elements, so that a part's first and last blocks hold its neighbours' rows too."""
    from megatransformer.model import transformer

    monkeypatch.setattr(transformer, "INIT_BLOCK_ELEMENTS", 12)
    whole = torch.empty(shape)
    transformer.draw_into(whole, 7, "layer.weight", 0.02)
    generator, drawn = transformer.parameter_generator, []
    monkeypatch.setattr(transformer, "parameter_generator", lambda *key: drawn.append(key[2]) or generator(*key))
    dim %= len(shape)
    parts = 3 if shape[dim] % 3 == 0 else 2
    rows_a_block = max(1, 12 // math.prod(shape[1:]))
    for index, expected in enumerate(whole.chunk(parts, dim)):
        part = torch.empty(expected.shape, dtype=torch.bfloat16)
        drawn.clear()
        transformer.draw_part_into(part, 7, "layer.weight", 0.02, whole.shape, dim, index, parts)
        assert torch.equal(part, expected.to(torch.bfloat16)), (index, part, expected)
        if dim == 0:
            first, end = index * expected.shape[0], (index + 1) * expected.shape[0]
            assert sorted(drawn) == list(range(first // rows_a_block, (end - 1) // rows_a_block + 1))
        else:
            assert sorted(drawn) == list(range(-(-shape[0] // rows_a_block)))
        halves = torch.full((2 * -(-expected.numel() // 2),), float("nan"))  # (a part partitioned over 2 ranks)
        for start in (0, halves.numel() // 2):
            into = halves[start : start + halves.numel() // 2]
            transformer.draw_part_into(into, 7, "layer.weight", 0.02, whole.shape, dim, index, parts, start)
        assert torch.equal(halves[: expected.numel()], expected.reshape(-1))


@pytest.mark.parametrize("shape", [(10, 6), (9,), (4, 3, 6), ()], ids=["matrix", "vector", "three-d", "scalar"])
def test_flat_partitions_across_rows_and_blocks_are_the_whole_draw_flattened(monkeypatch, shape):
    """As ZeRO-3 partitions: 4 equal flat ranges, padded past the end, that start and end inside rows and blocks."""
    from megatransformer.model import transformer

    monkeypatch.setattr(transformer, "INIT_BLOCK_ELEMENTS", 12)
    whole = torch.empty(shape)
    transformer.draw_into(whole, 7, "layer.weight", 0.02)
    part = -(-whole.numel() // 4)
    padded = torch.full((4 * part,), float("nan"))
    for start in range(0, 4 * part, part):
        transformer.draw_part_into(padded[start : start + part], 7, "layer.weight", 0.02, whole.shape, start=start)
    assert torch.equal(padded[: whole.numel()], whole.view(-1)) and padded[whole.numel() :].isnan().all()
    zeros = torch.full((part,), float("nan"))
    transformer.draw_part_into(zeros, 7, "layer.bias", None, whole.shape, start=3 * part)
    assert (zeros[: whole.numel() - 3 * part] == 0).all() and zeros[max(whole.numel() - 3 * part, 0) :].isnan().all()


def test_blocks_are_drawn_on_the_intra_op_threads_each_running_on_one_with_the_same_values_for_any_number(monkeypatch):
    from megatransformer.model import transformer

    monkeypatch.setattr(transformer, "INIT_BLOCK_ELEMENTS", 64)
    drawn, threads = transformer._drawn, {}

    def recorded(*args):
        threads[threading.current_thread().name] = torch.get_num_threads()
        return drawn(*args)

    monkeypatch.setattr(transformer, "_drawn", recorded)
    values, default = {}, torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            threads.clear()
            values[count] = torch.empty(200, 32)
            transformer.draw_into(values[count], 5, "layer.weight", 0.02)
            assert torch.get_num_threads() == count  # (as it was)
            pool = {name.startswith("initial-values_") for name in threads}
            assert pool == {count > 1} and len(threads) <= count, threads  # (one thread: the caller's)
            assert count == 1 or set(threads.values()) == {1}, threads
    finally:
        torch.set_num_threads(default)
    assert torch.equal(values[1], values[3])


def test_a_model_built_on_several_threads_outside_no_grad_is_the_one_thread_build(monkeypatch):
    """A user's build_model (grad mode on) of parameters larger than a block: the pool's threads write into the
    parameters in the caller's grad mode (a thread starts with grad mode on: an in-place write into a view of a
    parameter made under no_grad was refused there)."""
    from megatransformer.model import transformer

    monkeypatch.setattr(transformer, "INIT_BLOCK_ELEMENTS", 64)
    default = torch.get_num_threads()
    built = {}
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.is_grad_enabled()
            built[count] = build_model(tiny_config(), seed=4).state_dict()
    finally:
        torch.set_num_threads(default)
    assert all(torch.equal(built[1][name], built[3][name]) for name in built[1])


def test_the_draws_are_the_hosts_whatever_the_default_device():
    from megatransformer.model import transformer

    expected, target = torch.empty(64, 8), torch.empty(64, 8)
    transformer.draw_into(expected, 1, "layer.weight", 0.02)
    with torch.device("meta"):  # (as a model is made on the run's device)
        transformer.draw_into(target, 1, "layer.weight", 0.02)
    assert torch.equal(target, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the CPU tests above check the same threads")
def test_a_cuda_parameter_gets_the_hosts_draws_written_from_every_thread(monkeypatch):
    from megatransformer.model import transformer

    monkeypatch.setattr(transformer, "INIT_BLOCK_ELEMENTS", 1024)
    expected = torch.empty(512, 64)
    transformer.draw_into(expected, 3, "layer.weight", 0.02)
    default = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        target = torch.empty(512, 64, dtype=torch.bfloat16, device="cuda")
        transformer.draw_into(target, 3, "layer.weight", 0.02)
    finally:
        torch.set_num_threads(default)
    assert torch.equal(target.cpu(), expected.to(torch.bfloat16))


def test_construction_draws_nothing_and_keeps_the_constant_initialisations():
    """A run's model is made without its modules' random default draws (init_weights sets those values): torch's
    generator is untouched, and a LayerNorm still gets its ones and zeros."""
    from megatransformer.model import construct

    cfg = tiny_config(norm="layernorm", bias=True, tie_embeddings=False)
    state = torch.get_rng_state()
    model = construct(cfg)
    assert torch.equal(torch.get_rng_state(), state)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(bool((m.weight == 1).all() and (m.bias == 0).all()) for m in norms)


def test_a_skipped_random_initialisation_that_init_weights_does_not_replace_is_an_error():
    from megatransformer.model.transformer import RandomInitsSkipped

    class WithScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.scale = torch.nn.Parameter(torch.empty(4))
            torch.nn.init.normal_(self.scale)

    with RandomInitsSkipped(tiny_config()) as skipping:
        model = WithScale()
    with pytest.raises(RuntimeError, match="^scale: its module's random initialisation was skipped"):
        skipping.check(model)
