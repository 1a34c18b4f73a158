"""The ranks of a 2-rank gloo group end with no communication thread left and the interpreter's normal shutdown,
again and again: a C++ thread of a group still running there may abort a rank ("terminate called without an
active exception"). A group here is DeepSpeed's engine (ZeRO-2) and one step; a run is `megatransformer train`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from support import REPO
from support.runs import ONE_THREAD, free_port, tiny_data_overrides, tiny_model

GROUPS = 30  # started and ended, each in two processes of their own
COMMUNICATION_THREADS = ("gloo", "pt_gloo", "pt_tcpstore")  # (names of gloo's and the TCP store's threads)

# Each rank starts as a child of one process that imported everything once (a rank's own imports would be most
# of its cost: DeepSpeed's ZeRO step alone pulls in torch.compile's stack), forked while that process holds its
# main thread only, so that the child is what a fresh rank is. The child runs its rank, then leaves the loop and
# ends as the `megatransformer` command does (`cli.end_process`: the interpreter's shutdown, never os._exit, as
# multiprocessing's forked children end). Each group's wait statuses go to OUT/statuses.json (negative: ended by
# that signal).
GROUPS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path

    import torch
    import deepspeed.runtime.zero.muon.muon_optimizer  # (ZeRO's step imports it)

    from megatransformer.cli import end_process
    from megatransformer.config import RunConfig
    from megatransformer.training.runtime.distributed import setup, teardown
    from megatransformer.training.engine.train_module import TrainModule
    from support.runs import free_port, thread_names as threads

    sys.path.insert(0, "bench")
    from step_probe import batches

    def start_groups(groups, out):
        \"\"\"In a rank's child: (rank, port, directory); in this process, once every group has ended: None.\"\"\"
        statuses = []
        for group in range(groups):
            if len(threads()) != 1:
                sys.exit(f"a forked rank would lack threads this process runs: {threads()}")
            port, directory = free_port(), out / str(group)
            directory.mkdir()
            children = []
            for rank in range(2):
                child = os.fork()
                if child == 0:
                    return rank, port, directory
                children.append(child)
            statuses.append([os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) for child in children])
        (out / "statuses.json").write_text(json.dumps(statuses))
        return None

    def run_rank(rank, port, directory):
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), MASTER_PORT=port)
        torch.set_num_threads(1)
        cfg = RunConfig.model_validate({
            "model": dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, vocab_size=64, max_seq_len=16),
            "data": {"seq_len": 16}, "train": {"micro_batch_size": 2, "grad_accum": 1},
            "parallel": {"zero_stage": 2}, "run_dir": str(directory)})
        module = TrainModule(cfg, setup())
        module.step(batches(64, 2, 16, prefix=False))
        during = threads()
        module.close()
        teardown()
        (directory / f"rank{rank}.json").write_text(json.dumps({"during": during, "after": threads()}))

    child = start_groups(int(sys.argv[1]), Path(sys.argv[2]))
    if child is not None:
        run_rank(*child)
        end_process(0)
""")


def test_a_group_ends_with_no_thread_of_it_left_and_a_normal_shutdown(tmp_path):
    script, out = tmp_path / "groups.py", tmp_path / "groups"
    script.write_text(GROUPS_SCRIPT)
    out.mkdir()
    env = {
        **os.environ,
        **ONE_THREAD,
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
        "DS_ACCELERATOR": "cpu",
        **dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1"),
    }
    done = subprocess.run(
        [sys.executable, str(script), str(GROUPS), str(out)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-5000:]
    statuses = json.loads((out / "statuses.json").read_text())
    assert len(statuses) == GROUPS
    for group, codes in enumerate(statuses):
        assert codes == [0, 0], f"group {group}: exit statuses {codes} (-6: SIGABRT)\n{done.stderr[-5000:]}"
        for rank in range(2):
            threads = json.loads((out / str(group) / f"rank{rank}.json").read_text())
            assert any(name.startswith(COMMUNICATION_THREADS) for name in threads["during"]), threads
            left = [name for name in threads["after"] if name.startswith(COMMUNICATION_THREADS)]
            assert not left, f"group {group}, rank {rank}: threads left after teardown: {left}"


# `megatransformer train` with the names of its threads written when the interpreter's shutdown runs the exit
# handlers (os._exit skips them): RANK_THREADS_DIR/rank{RANK}.json
TRAIN_AND_LIST_THREADS = textwrap.dedent("""
    import atexit, json, os, sys
    from pathlib import Path

    from megatransformer.cli import main
    from support.runs import thread_names

    def write_threads():
        names = thread_names()
        Path(os.environ["RANK_THREADS_DIR"], f"rank{os.environ['RANK']}.json").write_text(json.dumps(names))

    atexit.register(write_threads)
    sys.exit(main(sys.argv[1:]))
""")


def test_a_two_rank_run_ends_on_both_ranks_through_the_interpreters_shutdown(tiny_data, tmp_path):
    """Each rank of a finished `megatransformer train` run exits 0 through the interpreter's shutdown, every
    thread of its process groups ended before it."""
    script, run, threads = tmp_path / "train.py", tmp_path / "run", tmp_path / "threads"
    script.write_text(TRAIN_AND_LIST_THREADS)
    threads.mkdir()
    overrides = [
        *tiny_model(),
        *tiny_data_overrides(tiny_data),
        f"run_dir={run}",
        "data.seq_len=64",
        "train.micro_batch_size=2",
        "train.grad_accum=1",
        "train.max_steps=2",
        "parallel.zero_stage=2",
        "wandb.mode=disabled",
    ]
    env = {
        **os.environ,
        **ONE_THREAD,
        "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
        "RANK_THREADS_DIR": str(threads),
        **dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()),
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), "train", "--config", os.devnull, *overrides],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    said = [rank.communicate(timeout=600)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], said[0][-3000:] + said[1][-3000:]
    assert "done: 2 of 2 steps" in said[0]
    for rank in range(2):
        names = json.loads((threads / f"rank{rank}.json").read_text())
        assert not [name for name in names if name.startswith(COMMUNICATION_THREADS)], (rank, names)
