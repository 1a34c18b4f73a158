"""Muon with AdamW (training/optimizers/muon.py): torch.optim.Muon's updates, the parameters it takes, the matrices it
reassembles from ZeRO's partitions, the state it keeps, and the planner's count of it."""

from __future__ import annotations

import math

import pytest
import torch
from support import REPO
from support.models import run_config, tiny_config

from megatransformer.config import ConfigError, OptimConfig, load_config
from megatransformer.flops import assign_owners, newton_schulz_flops
from megatransformer.model import build_model
from megatransformer.model.matrices import hidden_matrix_names
from megatransformer.training.deepspeed.partitions import Fragment
from megatransformer.training.optimizers.muon import Matrix, MuonWithAdamW, muon_param_groups, plan_exchange

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model(**fields):
    torch.manual_seed(0)
    return build_model(tiny_config(**fields))


def test_muon_takes_the_linear_layers_weights_and_nothing_else():
    m = model()
    chosen = hidden_matrix_names(m)
    expected = {
        f"decoder.layers.{i}.{part}.{p}.weight"
        for i in range(2)
        for part, ps in (("self_attn", PROJECTIONS[:4]), ("ffn", PROJECTIONS[4:]))
        for p in ps
    }
    assert chosen == expected
    assert all(p.ndim == 2 for n, p in m.named_parameters() if n in chosen)


def test_an_untied_output_head_and_the_embeddings_stay_with_adamw():
    m = model(tie_embeddings=False)
    names = {n for n, _ in m.named_parameters()}
    assert "lm_head.weight" in names
    chosen = hidden_matrix_names(m)
    assert "lm_head.weight" not in chosen and "embed_tokens.weight" not in chosen
    assert len(chosen) == 14


def test_latent_attention_and_cross_attention_matrices_get_muon_too():
    mla = hidden_matrix_names(model(attention="mla", kv_lora_rank=16, n_kv_heads=None))
    assert {"decoder.layers.0.self_attn.kv_a_proj.weight", "decoder.layers.0.self_attn.kv_b_proj.weight"} <= mla
    seq2seq = model(arch="encoder_decoder")
    chosen = hidden_matrix_names(seq2seq)
    assert any(".cross_attn." in n for n in chosen)
    assert [n for n, p in seq2seq.named_parameters() if p.ndim == 2 and n not in chosen] == ["embed_tokens.weight"]


def test_groups_count_every_parameter_once_and_say_so():
    m = model()
    groups, line = muon_param_groups(m, OptimConfig(name="muon"), tensor_parallel=1)
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in m.parameters())
    muon = sum(p.numel() for g in groups if g["use_muon"] for p in g["params"])
    assert line.startswith(f"optimizer: Muon on 14 matrices ({muon:,} parameters")
    assert {g["tp_dim"] for g in groups if g["use_muon"]} == {None}
    (decayed,) = [g for g in groups if not g["use_muon"] and g["weight_decay"] > 0] or [{"params": []}]
    assert decayed["params"] == []  # the tied embedding, norms: AdamW without decay


def test_tensor_parallel_groups_know_each_matrix_split():
    groups, _ = muon_param_groups(model(), OptimConfig(name="muon"), tensor_parallel=2)
    dims = {g["tp_dim"]: len(g["params"]) for g in groups if g["use_muon"]}
    assert dims == {0: 10, 1: 4}  # q, k, v, gate, up by output; o, down by input


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_updates_equal_torch_muon_and_adamw(nesterov: bool, adjust: str):
    """The same model stepped by MuonWithAdamW and by torch.optim.Muon + torch.optim.AdamW on the same
    gradients: bit for bit the same weights after five steps."""
    o = OptimConfig(
        name="muon",
        lr=1e-2,
        muon_lr=0.05,
        muon_momentum=0.9,
        muon_nesterov=nesterov,
        muon_ns_steps=4,
        muon_adjust_lr_fn=adjust,
        muon_weight_decay=0.1,
        weight_decay=0.05,
    )
    ours, ref = model(tie_embeddings=False), model(tie_embeddings=False)  # (an output head AdamW decays)
    groups, _ = muon_param_groups(ours, o, 1)
    optimizer = MuonWithAdamW(groups)
    ref_params = dict(ref.named_parameters())
    chosen = hidden_matrix_names(ref)
    muon = torch.optim.Muon(
        [ref_params[n] for n in chosen],
        lr=o.muon_lr,
        weight_decay=o.muon_weight_decay,
        momentum=o.muon_momentum,
        nesterov=nesterov,
        ns_steps=o.muon_ns_steps,
        adjust_lr_fn=adjust,
    )
    linear = {id(m.weight) for m in ref.modules() if isinstance(m, torch.nn.Linear)} - {id(ref.embed_tokens.weight)}
    rest = [p for n, p in ref.named_parameters() if n not in chosen]
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if id(p) in linear], "weight_decay": o.weight_decay},
            {"params": [p for p in rest if id(p) not in linear], "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for (_, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        optimizer.step()
        muon.step()
        adamw.step()
    assert optimizer.ns_calls == 5 * len(chosen)
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert set(optimizer.state_dict()["state"][0]) == {"momentum_buffer"}


def test_fp32_newton_schulz_is_torchs_iteration_at_fp32_precision():
    from torch.optim._muon import _zeropower_via_newtonschulz

    from megatransformer.training.optimizers.muon import NS_COEFFICIENTS, NS_EPS, newton_schulz_fp32

    for shape in ((24, 40), (40, 24)):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        ours, torchs = newton_schulz_fp32(g, 5), _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, NS_EPS)
        assert ours.dtype == torch.float32 and ours.shape == g.shape
        torch.testing.assert_close(ours, torchs.float(), atol=0.03, rtol=0)  # bf16's rounding apart
        singular = torch.linalg.svdvals(ours)
        assert singular.min() > 0.5 and singular.max() < 1.5  # near-orthogonal, as the quintic leaves it


def test_a_flattened_muon_parameter_is_refused():
    flat = torch.nn.Parameter(torch.zeros(12))
    with pytest.raises(ConfigError, match=r"tensor of shape \(12,\).*flattened"):
        MuonWithAdamW([{"params": [flat], "use_muon": True, "tp_dim": None}])


def _loads(costs: list[int], ranks: int) -> list[int]:
    loads = [0] * ranks
    for cost, owner in zip(costs, assign_owners(costs, ranks)):
        loads[owner] += cost
    return loads


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_owners_balance_the_newton_schulz_flops_of_the_shipped_configs(path):
    """At 8 ranks within 1.1 of the mean. At 64 ranks these models have too few matrices for that (72 to 96,
    the largest more than 1.1 x the mean load): the busiest owner holds the largest matrix alone, the best any
    split of whole matrices can do."""
    with torch.device("meta"):
        m = build_model(load_config(path).model)
    chosen = hidden_matrix_names(m)
    costs = [newton_schulz_flops(p.shape) for name, p in m.named_parameters() if name in chosen]
    eight = _loads(costs, 8)
    assert max(eight) <= 1.1 * sum(costs) / 8
    assert max(_loads(costs, 64)) == max(max(costs), math.ceil(sum(costs) / 64))
    assert assign_owners(costs, 64) == assign_owners(list(costs), 64)  # (nothing but the costs decides)


def test_owners_balance_a_deeper_llama_style_model_over_64_ranks():
    with torch.device("meta"):
        m = build_model(load_config(REPO / "configs/llama-style.yaml").model.model_copy(update={"n_layers": 32}))
    chosen = hidden_matrix_names(m)
    costs = [newton_schulz_flops(p.shape) for name, p in m.named_parameters() if name in chosen]
    assert max(_loads(costs, 64)) <= 1.1 * sum(costs) / 64


def _route(sends: list[tuple[torch.Tensor, tuple[int, ...]]]) -> list[torch.Tensor]:
    """What each rank receives when rank r sends ``sends[r]`` (its elements, split per destination)."""
    pieces = [list(sent.split(list(splits))) for sent, splits in sends]
    return [torch.cat([pieces[src][dst] for src in range(len(sends))]) for dst in range(len(sends))]


def test_the_owner_exchange_gathers_each_matrix_whole_at_its_owner_and_sends_each_rank_its_fragments():
    """Three ranks, a 4 x 6 matrix split in two tensor-parallel shards (dim 1), the first partitioned over ranks 0
    and 1, the second whole on ranks 0 and 2 (replicas: sent once, by the owner), and a 3 x 3 matrix; each fragment
    somewhere in a rank's flat buffers."""
    a = torch.arange(24.0).view(4, 6)
    b = 100 + torch.arange(9.0).view(3, 3)
    matrices = {
        "a": Matrix("a", torch.Size([4, 3]), 1, 2, owner=2),
        "b": Matrix("b", torch.Size([3, 3]), None, 1, owner=0),
    }
    shards = {("a", 0): a[:, :3].reshape(-1), ("a", 1): a[:, 3:].reshape(-1), ("b", 0): b.reshape(-1)}
    fragments = [  # (rank, tp rank, name, start, numel, buffer, offset)
        Fragment(0, 0, "a", 0, 7, 0, 2),
        Fragment(1, 0, "a", 7, 5, 0, 0),
        Fragment(0, 1, "a", 0, 12, 1, 0),
        Fragment(2, 1, "a", 0, 12, 1, 0),
        Fragment(1, 0, "b", 0, 9, 1, 3),
    ]
    buffers = [{0: torch.zeros(9), 1: torch.zeros(12)}, {0: torch.zeros(5), 1: torch.zeros(12)}, {}]
    buffers[2] = {1: torch.zeros(12)}
    for f in fragments:
        tp = f.tp_rank if matrices[f.name].tp_dim is not None else 0
        buffers[f.rank][f.buffer][f.offset : f.offset + f.numel] = shards[f.name, tp][f.start : f.start + f.numel]
    plans = [plan_exchange(matrices, fragments, rank, 3) for rank in range(3)]
    sent = [torch.cat([buffers[r][k][o : o + n] for k, o, n in plan.gather_send]) for r, plan in enumerate(plans)]
    received = _route([(s, plan.gather_send_splits) for s, plan in zip(sent, plans)])
    results = []
    for rank, plan in enumerate(plans):
        wholes = [torch.full((m.tp if m.tp_dim is not None else 1, m.shard.numel()), torch.nan) for m in plan.owned]
        at = 0
        for i, s, start, n in plan.gather_recv:
            wholes[i][s, start : start + n] = received[rank][at : at + n]
            at += n
        whole = {m.name: torch.cat([w.view(m.shard) for w in ws], m.tp_dim or 0) for m, ws in zip(plan.owned, wholes)}
        assert set(whole) == {name for name, m in matrices.items() if m.owner == rank}
        for name, value in whole.items():
            assert torch.equal(value, {"a": a, "b": b}[name])
        out = [-w for w in wholes]  # (the owner's "result": each element negated)
        results.append(
            torch.cat([out[i][s, start : start + n] for i, s, start, n in plan.scatter_send] or [torch.zeros(0)])
        )
    back = _route([(r, plan.scatter_send_splits) for r, plan in zip(results, plans)])
    for rank, plan in enumerate(plans):
        at = 0
        for k, o, n, _ in plan.scatter_recv:
            assert torch.equal(back[rank][at : at + n], -buffers[rank][k][o : o + n])
            at += n
        assert at == back[rank].numel() == sum(f.numel for f in fragments if f.rank == rank)
    assert sum(len(plan.owned) for plan in plans) == 2
    assert sum(sum(plan.gather_send_splits) for plan in plans) == 24 + 9  # (each element once)
    assert plans[0].gather_send_splits == (0, 0, 7) and plans[1].gather_send_splits == (
        9,
        0,
        5,
    )  # (rank 0's copy of the second shard is not sent)


def test_fragments_that_do_not_tile_a_matrix_are_refused():
    matrices = {"a": Matrix("a", torch.Size([2, 3]), None, 1, owner=0)}
    gap = [Fragment(0, 0, "a", 0, 2, 0, 0), Fragment(1, 0, "a", 3, 3, 0, 0)]
    with pytest.raises(ConfigError, match="partitions of a .* do not tile it"):
        plan_exchange(matrices, gap, 0, 2)


def test_muon_keeps_a_momentum_and_no_step_count_adamw_its_moments_and_step():
    groups, _ = muon_param_groups(model(), OptimConfig(name="muon"), 1)
    optimizer = MuonWithAdamW(groups)
    for p in optimizer.param_groups[0]["params"] + optimizer.param_groups[-1]["params"]:
        p.grad = torch.randn_like(p)
    optimizer.step()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                assert sorted(optimizer.state[p]) == sorted(MuonWithAdamW.state_keys(group))
    assert MuonWithAdamW.state_keys(optimizer.param_groups[0]) == ("momentum_buffer",)


def test_planner_counts_one_buffer_for_muons_matrices():
    from megatransformer.planner import Layout, muon_elements, state_parts

    model_fields = dict(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=32)
    adamw, muon = run_config(model=model_fields), run_config(model=model_fields, optim={"name": "muon"})
    matrices = muon_elements(muon.model, 1)
    assert matrices == sum(
        p.numel() for n, p in build_model(muon.model).named_parameters() if n.endswith("proj.weight")
    )
    for zero, dp in ((0, 1), (1, 2), (3, 4)):
        layout = Layout(
            dp, 1, 1, zero, activation_checkpointing=False, mlp_tiles=1, offload=False, micro_batch=1, accum=1
        )
        held_adamw = state_parts(adamw, layout, engine=True)[0]["optimizer_states"]
        held_muon = state_parts(muon, layout, engine=True)[0]["optimizer_states"]
        assert held_adamw - held_muon == 4 * -(-matrices // (dp if zero else 1))
    assert muon_elements(muon.model, 2) < matrices  # (each tensor-parallel rank a shard of the split ones)


def test_the_planner_offers_muon_every_zero_stage_but_no_offloaded_optimizer():
    from megatransformer.planner import find_gpu, plan

    result = plan(run_config(optim={"name": "muon"}), find_gpu("H100"), 4, 4, None, 16)
    assert {p.layout.zero for p in result.layouts} == {0, 1, 2, 3}
    assert not any(p.layout.offload for p in result.layouts)
    assert {p.layout.tp for p in result.layouts} > {1}  # tensor parallelism stays offered
