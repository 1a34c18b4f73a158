"""Where a training rank's resident memory grows: a rank of ``megatransformer`` run with a thread that samples its
resident set every 10 ms and, at each new high (``--step`` MiB above the last), writes the growth since the imports
and where the main thread was (its frames in this project and in DeepSpeed, innermost first) to ``OUT/rss.RANK``;
the last line is the growth at the end.

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu python -m torch.distributed.run --standalone --nproc_per_node=8 \\
        --no-python python bench/rss_highs.py /tmp/highs train --config run.yaml parallel.zero_stage=3

What it found (8 ZeRO-3 ranks, a 99M decoder): BENCHMARKS.md section 5ai.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

import deepspeed  # noqa: F401  (what a training rank imports before its model: not counted)
import torch  # noqa: F401
import torch._dynamo  # noqa: F401

import megatransformer.cli
import megatransformer.training.engine.train_module  # noqa: F401

STEP_MIB = 15


def resident_mib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) // 1024


def where(thread_id: int) -> str:
    frames = traceback.extract_stack(sys._current_frames()[thread_id])
    own = [f for f in frames if "megatransformer" in f.filename or "deepspeed" in f.filename][-6:]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(own))


def sample(log, base: int, main: int) -> None:
    high = base
    while True:
        now = resident_mib()
        if now > high + STEP_MIB:
            high = now
            log.write(f"{now - base:6d} MiB  {where(main)}\n")
            log.flush()
        time.sleep(0.01)


def main() -> None:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    out.mkdir(parents=True, exist_ok=True)
    base = resident_mib()
    log = open(out / f"rss.{os.environ.get('RANK', '0')}", "w")
    threading.Thread(target=sample, args=(log, base, threading.main_thread().ident), daemon=True).start()
    code = megatransformer.cli.main(args)
    log.write(f"end {resident_mib() - base} MiB\n")
    log.close()
    megatransformer.cli.end_process(code)


if __name__ == "__main__":
    main()
