"""One ZeRO-3 rank's initial values at scale: the time ``transformer.draw_part_into`` takes to draw the partitions
one rank of ``--dp`` holds, for blocks of ``--blocks`` elements (``INIT_BLOCK_ELEMENTS``) and ``--threads`` intra-op
threads (which draw the blocks at once), side by side.

A rank draws the blocks of rows that hold its partition of each parameter, whole. Where a partition is smaller than
a block (a 70B model's matrices over hundreds of ranks), it draws one or two blocks for it; this times that on one
process, the model made on the meta device (its names and shapes; nothing whole is made), for the first, a middle
and the last rank. Prints one row per setting: the slowest of those ranks' seconds, the elements it drew and its
own.

    python bench/init_draws.py --dp 64 256 512 --blocks 4194304 262144 --threads 1 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time

import torch

from megatransformer.config import ModelConfig
from megatransformer.model import transformer

# Llama-2-70B's shapes
MODEL = {
    "d_model": 8192,
    "n_layers": 80,
    "n_heads": 64,
    "n_kv_heads": 8,
    "d_ff": 28672,
    "vocab_size": 32000,
    "max_seq_len": 4096,
    "norm": "rmsnorm",
    "position": "rope",
    "ffn": "swiglu",
    "tie_embeddings": False,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1 << 22, 1 << 18])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--model", default=json.dumps(MODEL), help="the model section, as JSON")
    return parser.parse_args()


def rank_draws(params: list[tuple[str, torch.Size, float | None]], dp: int, rank: int) -> tuple[float, int, int]:
    """(seconds, elements drawn, elements owned) of rank ``rank`` of ``dp`` drawing its partitions in bf16."""
    sizes: list[int] = []  # (appended to from the drawing threads)
    original = transformer._drawn

    def counted(seed, name, std, block, shape):
        sizes.append(math.prod(shape))
        return original(seed, name, std, block, shape)

    transformer._drawn = counted
    owned, seconds = 0, 0.0
    try:
        for name, shape, std in params:
            part = -(-math.prod(shape) // dp)
            target = torch.empty(part, dtype=torch.bfloat16)
            begin = time.perf_counter()
            transformer.draw_part_into(target, 0, name, std, shape, start=rank * part)
            seconds += time.perf_counter() - begin
            owned += max(0, min(part, math.prod(shape) - rank * part))
    finally:
        transformer._drawn = original
    return seconds, sum(sizes), owned


def main() -> None:
    args = parse_args()
    cfg = ModelConfig.model_validate(json.loads(args.model))
    with torch.device("meta"):
        model = transformer.construct(cfg)
    params = [(name, param.shape, std) for name, param, std in transformer.initial_values(model, cfg)]
    whole = sum(math.prod(shape) for _, shape, _ in params)
    print(f"# {whole / 1e9:.2f}B drawn parameters, torch {torch.__version__}")
    print("| dp | block (elements) | threads | seconds, slowest of 3 ranks | drawn (M) | own (M) | drawn / own |")
    print("|---|---|---|---|---|---|---|")
    for dp, block, threads in itertools.product(args.dp, args.blocks, args.threads):
        transformer.INIT_BLOCK_ELEMENTS = block
        torch.set_num_threads(threads)
        seconds, drawn, owned = max(rank_draws(params, dp, rank) for rank in (0, dp // 2, dp - 1))
        millions = f"{drawn / 1e6:,.0f} | {owned / 1e6:,.0f}"
        print(f"| {dp} | {block:,} | {threads} | {seconds:.2f} | {millions} | {drawn / owned:.2f} |", flush=True)


if __name__ == "__main__":
    main()
