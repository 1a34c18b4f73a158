"""What the command's end saves: a short `megatransformer train` process timed from its start to its exit, ended as
the command ends it (``cli.command``: every object frozen out of the garbage collector, then the interpreter's
shutdown) and ended as a plain ``sys.exit(main())`` (whose shutdown collections walk all that PyTorch and
DeepSpeed loaded), side by side: the same run, the two alternating, the order reversed every other round.

    megatransformer quickstart train.max_steps=2 wandb.mode=disabled        # its data, under runs/quickstart/data
    OMP_NUM_THREADS=1 python bench/process_end.py --rounds 6
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = "model.d_model=64 model.n_layers=2 model.n_heads=4 model.n_kv_heads=2 model.d_ff=96 train.max_steps=2"
ENDS = {
    "command": [sys.executable, "-m", "megatransformer.cli"],
    "sys.exit(main())": [sys.executable, "-c", "import sys; from megatransformer.cli import main; sys.exit(main())"],
}


def seconds(start: list[str], args: argparse.Namespace, run_dir: Path) -> float:
    """Wall seconds of one training process, start-up to exit."""
    shutil.rmtree(run_dir, ignore_errors=True)
    command = [*start, "train", "--config", args.config, *args.overrides, f"run_dir={run_dir}", "wandb.mode=disabled"]
    began = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=os.environ)
    took = time.perf_counter() - began
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\nexit {result.returncode}\n{result.stderr[-3000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.yaml", help="the run's YAML")
    parser.add_argument("--rounds", type=int, default=6, help="runs of each end, alternating")
    parser.add_argument("overrides", nargs="*", default=TINY.split(), help=f"key.path=value (default: {TINY})")
    args = parser.parse_args()
    times: dict[str, list[float]] = {end: [] for end in ENDS}
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.rounds):
            for end in list(ENDS)[:: 1 if round_ % 2 == 0 else -1]:
                times[end].append(seconds(ENDS[end], args, Path(work) / "run"))
            print(f"round {round_ + 1}: " + ", ".join(f"{end} {times[end][-1]:.2f} s" for end in ENDS), flush=True)
    medians = {end: statistics.median(values) for end, values in times.items()}
    saved = medians["sys.exit(main())"] - medians["command"]
    print("| end | median s a process | per round |")
    print("|---|---|---|")
    for end, values in times.items():
        print(f"| {end} | {medians[end]:.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    print(f"the command's end saves {saved:.2f} s a process ({saved / medians['sys.exit(main())']:.0%})")


if __name__ == "__main__":
    main()
