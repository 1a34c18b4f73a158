"""A 2-rank gloo group with DeepSpeed's engine (ZeRO-2, one step) ends with no communication thread left and
the interpreter's normal shutdown, again and again: a thread of a group still running there now and then aborted
a rank ("terminate called without an active exception")."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from plan_memory import free_port, host_batch, join, run_config  # noqa: E402

MODEL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=512, attention_backend="chunked")
POINT = {"model": MODEL | {"max_seq_len": 128}, "seq_len": 128, "micro_batch": 2, "zero": 2, "ranks": 2}
GROUPS = 6  # started and ended, each in two fresh processes (10-35 s each on 2 cores, quiet to busy)
COMMUNICATION_THREADS = ("gloo", "pt_gloo", "pt_tcpstore")  # (names of gloo's and the TCP store's threads)


def _threads() -> list[str]:
    return sorted(Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task"))


def _rank(rank: int, port: int, out: str) -> None:
    from megatransformer.training.distributed import teardown
    from megatransformer.training.engine import TrainModule

    cfg = run_config(POINT)
    module = TrainModule(cfg, join(rank, 2, port))
    module.step(itertools.repeat(host_batch(cfg)))
    during = _threads()
    module.close()
    teardown()
    Path(out, f"{rank}.json").write_text(json.dumps({"during": during, "after": _threads()}))
    # returns into the interpreter's shutdown (mp.spawn raises if a rank ends by a signal)


def test_a_group_ends_with_no_thread_of_it_left_and_a_normal_shutdown(tmp_path):
    for group in range(GROUPS):
        out = tmp_path / str(group)
        out.mkdir()
        mp.spawn(_rank, args=(free_port(), str(out)), nprocs=2)
        for rank in range(2):
            threads = json.loads((out / f"{rank}.json").read_text())
            assert any(name.startswith(COMMUNICATION_THREADS) for name in threads["during"]), threads
            left = [name for name in threads["after"] if name.startswith(COMMUNICATION_THREADS)]
            assert not left, f"group {group}, rank {rank}: threads left after teardown: {left}"
