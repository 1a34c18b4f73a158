"""A stalled rank of two (SIGSTOP) leaves a Python stack dump per rank, each naming where its rank waited,
and every rank exits non-zero, the exit lines naming the dumps and the ranks that wrote none (a stopped rank
cannot answer). Real `megatransformer train` ranks."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from support.runs import spawn_ranks, tiny_data_overrides, tiny_model, wait_for_step, wait_ranks

from megatransformer.training.observability.watchdog import stack_dumps
from megatransformer.training.runtime.distributed import EXIT_COLLECTIVE_FAILED

TIMEOUT_S = 30  # parallel.timeout_minutes=0.5


def test_a_stalled_rank_leaves_a_stack_dump_per_rank_and_every_rank_exits_non_zero(tiny_data, tmp_path):
    run, log = tmp_path / "run", tmp_path / "train"
    overrides = [
        *tiny_model(),
        *tiny_data_overrides(tiny_data),
        f"run_dir={run}",
        "data.seq_len=64",
        "train.micro_batch_size=4",
        "train.grad_accum=1",
        "train.log_every=1",
        "train.max_steps=100000",
        "parallel.timeout_minutes=0.5",
        "train.watchdog.min_seconds=3",
        "wandb.mode=disabled",
    ]
    ranks = spawn_ranks(overrides, log)
    try:
        wait_for_step(run, 5, ranks, Path(f"{log}.rank0.log"))
        ranks[1].send_signal(signal.SIGSTOP)
        stalled = time.monotonic()
        codes = wait_ranks(ranks[:1], log)  # rank 0's watchdog writes, then its collective times out
        waited = time.monotonic() - stalled
        ranks[1].send_signal(signal.SIGCONT)  # rank 1's watchdog is overdue: it writes at once; its peer is gone
        codes += wait_ranks(ranks[1:], log)
    finally:
        for rank in ranks:
            rank.kill()
    said = [Path(f"{log}.rank{r}.log").read_text() for r in range(2)]
    assert codes[0] == EXIT_COLLECTIVE_FAILED and codes[1] != 0, (codes, said[0][-3000:])
    # the live rank ends with its collective's timeout, not later (slack: start-up of the exit, a loaded machine)
    assert waited < 3 * TIMEOUT_S, waited
    dumps = stack_dumps(run)
    assert [d.name for d in dumps] == ["rank_00000.txt", "rank_00001.txt"], said[0][-3000:]
    # rank 0's names where it waited: a step of the training loop; rank 1's too, unless, woken, its main thread
    # met its gone peer's closed connection before the overdue watchdog wrote (then: the failure being handled)
    first, second = (dump.read_text() for dump in dumps)
    assert "in advance" in first and "loop.py" in first, first
    assert ("in advance" in second and "loop.py" in second) or "in collective_failure" in second, second
    line = next(line for line in said[0].splitlines() if "error: rank 0:" in line)
    assert "timed out" in line and f"{run / 'hangs'}/ (rank_00000.txt)" in line
    assert "rank 1 wrote no stacks (stopped or gone" in line  # (it was stopped when rank 0 exited)
