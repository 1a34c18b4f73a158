"""bf16 gradients accumulated and reduced in fp32 against DeepSpeed's default (the model's bf16).

``probe CASES``: one JSON line per case (a dict: ``zero`` the stage the engine runs, ``precision``,
``accum`` micro batches per step, ``steps``, ``deepspeed_default`` to drop the trainer's data types and keep
DeepSpeed's defaults): the optimizer DeepSpeed selects, the dtype gradients accumulate in over micro batches,
the one they are reduced in, and how far the weights moved from the fp32 run of the same batches
(``drift``: ||w - w_fp32|| / ||w_fp32 - w_start|| of the fp32 master weights; every run starts from the same
weights). Run it under
``torchrun`` for several data-parallel ranks.

``speed``: optimizer steps of the trainer's engine, fp32 accumulation against DeepSpeed's default, side by
side in one process (alternating rounds; the ratio is the median of per-round ratios).

    python bench/grad_precision.py probe '[{"zero": 0, "precision": "fp32"}, {"zero": 1, "precision": "bf16"}]'
    python bench/grad_precision.py speed --rounds 5 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatransformer.config import RunConfig  # noqa: E402
from megatransformer.training.engine import train_module as engine  # noqa: E402
from megatransformer.training.runtime.distributed import teardown  # noqa: E402


def run_config(zero: int, precision: str, accum: int, model: dict, micro: int, seq: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"n_heads": 4, "n_kv_heads": 2, "max_seq_len": seq, **model},
            "data": {"seq_len": seq},
            "train": {"micro_batch_size": micro, "grad_accum": accum, "grad_clip": 0.0},
            "optim": {"lr": 1e-2, "weight_decay": 0.0},
            "parallel": {"zero_stage": zero},
            "precision": precision,
        }
    )


def batches(vocab: int, micro: int, seq: int, rank: int):
    """The same endless sequence of random micro batches in every run (per rank)."""
    gen = torch.Generator().manual_seed(rank)
    for _ in itertools.count():
        ids = torch.randint(0, vocab, (micro, seq), generator=gen)
        yield {"input_ids": ids, "labels": ids.roll(-1, 1), "position_ids": torch.arange(seq).expand(micro, -1)}


@contextlib.contextmanager
def deepspeed_defaults(active: bool = True):
    """TrainModules built inside take DeepSpeed's default data types (bf16 accumulation and reduction)."""
    original = engine.deepspeed_config

    def config(*args, **kwargs):
        ds = original(*args, **kwargs)
        ds.pop("data_types", None)
        ds.pop("communication_data_type", None)
        return ds

    engine.deepspeed_config = config if active else original
    try:
        yield
    finally:
        engine.deepspeed_config = original


def accumulation_dtype(module: engine.TrainModule) -> str | None:
    """The dtype of the buffer gradients are summed into over micro batches (read after a non-boundary one;
    None where this does not know the optimizer's buffer, as for ZeRO-2 with bf16 accumulation)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer, buffer = module.engine.optimizer, None
    if isinstance(optimizer, BF16_Optimizer):
        buffer = optimizer.fp32_groups_gradients_flat[0]
    elif isinstance(optimizer, DeepSpeedZeroOptimizer):  # fp32 partitions, else bf16 ones (ZeRO-2)
        buffer = getattr(optimizer.averaged_gradients.get(0), "flat_partition", None)
        buffer = optimizer.grads_in_partition if buffer is None else buffer
    if buffer is None:  # ZeRO-0, and ZeRO-1 without a buffer of its own: autograd adds into param.grad
        buffer = next((p.grad for p in module.engine.module.parameters() if p.grad is not None), None)
    return None if buffer is None else str(buffer.dtype).removeprefix("torch.")


def masters(module: engine.TrainModule) -> torch.Tensor:
    """The fp32 weights the optimizer steps (bf16 runs: DeepSpeed's master copies), flattened."""
    from deepspeed.utils import safe_get_full_fp32_param

    optimizer = module.engine.optimizer
    zero0 = {}  # DeepSpeed's ZeRO-0 bf16 wrapper keeps its masters in groups parallel to the bf16 ones
    for bf16, fp32 in zip(getattr(optimizer, "fp16_groups", []), getattr(optimizer, "fp32_groups", [])):
        zero0 |= {id(p): master for p, master in zip(bf16, fp32)}
    found = []
    for p in module.engine.module.parameters():
        master = safe_get_full_fp32_param(p)
        found.append(zero0.get(id(p), p) if master is None else master)
    return torch.cat([m.detach().float().flatten() for m in found])


def emit(report: dict, out: Path | None) -> None:
    line = json.dumps(report)
    if out is None:
        print(line, flush=True)
    else:
        with out.open("a") as f:
            f.write(line + "\n")


def probe(cases: list[dict], out: Path | None) -> None:
    """Prints each case's report as a JSON line, or appends it to ``out`` (ranks share stdout: lines may mix)."""
    from megatransformer.training.runtime.distributed import setup

    dist_info = setup()
    start = fp32_moved = None
    for case in cases:
        case = {"accum": 8, "steps": 4, "deepspeed_default": False, **case}
        cfg = run_config(
            case["zero"],
            case["precision"],
            case["accum"],
            {"d_model": 32, "n_layers": 1, "d_ff": 64, "vocab_size": 128},
            micro=2,
            seq=32,
        )
        with deepspeed_defaults(case["deepspeed_default"]):
            module = engine.TrainModule(cfg, dist_info, zero_stage=case["zero"])
        start, data = masters(module), batches(128, 2, 32, dist_info.rank)
        for _ in range(case["steps"]):
            module.step(data)
        moved = masters(module)
        if case["precision"] == "fp32":
            fp32_moved = moved
        inputs, labels, masks = module.to_device(next(data))  # one more micro batch: not a boundary
        module.engine.backward(module.engine(**inputs, masks=masks, labels=labels))
        drift = None if fp32_moved is None else float((moved - fp32_moved).norm() / (fp32_moved - start).norm())
        report = {
            **case,
            "world": dist_info.world_size,
            "optimizer": type(module.engine.optimizer).__name__,
            "accumulates_in": accumulation_dtype(module),
            "reduces_in": str(module.engine.communication_data_type).removeprefix("torch."),
            "drift": drift,
        }
        if dist_info.rank == 0:
            emit(report, out)
        module.close()


def speed(args: argparse.Namespace) -> None:
    from megatransformer.training.runtime.distributed import setup

    dist_info = setup()
    if args.threads:
        torch.set_num_threads(args.threads)
    now = time.perf_counter if args.clock == "wall" else time.process_time
    model = {
        "d_model": args.d_model,
        "n_layers": args.layers,
        "d_ff": args.d_model * 3,
        "vocab_size": 8192,
        "norm": "rmsnorm",
        "position": "rope",
        "ffn": "swiglu",
    }
    modules = {}
    for zero, default in ((0, False), (1, True), (1, False), (2, True), (2, False)):
        cfg = run_config(zero, "bf16", args.accum, model, args.micro, args.seq)
        with deepspeed_defaults(default):
            name = f"zero{zero} " + ("bf16 accumulation" if default or zero == 0 else "fp32 accumulation")
            modules[name] = engine.TrainModule(cfg, dist_info, zero_stage=zero)
    data = batches(8192, args.micro, args.seq, dist_info.rank)
    for module in modules.values():
        module.step(data)  # warm-up
    seconds: dict[str, list[float]] = {name: [] for name in modules}
    for round_ in range(args.rounds):
        for name in modules if round_ % 2 == 0 else reversed(modules):
            start = now()
            for _ in range(args.steps):
                modules[name].step(data)
            seconds[name].append((now() - start) / args.steps)
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads; d{args.d_model} L{args.layers}, {args.accum} micro batches of {args.micro} x {args.seq} per "
        f"step, bf16, one rank; {args.rounds} rounds x {args.steps} steps, clock={args.clock}; "
        f"python {' '.join(sys.argv)}"
    )
    print("| engine | optimizer | s/step (median) | time vs zero1 bf16 accumulation (median of rounds) |")
    print("|---|---|---|---|")
    base = seconds["zero1 bf16 accumulation"]
    for name, times in seconds.items():
        ratio = statistics.median(t / b for t, b in zip(times, base))
        print(
            f"| {name} | {type(modules[name].engine.optimizer).__name__} | {statistics.median(times):.3f} | "
            f"{ratio:.3f}x |"
        )
    for module in modules.values():
        module.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    probe_args = sub.add_parser("probe")
    probe_args.add_argument("cases", help="JSON list of cases")
    probe_args.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file")
    s = sub.add_parser("speed")
    s.add_argument("--d-model", type=int, default=256)
    s.add_argument("--layers", type=int, default=4)
    s.add_argument("--micro", type=int, default=4)
    s.add_argument("--seq", type=int, default=256)
    s.add_argument("--accum", type=int, default=8)
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--steps", type=int, default=2)
    s.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    s.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: process CPU time, immune to other processes' load (use with --threads 1)",
    )
    args = p.parse_args()
    if args.command == "probe":
        probe(json.loads(args.cases), args.out)
    else:
        speed(args)
    teardown()


if __name__ == "__main__":
    main()
