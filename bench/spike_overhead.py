"""What spike detection (loss and gradient norm) and the hang watchdog cost per step: one ``TrainModule``
stepped side by side plain (``spikes`` unset, no watchdog) and guarded (the default ladder, the
watchdog armed and disarmed around the step), in alternating rounds; plus the host time of the two alone per
step. ``--zero`` picks the engine's ZeRO stages (one rank): without ZeRO the step judges before DeepSpeed's
step, with it inside, once ZeRO has computed the gradient norm.

    python bench/spike_overhead.py --modes fp32 --zero 0 --rounds 7 --steps 5 --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_step  # noqa: E402
from engine_overhead import host_batches, run_config  # noqa: E402


def main() -> int:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--zero", default="0", help="comma list of ZeRO stages to time the engine at (one rank)")
    args = train_step.parse_args(sys.argv[1:], parents=(own,))
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    from megatransformer.training.engine.train_module import TrainModule
    from megatransformer.training.observability.spikes import SpikeLadder
    from megatransformer.training.observability.watchdog import Watchdog
    from megatransformer.training.runtime.distributed import setup

    dist_info = setup()
    print(
        f"# spike + watchdog overhead: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"d{args.d_model} L{args.layers} V{args.vocab}, batch {args.batch} x {args.seq}, {args.clock} clock"
    )
    print(
        "| mode | ZeRO | plain s/step | guarded s/step | guarded / plain time | detection + watchdog alone, us/step |"
    )
    print("|---|---|---|---|---|---|")
    for mode, zero in [(mode, int(z)) for mode in args.modes.split(",") for z in args.zero.split(",")]:
        cfg = run_config(args, mode).model_copy(update={"run_dir": tempfile.mkdtemp()})
        module = TrainModule(cfg, dist_info, zero_stage=zero)
        batches = host_batches(*train_step.make_batch(cfg.model, args))
        ladder, watchdog = SpikeLadder(cfg.train.spikes), Watchdog(cfg, 0)
        first = module.step(batches)
        # full windows around this model's own loss and norm: the statistics are recomputed every step, and the
        # guarded steps are judged, not refused (a refused step would skip the optimizer's update)
        noise = np.random.default_rng(0).standard_normal((cfg.train.spikes.window, 2))
        for a, b in noise:
            ladder.rejects(first.loss * (1 + 0.01 * a), first.grad_norm * (1 + 0.05 * b))
        refused = []

        def guarded():
            watchdog.arm()
            result = module.step(batches, spikes=ladder)
            watchdog.disarm(0.1)
            refused.append(result.rejected)
            return result

        runners = {"plain": lambda: module.step(batches), "guarded": guarded}
        for run in runners.values():
            for _ in range(args.warmup):
                run()
        times: dict[str, list[float]] = {name: [] for name in runners}
        ratios = []
        for round_ in range(args.rounds):
            order = list(runners) if round_ % 2 == 0 else list(reversed(runners))
            per_round = {}
            for name in order:
                start = clock()
                for _ in range(args.steps):
                    runners[name]()
                per_round[name] = (clock() - start) / args.steps
                times[name].append(per_round[name])
            ratios.append(per_round["guarded"] / per_round["plain"])
        if any(refused):
            print(f"# {mode} ZeRO-{zero}: {sum(refused)} of {len(refused)} guarded steps refused", flush=True)
        start, n = clock(), 20_000
        for i in range(n):
            watchdog.arm()
            ladder.rejects(5.0 + 1e-4 * (i % 7), 1.0 + 1e-3 * (i % 5))
            watchdog.disarm(0.1)
        alone = (clock() - start) / n * 1e6
        watchdog.close()
        plain, guarded_ = (statistics.median(times[name]) for name in ("plain", "guarded"))
        print(
            f"| {mode} | {zero} | {plain:.4f} | {guarded_:.4f} | {statistics.median(ratios):.3f}x | {alone:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
