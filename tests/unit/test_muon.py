"""Muon with AdamW (training/optimizers/muon.py): torch.optim.Muon's updates, the parameters it takes, the matrices (or
team members' blocks of them) it reassembles from ZeRO's partitions, the teams' split Newton-Schulz, the owners'
balance, the state it keeps, and the planner's count of it."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace

import pytest
import torch
from support import REPO
from support.models import run_config, tiny_config

from megatransformer.config import ConfigError, OptimConfig, load_config
from megatransformer.flops import BALANCE, assign_owners, balance_teams, newton_schulz_flops, team_loads
from megatransformer.model import build_model
from megatransformer.model.matrices import hidden_matrix_names
from megatransformer.training.deepspeed.partitions import Fragment, PartitionMap
from megatransformer.training.optimizers.muon import (
    NS_COEFFICIENTS,
    NS_EPS,
    Matrix,
    MuonWithAdamW,
    _cuts,
    muon_param_groups,
    newton_schulz_fp32,
    newton_schulz_member,
    newton_schulz_steps,
    plan_exchange,
    step_units,
)
from megatransformer.training.runtime.cpu_bf16 import Fp32Gemms

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


@pytest.mark.parametrize(
    ("nesterov", "adjust", "cpu_bf16_matmul"),
    [(True, "original", "native"), (False, "match_rms_adamw", "native"), (True, "match_rms_adamw", "fp32")],
)
def test_updates_equal_torch_muon_and_adamw(nesterov: bool, adjust: str, cpu_bf16_matmul: str):
    """The same model stepped by MuonWithAdamW and by torch.optim.Muon + torch.optim.AdamW on the same
    gradients: bit for bit the same weights after five steps. Newton-Schulz in bf16 with PyTorch's bf16 kernels,
    or with fp32 GEMMs of the bf16 operands (what ``auto`` picks on CPUs without bf16 kernels) as torch's Muon
    computes under cpu_bf16.Fp32Gemms."""
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
    optimizer = MuonWithAdamW(groups, cpu_bf16_matmul=cpu_bf16_matmul)
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
        with Fp32Gemms() if cpu_bf16_matmul == "fp32" else contextlib.nullcontext():
            muon.step()
        adamw.step()
    assert optimizer.ns_calls == 5 * len(chosen) and optimizer.ns_parts == 0
    assert optimizer.ns_flops == 5 * o.muon_ns_steps * sum(newton_schulz_flops(ref_params[n].shape) for n in chosen)
    for (name, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert set(optimizer.state_dict()["state"][0]) == {"momentum_buffer"}


def test_fp32_newton_schulz_is_torchs_iteration_at_fp32_precision():
    from torch.optim._muon import _zeropower_via_newtonschulz

    for shape in ((24, 40), (40, 24)):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        ours, torchs = newton_schulz_fp32(g, 5), _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, NS_EPS)
        assert ours.dtype == torch.float32 and ours.shape == g.shape
        torch.testing.assert_close(ours, torchs.float(), atol=0.03, rtol=0)  # bf16's rounding apart
        singular = torch.linalg.svdvals(ours)
        assert singular.min() > 0.5 and singular.max() < 1.5  # near-orthogonal, as the quintic leaves it


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)], ids=["wide", "tall", "square"])
def test_the_whole_matrix_iteration_paused_between_iterations_is_orthogonalize_bit_for_bit(shape):
    """Beside split matrices an owner iterates its whole ones one iteration at a time (between the teams'
    exchanges): the same result as torch's bf16 function and as the fp32 one, bit for bit."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    for dtype, reference in (
        ("bf16", _zeropower_via_newtonschulz(g, NS_COEFFICIENTS, 5, NS_EPS)),
        ("fp32", newton_schulz_fp32(g, 5)),
    ):
        steps = newton_schulz_steps(g, 5, dtype)
        for _ in range(5 + 1):
            try:
                next(steps)
            except StopIteration as done:
                result = done.value
                break
        else:
            pytest.fail("more than steps + 1 pauses")
        assert torch.equal(result, reference), dtype
        assert result.dtype == reference.dtype


def test_a_flattened_muon_parameter_is_refused():
    flat = torch.nn.Parameter(torch.zeros(12))
    with pytest.raises(ConfigError, match=r"tensor of shape \(12,\).*flattened"):
        MuonWithAdamW([{"params": [flat], "use_muon": True, "tp_dim": None}])


def _loads(costs: list[int], ranks: int) -> list[int]:
    loads = [0] * ranks
    for cost, owner in zip(costs, assign_owners(costs, ranks)):
        loads[owner] += cost
    return loads


def _shapes(path) -> list[tuple[int, int]]:
    with torch.device("meta"):
        m = build_model(load_config(path).model)
    chosen = hidden_matrix_names(m)
    return [tuple(p.shape) for name, p in m.named_parameters() if name in chosen]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_teams_balance_the_newton_schulz_flops_of_the_shipped_configs(path):
    """At 8 ranks whole matrices are within 1.1 of the mean, and none is split. At 64 ranks these models have too few
    matrices for that (28 to 96; the busiest owner of whole matrices holds the largest alone, 1.32 to 3.89 x the
    mean): the teams that split some of them by columns bring the busiest rank within 1.1."""
    shapes = _shapes(path)
    costs = [newton_schulz_flops(shape) for shape in shapes]
    limits = [min(shape) for shape in shapes]
    eight = balance_teams(costs, 8, limits)
    assert eight == [(owner,) for owner in assign_owners(costs, 8)]
    assert max(team_loads(costs, eight, 8)) <= BALANCE * sum(costs) / 8
    assert max(_loads(costs, 64)) > BALANCE * sum(costs) / 64  # (whole matrices cannot)
    teams = balance_teams(costs, 64, limits)
    assert max(team_loads(costs, teams, 64)) <= BALANCE * sum(costs) / 64
    assert any(len(team) > 1 for team in teams)
    for team, limit in zip(teams, limits):
        assert len(set(team)) == len(team) <= limit and list(team) == sorted(team)
        assert all(0 <= r < 64 for r in team)


def test_the_team_assignment_is_a_function_of_the_costs_alone():
    """Every rank computes the same teams from the same costs (here another process, with another hash seed: no
    set or dict order reaches them); matrices are split only where whole matrices miss the target, each team no
    larger than its matrix's limit."""
    import os
    import subprocess
    import sys

    shapes = _shapes(REPO / "configs/llama-style.yaml")
    costs, limits = [newton_schulz_flops(shape) for shape in shapes], [min(shape) for shape in shapes]
    teams = balance_teams(costs, 64, limits)
    assert teams == balance_teams(list(costs), 64, list(limits))
    code = f"from megatransformer.flops import balance_teams; print(balance_teams({costs}, 64, {limits}))"
    env = os.environ | {"PYTHONHASHSEED": "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(teams)
    assert balance_teams([10, 10, 10, 10], 4) == [(0,), (1,), (2,), (3,)]
    assert balance_teams([40, 10, 10], 3) == [(0, 1), (2,), (2,)]  # (loads 20, 20, 20)
    assert balance_teams([40, 10, 10], 3, [1, 1, 1]) == [(0,), (1,), (2,)]  # (a team no larger than its limit)


def test_owners_balance_a_deeper_llama_style_model_over_64_ranks():
    with torch.device("meta"):
        m = build_model(load_config(REPO / "configs/llama-style.yaml").model.model_copy(update={"n_layers": 32}))
    chosen = hidden_matrix_names(m)
    costs = [newton_schulz_flops(p.shape) for name, p in m.named_parameters() if name in chosen]
    assert max(_loads(costs, 64)) <= 1.1 * sum(costs) / 64
    assert all(len(team) == 1 for team in balance_teams(costs, 64))  # (no split where whole matrices do)


def _split_newton_schulz(w: torch.Tensor, k: int, steps: int, dtype: str) -> torch.Tensor:
    """The Newton-Schulz of ``w`` by a team of ``k`` members in one process: each member's block as ``Matrix``
    cuts it, their exchanges routed as the all-to-all routes them (in fp32, in member order)."""
    m = Matrix("w", w.shape, None, 1, tuple(range(k)))
    assert m.transposed == (w.size(0) >= w.size(1))
    blocks = []
    for j in range(k):
        r0, r1, c0, c1 = m.block(j)
        blocks.append(w[r0:r1, c0:c1].T if m.transposed else w[r0:r1, c0:c1])
    rows = _cuts(blocks[0].size(0), k)
    members = [newton_schulz_member(block.clone(), rows, j, steps, dtype) for j, block in enumerate(blocks)]
    messages = [next(member) for member in members]
    results: list[torch.Tensor | None] = [None] * k
    exchanges = 0
    while None in results:
        exchanges += 1
        for j in range(k):  # what j gets from i is what i sends j, of the size j expects
            assert [messages[i][0][j].numel() for i in range(k)] == messages[j][1]
        got = [[messages[i][0][j].float().reshape(-1).clone() for i in range(k)] for j in range(k)]
        messages = []
        for j, member in enumerate(members):
            try:
                messages.append(member.send(got[j]))
            except StopIteration as done:
                results[j] = done.value
    assert exchanges == 1 + 3 * steps
    assert all(r.shape == b.shape for r, b in zip(results, blocks))
    return torch.cat([r.T for r in results] if m.transposed else results, 0 if m.transposed else 1)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)], ids=["wide", "tall", "square"])
@pytest.mark.parametrize("k", [2, 3, 5])
def test_a_team_split_of_newton_schulz_is_the_iteration_of_the_whole_matrix(shape, k):
    """k members, each with its block of columns (of the transpose, for a tall or square matrix), reproduce the
    fp32 iteration to fp32 rounding, and torch's bf16 one to bf16's (the members' bf16 products X_i X_iᵀ summed
    in fp32 and rounded once more: about a rounding apart); every member ends with the same A and B."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    w = torch.randn(shape, generator=torch.Generator().manual_seed(k))
    fp32 = _split_newton_schulz(w, k, 5, "fp32")
    assert fp32.dtype == torch.float32 and fp32.shape == w.shape
    torch.testing.assert_close(fp32, newton_schulz_fp32(w, 5), atol=1e-5, rtol=0)
    bf16 = _split_newton_schulz(w, k, 5, "bf16")
    torchs = _zeropower_via_newtonschulz(w, NS_COEFFICIENTS, 5, NS_EPS)
    assert bf16.dtype == torch.bfloat16
    assert (bf16.float() - torchs.float()).abs().max() < 0.03
    assert (bf16.float() - torchs.float()).abs().mean() < 0.004


def _route(sends: list[tuple[torch.Tensor, tuple[int, ...]]]) -> list[torch.Tensor]:
    """What each rank receives when rank r sends ``sends[r]`` (its elements, split per destination)."""
    pieces = [list(sent.split(list(splits))) for sent, splits in sends]
    return [torch.cat([pieces[src][dst] for src in range(len(sends))]) for dst in range(len(sends))]


def _exchange(matrices: dict[str, Matrix], wholes: dict[str, torch.Tensor], fragments: list[Fragment], world: int):
    """Each rank's plan of ``fragments`` (each somewhere in a rank's flat buffers, filled from ``wholes``), run as
    the all-to-alls run them: every block reaches its rank as ``Matrix.block`` cuts it from the whole matrix, and each
    rank gets back its elements of the blocks' results (here each element negated)."""

    def shard(f: Fragment) -> torch.Tensor:
        m = matrices[f.name]
        return wholes[f.name].chunk(m.tp, m.tp_dim or 0)[f.tp_rank if m.tp_dim is not None else 0].reshape(-1)

    buffers: list[dict[int, torch.Tensor]] = [{} for _ in range(world)]
    for f in fragments:
        held = buffers[f.rank].setdefault(f.buffer, torch.zeros(64))
        held[f.offset : f.offset + f.numel] = shard(f)[f.start : f.start + f.numel]
    plans = [plan_exchange(matrices, fragments, rank, world) for rank in range(world)]
    sent = [
        torch.cat([piece.of(buffers[r][b]).reshape(-1) for b, piece in plan.gather_send] or [torch.zeros(0)])
        for r, plan in enumerate(plans)
    ]
    received = _route([(s, plan.gather_send_splits) for s, plan in zip(sent, plans)])
    results = []
    for rank, plan in enumerate(plans):
        blocks = []
        for m, j in plan.blocks:
            r0, r1, c0, c1 = m.block(j)
            blocks.append(torch.full((r1 - r0, c1 - c0), torch.nan))
        at = 0
        for i, piece in plan.gather_recv:
            piece.of(blocks[i].view(-1)).copy_(received[rank][at : at + piece.numel].view(piece.rows, piece.cols))
            at += piece.numel
        assert at == received[rank].numel()
        for (m, j), block in zip(plan.blocks, blocks):
            assert rank == m.team[j]
            r0, r1, c0, c1 = m.block(j)
            assert torch.equal(block, wholes[m.name][r0:r1, c0:c1]), (m.name, j)
        out = [(-block).view(-1) for block in blocks]  # (the block's "result")
        results.append(torch.cat([piece.of(out[i]).reshape(-1) for i, piece in plan.scatter_send] or [torch.zeros(0)]))
    back = _route([(r, plan.scatter_send_splits) for r, plan in zip(results, plans)])
    for rank, plan in enumerate(plans):
        at = 0
        for b, piece, _ in plan.scatter_recv:
            got = back[rank][at : at + piece.numel].view(piece.rows, piece.cols)
            assert torch.equal(got, -piece.of(buffers[rank][b]))
            at += piece.numel
        assert at == back[rank].numel() == sum(f.numel for f in fragments if f.rank == rank)
    assert sum(len(plan.blocks) for plan in plans) == sum(len(m.team) for m in matrices.values())
    assert sum(sum(plan.gather_send_splits) for plan in plans) == sum(w.numel() for w in wholes.values())  # (once)
    return plans


def test_the_owner_exchange_gathers_each_matrix_whole_at_its_owner_and_sends_each_rank_its_fragments():
    """Three ranks, a 4 x 6 matrix split in two tensor-parallel shards (dim 1), the first partitioned over ranks 0
    and 1, the second whole on ranks 0 and 2 (replicas: sent once, by the owner), and a 3 x 3 matrix; each fragment
    somewhere in a rank's flat buffers."""
    wholes = {"a": torch.arange(24.0).view(4, 6), "b": 100 + torch.arange(9.0).view(3, 3)}
    matrices = {
        "a": Matrix("a", torch.Size([4, 3]), 1, 2, team=(2,)),
        "b": Matrix("b", torch.Size([3, 3]), None, 1, team=(0,)),
    }
    fragments = [  # (rank, tp rank, name, start, numel, buffer, offset)
        Fragment(0, 0, "a", 0, 7, 0, 2),
        Fragment(1, 0, "a", 7, 5, 0, 0),
        Fragment(0, 1, "a", 0, 12, 1, 0),
        Fragment(2, 1, "a", 0, 12, 1, 0),
        Fragment(1, 0, "b", 0, 9, 1, 3),
    ]
    plans = _exchange(matrices, wholes, fragments, 3)
    assert [len(plan.blocks) for plan in plans] == [1, 0, 1] and not any(plan.teams for plan in plans)
    # (rank 0's copy of the second shard is not sent)
    assert plans[0].gather_send_splits == (0, 0, 7) and plans[1].gather_send_splits == (9, 0, 5)


def test_a_team_gets_each_member_its_columns_and_no_rank_the_whole_matrix():
    """Split matrices: a wide one (its columns strided in the weight, across two tensor-parallel shards side by
    side), a square one (split by rows: Newton-Schulz on its transpose) and a tall one over two shards stacked by
    rows, all from fragments that start and end mid-row; beside a whole matrix that every rank holds (ZeRO-0's
    replicas: the owner's own copy used)."""
    wholes = {
        "a": torch.arange(24.0).view(4, 6),
        "b": 100 + torch.arange(25.0).view(5, 5),
        "c": 200 + torch.arange(42.0).view(14, 3),
        "d": 300 + torch.arange(18.0).view(2, 9),
    }
    matrices = {
        "a": Matrix("a", torch.Size([4, 3]), 1, 2, team=(0, 1, 2)),  # columns [0, 2) [2, 4) [4, 6)
        "b": Matrix("b", torch.Size([5, 5]), None, 1, team=(1, 2)),  # rows [0, 2) [2, 5)
        "c": Matrix("c", torch.Size([7, 3]), 0, 2, team=(0, 1, 2)),  # rows [0, 4) [4, 9) [9, 14)
        "d": Matrix("d", torch.Size([2, 9]), None, 1, team=(1,)),
    }
    assert not matrices["a"].transposed and matrices["b"].transposed and matrices["c"].transposed
    fragments = [
        Fragment(0, 0, "a", 0, 7, 0, 1),
        Fragment(1, 0, "a", 7, 5, 0, 0),
        Fragment(0, 1, "a", 0, 12, 1, 0),
        Fragment(2, 1, "a", 0, 12, 1, 0),
        Fragment(0, 0, "b", 0, 8, 2, 0),
        Fragment(1, 0, "b", 8, 9, 1, 20),
        Fragment(2, 0, "b", 17, 8, 0, 0),
        Fragment(0, 0, "c", 0, 10, 3, 0),
        Fragment(1, 0, "c", 10, 11, 2, 0),
        Fragment(2, 1, "c", 0, 21, 2, 0),
        *(Fragment(r, 0, "d", 0, 18, 4, 5) for r in range(3)),
    ]
    plans = _exchange(matrices, wholes, fragments, 3)
    assert [m.name for m in plans[0].teams] == ["a", "b", "c"] and all(p.teams == plans[0].teams for p in plans)
    strided = [piece for plan in plans for _, piece in plan.gather_send if piece.rows > 1 and piece.cols < piece.stride]
    assert strided  # (a's columns: 2-D views of the flat buffers)
    for rank, plan in enumerate(plans):  # no rank holds a split matrix whole, nor more than its blocks of it
        held = [(m.name, j) for m, j in plan.blocks]
        assert held == [
            (m, m_team.index(rank))
            for m, m_team in (("a", (0, 1, 2)), ("b", (1, 2)), ("c", (0, 1, 2)))
            if rank in m_team
        ] + ([("d", 0)] if rank == 1 else [])
    # the replicated "d" goes from rank 1's own copy to rank 1: nothing of it crosses between ranks
    assert sum(piece.numel for b, piece in plans[0].gather_send if b == 4) == 0
    assert sum(piece.numel for b, piece in plans[2].gather_send if b == 4) == 0


def test_fragments_that_do_not_tile_a_matrix_are_refused():
    matrices = {"a": Matrix("a", torch.Size([2, 3]), None, 1, team=(0,))}
    gap = [Fragment(0, 0, "a", 0, 2, 0, 0), Fragment(1, 0, "a", 3, 3, 0, 0)]
    with pytest.raises(ConfigError, match="partitions of a .* do not tile it"):
        plan_exchange(matrices, gap, 0, 2)


def _layout(net: torch.nn.Module, stage: int, world: int, buffers: list[list[str]]) -> PartitionMap:
    """A map of ``net``'s matrices in flat buffers, each the names listed: at ZeRO-3 each matrix partitioned on its
    own (rank r holds part r of it, padded), else each buffer partitioned as one flat tensor."""
    params = dict(net.named_parameters())
    fragments = []
    for number, names in enumerate(buffers):
        offsets, at = [0] * world, 0
        for name in names:
            numel = params[name].numel()
            part = -(-numel // world)
            for r in range(world):
                if stage == 3:
                    held = min(part, numel - r * part)
                    if held > 0:
                        fragments.append(Fragment(r, 0, name, r * part, held, number, offsets[r]))
                    offsets[r] += part
                    continue
                whole = -(-sum(params[n].numel() for n in names) // world)
                first, end = max(at, r * whole), min(at + numel, (r + 1) * whole)
                if first < end:
                    fragments.append(Fragment(r, 0, name, first - at, end - first, number, first - r * whole))
            at += numel
    tensors = tuple(torch.empty(0) for _ in buffers)
    shapes = {name: params[name].shape for names in buffers for name in names}
    ids = {id(t): number for number, t in enumerate(tensors)}
    return PartitionMap(stage, world, 0, shapes, tuple(fragments), ids, tensors, (0,) * len(buffers))


def _bound(stage: int, world: int, layers: int, per_layer: bool) -> tuple[MuonWithAdamW, list[list[str]], str]:
    net = model(n_layers=layers)
    groups, _ = muon_param_groups(net, OptimConfig(name="muon"), 1)
    chosen = hidden_matrix_names(net)
    names = [name for name, _ in net.named_parameters() if name in chosen]
    buffers = [[n for n in names if f".layers.{i}." in n] for i in range(layers)] if per_layer else [names]
    optimizer = MuonWithAdamW(groups)
    line = optimizer.bind(net, _layout(net, stage, world, buffers), 1)
    return optimizer, buffers, line


def _unit_loads(optimizer: MuonWithAdamW, names: list[str], world: int) -> list[int]:
    matrices = [optimizer.matrices[name] for name in names]
    return team_loads([newton_schulz_flops(m.shape) for m in matrices], [m.team for m in matrices], world)


def test_at_zero_3_each_sub_group_is_balanced_over_every_rank():
    """DeepSpeed's stage-3 optimizer steps one sub-group (here one layer each) per ``step`` call, so each is
    balanced on its own: every rank works in every sub-group, the busiest within 1.1 of that sub-group's mean;
    one balance over all layers would leave most ranks idle in each sub-group."""
    world, layers = 8, 4
    optimizer, buffers, line = _bound(3, world, layers, per_layer=True)
    assert step_units(optimizer.partitions, [n for names in buffers for n in names]) == buffers
    slowest = 0
    for names in buffers:
        loads = _unit_loads(optimizer, names, world)
        assert min(loads) > 0 and max(loads) <= BALANCE * sum(loads) / world
        slowest += max(loads)
    total = sum(newton_schulz_flops(optimizer.matrices[n].shape) for names in buffers for n in names)
    assert f"balanced within each of {layers} step units" in line
    assert f"(max/mean Newton-Schulz FLOPs {slowest * world / total:.2f})" in line
    names = [n for names in buffers for n in names]
    costs = [newton_schulz_flops(optimizer.matrices[n].shape) for n in names]
    every = dict(zip(names, balance_teams(costs, world, [min(optimizer.matrices[n].shape) for n in names])))
    before = 0
    for unit in buffers:
        loads = team_loads(
            [newton_schulz_flops(optimizer.matrices[n].shape) for n in unit], [every[n] for n in unit], world
        )
        before += max(loads)
    assert before > 1.5 * slowest  # (one balance over all of them: each sub-group's few owners work, the rest wait)


def test_below_zero_3_the_teams_are_one_balance_over_every_matrix():
    """ZeRO-0/1/2 step every buffer of a parameter group in one exchange (here one buffer, or one per layer)."""
    world = 8
    zero_3, _, _ = _bound(3, world, 4, per_layer=True)
    for stage, per_layer in itertools.product((0, 1, 2), (False, True)):
        optimizer, buffers, line = _bound(stage, world, 4, per_layer)
        names = [n for unit in buffers for n in unit]
        costs = [newton_schulz_flops(optimizer.matrices[n].shape) for n in names]
        teams = balance_teams(costs, world, [min(optimizer.matrices[n].shape) for n in names])
        assert [optimizer.matrices[n].team for n in names] == teams
        assert "step units" not in line and f"each of {len(names)} matrices" in line
    assert [zero_3.matrices[n].team for n in names] != teams


def test_a_matrix_stepped_in_two_sub_groups_is_refused():
    net = model()
    groups, _ = muon_param_groups(net, OptimConfig(name="muon"), 1)
    names = [name for name, _ in net.named_parameters() if name in hidden_matrix_names(net)]
    layout = _layout(net, 3, 2, [names])
    moved = [replace(f, buffer=1) if f.name == names[0] and f.rank == 1 else f for f in layout.fragments]
    layout = replace(layout, fragments=tuple(moved), groups=(0, 0))
    with pytest.raises(ConfigError, match="parts of .*q_proj.weight in separate optimizer steps"):
        MuonWithAdamW(groups).bind(net, layout, 1)


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
