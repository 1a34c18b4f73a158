"""The planner's start and steady peaks per rank for Llama-2 7B and 70B shapes on 8, 64 and 512 H100s: the first
choice and the fastest ZeRO-3 layout, GiB per rank at each moment (docs/planner.md's table).

    python bench/plan_start.py
"""

from __future__ import annotations

from megatransformer.config import load_config
from megatransformer.planner import GIB, find_gpu, plan

SHAPES = {
    "7B": dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008, vocab_size=32000),
    "70B": dict(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, vocab_size=32000),
}
RUN = ["model.max_seq_len=4096", "data.seq_len=4096", "train.micro_batch_size=1", "train.global_batch_size=512"]


def row(name: str, gpus: int, planned) -> str:
    peaks = planned.peaks
    cells = [
        name,
        str(gpus),
        planned.layout.describe() + ("" if planned.fits else " (does not fit)"),
        f"{peaks['construction'].device / GIB:.1f}",
        f"{peaks['engine_start'].device / GIB:.1f}",
        f"{peaks['loading'].device / GIB:.1f} / {peaks['loading'].host / GIB:.1f}",
        f"{peaks['step'].device / GIB:.1f}",
        f"{planned.host_bytes / GIB:.1f}",
        f"{planned.step_seconds:.3g}",
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    h100 = find_gpu("H100")
    print("| model | GPUs | layout | construction | engine start | loading (device / host) | step | host | s/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        cfg = load_config("llama-style", [f"model.{k}={v}" for k, v in shape.items()] + RUN)
        for gpus in (8, 64, 512):
            result = plan(cfg, h100, gpus, 8, None, cfg.train.global_batch_size)
            first = result.layouts[0]
            zero3 = next(p for p in result.layouts if p.layout.zero == 3)
            print(row(name, gpus, first))
            if zero3 is not first:
                print(row(name, gpus, zero3))


if __name__ == "__main__":
    main()
