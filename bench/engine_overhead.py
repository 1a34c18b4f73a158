"""The training engine against the bare model step: what DeepSpeed and our step add around the model.

``ours-engine``: one optimizer step of ``megatransformer.training.engine.train_module.TrainModule`` (DeepSpeed engine,
ZeRO-0, the run's precision, fused AdamW, host-built attention metadata, loss normalisation, the finite check)
on host batches as the loader delivers them. ``ours-bare``: ``bench/train_step.py``'s Runner with the same
model, weights, batch and optimizer work, no engine around it (for bf16: fp32 master weights, as DeepSpeed).
``hf``: transformers' LlamaForCausalLM in the same Runner, with bf16 autocast (a plain HF loop).
Runs alternate (each runner once per round, the order reversed on odd rounds); the table reports median step
times and the median per-round ratios.

    python bench/engine_overhead.py --modes fp32,bf16 --rounds 5 --steps 3
    python bench/engine_overhead.py --modes fp32,bf16 --zero 0,1,2   # ZeRO's cost on one rank
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_step  # noqa: E402

from megatransformer.config import RunConfig  # noqa: E402


def run_config(args: argparse.Namespace, mode: str) -> RunConfig:
    model = train_step.model_config(args).model_dump()
    model["attention_backend"] = "auto"
    return RunConfig.model_validate(
        {
            "model": model,
            "data": {"seq_len": args.seq},
            "train": {"micro_batch_size": args.batch, "grad_accum": 1},
            "optim": {"lr": 1e-4, "weight_decay": 0.1},
            "parallel": {"zero_stage": 0},
            "precision": mode,
        }
    )


def host_batches(input_ids: torch.Tensor, labels: torch.Tensor):
    """The loader's batch format (one document per row: segments and positions as packing writes them)."""
    for _ in itertools.count():
        yield {
            "input_ids": input_ids,
            "labels": labels,
            "segment_ids": torch.ones_like(input_ids),
            "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids).contiguous(),
        }


def main() -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--zero", default="0", help="comma list of ZeRO stages to time the engine at (one rank)")
    args = train_step.parse_args(sys.argv[1:], parents=(own,))
    from megatransformer.training.engine.train_module import TrainModule
    from megatransformer.training.runtime.distributed import setup

    dist_info = setup()
    modes, stages = args.modes.split(","), [int(z) for z in args.zero.split(",")]
    print(
        f"# engine overhead: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, d{args.d_model} L{args.layers} H{args.heads} KV{args.kv_heads} "
        f"FFN{args.ffn} V{args.vocab}, batch {args.batch} x {args.seq}"
    )
    print("| mode | runner | s/step (median) | speed vs bare | speed vs hf autocast |")
    print("|---|---|---|---|---|")
    for mode in modes:
        cfg = run_config(args, mode)
        input_ids, labels = train_step.make_batch(cfg.model, args)
        # (the stage forced, as probes do: on one rank the trainer itself runs ZeRO-1/2 as 0, engine_zero_stage)
        modules = {f"engine-z{z}": TrainModule(cfg, dist_info, zero_stage=z) for z in stages}
        bare_model = train_step.build_model(cfg.model)
        first = next(iter(modules.values()))
        bare_model.load_state_dict({k: v.float() for k, v in first.engine.module.state_dict().items()})
        bare = train_step.Runner("ours", bare_model, mode, args.device, False)
        hf_args = argparse.Namespace(**{**vars(args), "backends": "chunked"})
        hf = train_step.build_runners(
            cfg.model.model_copy(update={"attention_backend": "chunked"}), "autocast", hf_args
        )["hf"]
        batches = host_batches(input_ids, labels)
        runners = {name: (lambda m=module: m.step(batches)) for name, module in modules.items()}
        runners |= {"bare": lambda: bare.step(input_ids, labels), "hf": lambda: hf.step(input_ids, labels)}
        for run in runners.values():
            for _ in range(args.warmup):
                run()
        times: dict[str, list[float]] = {name: [] for name in runners}
        for round_ in range(args.rounds):
            order = list(runners) if round_ % 2 == 0 else list(reversed(runners))
            for name in order:
                for _ in range(args.steps):
                    start = time.perf_counter()
                    runners[name]()
                    times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) for name, t in times.items()}
        for name in runners:
            print(
                f"| {mode} | {name} | {med[name]:.3f} | {med['bare'] / med[name]:.3f}x | "
                f"{med['hf'] / med[name]:.3f}x |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
