"""Muon's Newton-Schulz at ZeRO-3, computed from a model's matrix shapes: the busiest rank's FLOPs a step over the
mean, with the owners balanced over every matrix at once against balanced within each step unit.

DeepSpeed's stage-3 optimizer steps one sub-group per ``step`` call, and the planner sizes a sub-group to a rank's
share of one layer (``planner.zero3_sizes``), so each layer's matrices are exchanged and orthogonalised together
while the other ranks wait: the step costs the sum over layers of each layer's busiest rank. No step runs here;
the figures follow from ``flops.balance_teams`` and ``flops.newton_schulz_flops`` as ``MuonWithAdamW.bind`` uses them.

    python bench/muon_units.py --ranks 8,64,256 --model '{"d_model": 8192, "n_layers": 80, "n_heads": 64, ...}'
"""

from __future__ import annotations

import argparse
import json

from megatransformer.config import ModelConfig
from megatransformer.flops import balance_teams, newton_schulz_flops, one_block_per_stack, team_loads
from megatransformer.model.matrices import hidden_matrix_names

LLAMA_70B = {
    "d_model": 8192,
    "n_layers": 80,
    "n_heads": 64,
    "n_kv_heads": 8,
    "d_ff": 28672,
    "vocab_size": 128256,
    "max_seq_len": 4096,
}


def layer_shapes(m: ModelConfig) -> tuple[list[tuple[int, int]], int]:
    """One layer's hidden matrices' shapes, and the number of layers."""
    model, copies = one_block_per_stack(m)
    named = dict(model.named_parameters())
    names = [n for n in hidden_matrix_names(model) if ".layers.0." in n]
    return [tuple(named[n].shape) for n in names], copies(names[0])


def slowest_over_mean(shapes: list[tuple[int, int]], layers: int, ranks: int, per_unit: bool) -> float:
    """The sum over layers of each layer's busiest rank, over the mean rank's FLOPs of the whole step."""
    costs, limits = [newton_schulz_flops(shape) for shape in shapes], [min(shape) for shape in shapes]
    everything = costs * layers
    if per_unit:
        teams = balance_teams(costs, ranks, limits) * layers  # (every layer alike: one balance serves each)
    else:
        teams = balance_teams(everything, ranks, limits * layers)
    slowest = 0
    for layer in range(layers):
        at = slice(layer * len(costs), (layer + 1) * len(costs))
        slowest += max(team_loads(everything[at], teams[at], ranks))
    return slowest * ranks / sum(everything)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,64,256")
    parser.add_argument("--model", default=json.dumps(LLAMA_70B), help="the model section, as JSON")
    args = parser.parse_args()
    shapes, layers = layer_shapes(ModelConfig.model_validate(json.loads(args.model)))
    print(f"# {layers} layers of {len(shapes)} matrices; max/mean Newton-Schulz FLOPs of a step (1.00: balanced)")
    print("| ranks | owners over every matrix | owners within each layer's step unit | ratio |")
    print("|---|---|---|---|")
    for ranks in map(int, args.ranks.split(",")):
        old, new = (slowest_over_mean(shapes, layers, ranks, per_unit) for per_unit in (False, True))
        print(f"| {ranks} | {old:.2f} | {new:.2f} | {old / new:.1f}x |")


if __name__ == "__main__":
    main()
