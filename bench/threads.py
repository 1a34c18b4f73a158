"""Intra-op threads on a shared machine: the same training steps of the quickstart model (a bare PyTorch loop,
nanoGPT's shape: forward, cross-entropy, backward, AdamW) in a fresh process per variant:

  default        OMP_NUM_THREADS unset: torch's own choice
  omp=N          OMP_NUM_THREADS=N in the environment (what torchrun sets: 1)
  set=N          OMP_NUM_THREADS unset, torch.set_num_threads(N) at start (what the trainer does when it
                 picks its threads: training/threads.py)
  picked         OMP_NUM_THREADS unset, training/threads.py's choice from the cores and the load
  V+passive      variant V with OMP_WAIT_POLICY=PASSIVE (libgomp's idle threads sleep at once instead of
                 spinning; what the CLI sets on a busy machine); V+active: OMP_WAIT_POLICY=ACTIVE. Without
                 either the child runs with neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT (libgomp's default)

Rounds alternate the variants (the order reversed every other round), so that the background load hits all
alike; the table gives each variant's median seconds per step and its ratio to ``default`` from the same
rounds. On a machine shared with other work, only the ratios mean anything, and those only for that load.

    python bench/threads.py                       # 3 rounds of 6 steps, variants default omp=1 omp=2 set=1 set=2 picked
    python bench/threads.py --rounds 5 --steps 10
    python bench/threads.py --background 1 --variants set=2,set=1,picked   # beside 1 busy process of other work
    python bench/threads.py --variants omp=1,omp=1+passive,omp=2,omp=2+passive   # the wait policy's cost

``--background K`` keeps K processes busy (a Python loop each, no threads of their own) for the whole run: a
known load instead of whatever else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("default", "omp=1", "omp=2", "set=1", "set=2", "picked")

CHILD = """
import json, sys, time
import torch
variant, steps = sys.argv[1], int(sys.argv[2])
if variant.startswith("set="):
    torch.set_num_threads(int(variant[4:]))
elif variant == "picked":
    from megatransformer.training.threads import set_threads_for_machine
    set_threads_for_machine()
from megatransformer.config import load_config
from megatransformer.model import build_model
cfg = load_config("quickstart")
torch.manual_seed(0)
model = build_model(cfg.model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, cfg.model.vocab_size, (16, 129))
times = []
for step in range(steps + 1):
    started = time.perf_counter()
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - started)
print(json.dumps({"threads": torch.get_num_threads(), "seconds": times[1:]}))
"""


def run(variant: str, steps: int) -> dict:
    variant, _, policy = variant.partition("+")
    unset = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    if variant.startswith("omp="):
        env["OMP_NUM_THREADS"] = variant[4:]
    if policy:
        env["OMP_WAIT_POLICY"] = policy.upper()
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, variant, str(steps)], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def busy_processes(count: int):
    """``count`` processes spinning on a core each until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--background", type=int, default=0, help="busy processes of other work beside the runs")
    args = parser.parse_args()
    variants = args.variants.split(",")
    seconds = {v: [] for v in variants}
    threads = {}
    loads = []
    with busy_processes(args.background):
        for round_ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for variant in variants if round_ % 2 == 0 else variants[::-1]:
                result = run(variant, args.steps)
                seconds[variant].append(statistics.median(result["seconds"]))
                threads[variant] = result["threads"]
    base = statistics.median(seconds[variants[0]])
    cores = len(os.sched_getaffinity(0))
    print(
        f"cores usable {cores}, {args.background} busy processes beside the runs, load average during the rounds "
        f"{min(loads):.1f}-{max(loads):.1f}"
    )
    print(f"{'variant':14s} {'threads':>7s} {'s/step':>8s} {'vs ' + variants[0]:>12s}  s/step of each round")
    for variant in variants:
        median = statistics.median(seconds[variant])
        rounds = " ".join(f"{s:.3f}" for s in seconds[variant])
        print(f"{variant:14s} {threads[variant]:7d} {median:8.3f} {base / median:11.2f}x  {rounds}")


if __name__ == "__main__":
    main()
