"""``megatransformer info``: the resolved config, parameter counts, training FLOPs per token, and the layout:
which part of each sequence every rank holds and an estimate of its activation memory."""

from __future__ import annotations

import argparse
import json

from megatransformer.commands.arguments import add_config_argument
from megatransformer.config import ConfigError, RunConfig, dump_config, load_config
from megatransformer.console import to_stderr


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "info",
        help="show a config's resolved values, parameters and FLOPs/token",
        description="Print a config with every default filled in and the overrides "
        "applied, and its model's parameter count and FLOPs per token.",
    )
    add_config_argument(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="ranks of the run (default: parallel.tensor_parallel x sequence_parallel)",
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. model.n_layers=4"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatransformer.training.runtime.layout import data_parallel_size

    cfg = load_config(args.config, args.overrides)
    data_parallel_size(cfg, args.world_size or cfg.parallel.tensor_parallel * cfg.parallel.sequence_parallel)
    # (the counts need PyTorch, tens of seconds to load on a busy machine)
    to_stderr(f"info: {cfg.run_dir}: counting parameters and FLOPs (loading PyTorch)")
    from megatransformer.flops import attention_costs, model_size
    from megatransformer.planner import BYTES

    size = model_size(cfg.model, cfg.data.seq_len)
    attention = attention_costs(cfg.model, cfg.data.seq_len)
    layout = describe(cfg, args.world_size or cfg.parallel.tensor_parallel * cfg.parallel.sequence_parallel)
    if args.json:
        kinds = [
            {**cost.as_dict(), "kv_cache_bytes_per_token": _cache_bytes(cost, BYTES[cfg.precision])}
            for cost in attention
        ]
        print(
            json.dumps(
                {"config": cfg.model_dump(mode="json"), **size.as_dict(), "attention": kinds, "layout": layout},
                indent=2,
            )
        )
        return 0
    print(f"parameters:               {size.params:,} ({size.params / 1e6:.2f} M)")
    print(f"non-embedding parameters: {size.non_embedding_params:,} ({size.non_embedding_params / 1e6:.2f} M)")
    print(f"training FLOPs per token: {size.flops_per_token:.4g} (seq_len {size.seq_len})")
    for cost in attention:
        cache = _cache_bytes(cost, BYTES[cfg.precision])
        per = "source token, once" if cost.kind.startswith("cross") else "token"
        held = "no KV cache" if cache is None else f"KV cache {cache:,} bytes per {per} ({cfg.precision})"
        print(
            f"{'attention ' + cost.kind + ':':<25} {cost.params:,} parameters in {cost.layers} layers, "
            f"{cost.flops_per_token:.4g} training FLOPs per token, {held}"
        )
    world = layout["world_size"]
    micro = layout["micro_batch"]
    print(f"layout:                   {layout['layout']} on {world} rank{'s' if world != 1 else ''}")
    for rank in layout["sequence_ranks"]:
        first, last = rank["positions"]
        heads = rank["attention_heads"]
        print(
            f"  sequence rank {rank['rank']}:        positions {first}-{last} of each row; attention over all "
            f"{cfg.data.seq_len} for heads {heads[0]}-{heads[1]}"
        )
    rows = f"micro batch of {micro} rows" if micro else "row (the micro batch depends on the launch)"
    print(f"activations per rank:     ~{layout['activation_bytes'] / 2**20:,.1f} MiB per {rows} (estimate)")
    print("                          (megatransformer plan: all of a rank's memory, by part, for each layout)")
    print("--- the config, every default filled in:")
    print(dump_config(cfg), end="")
    return 0


def describe(cfg: RunConfig, world_size: int) -> dict:
    """The layout on ``world_size`` ranks: data-parallel x tensor x sequence degrees, the positions and attention
    heads each rank of a sequence group holds (the same on every group), and the activation memory of a micro
    batch per rank (of one row when the train section leaves the micro batch to the launch)."""
    from megatransformer.planner import Layout, activation_parts
    from megatransformer.training.runtime.layout import data_parallel_size, describe_layout, resolve_batch_sizes

    p, length = cfg.parallel, cfg.data.seq_len
    dp = data_parallel_size(cfg, world_size)
    try:
        micro = resolve_batch_sizes(cfg.train, dp).micro
    except ConfigError:
        micro = None
    sp, heads = p.sequence_parallel, cfg.model.n_heads
    ranks = [
        {
            "rank": r,
            "positions": [r * length // sp, (r + 1) * length // sp - 1],
            "attention_heads": [r * heads // sp, (r + 1) * heads // sp - 1],
        }
        for r in range(sp)
    ]
    layout = Layout(
        dp,
        p.tensor_parallel,
        sp,
        p.zero_stage,
        cfg.model.activation_checkpointing,
        cfg.model.mlp_tiles,
        p.offload_optimizer,
        micro or 1,
        1,
    )
    return {
        "layout": describe_layout(dp, p.tensor_parallel, sp),
        "world_size": world_size,
        "micro_batch": micro,
        "sequence_ranks": ranks,
        "activation_bytes": activation_parts(cfg, layout, "cpu")["activations"],
    }


def _cache_bytes(cost, value_bytes: int) -> int | None:
    return None if cost.kv_cache_values_per_token is None else cost.kv_cache_values_per_token * value_bytes
