"""The failure board (training/runtime/failure_board.py) on a real TCP store: the first failure posted is the one
every rank reads, a rank ignores its own, a watching rank is told within a poll, a peer process on this machine
killed outright is posted as gone (real processes), and the store's host waits for the others to read before it
ends."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatransformer.training.runtime import failure_board
from megatransformer.training.runtime.failure_board import FailureBoard, Process


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def client(store) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))


def test_the_first_failure_posted_is_the_one_read(store):
    first, second, reader = (FailureBoard(client(store), rank, 3) for rank in (2, 1, 0))
    assert reader.read() is None
    first.post("DataError: train-000003.tar: a damaged sample")
    second.post("all_reduce failed: another rank is gone")
    assert reader.read() == "rank 2: DataError: train-000003.tar: a damaged sample"


def test_a_new_attempt_does_not_read_the_last_ones_failure(store):
    FailureBoard(client(store), 1, 2, attempt="0").post("boom")
    assert FailureBoard(client(store), 0, 2, attempt="1").read() is None


def test_a_watching_rank_is_told_of_another_ranks_failure_within_a_poll(store, monkeypatch):
    monkeypatch.setattr(failure_board, "POLL_SECONDS", 0.05)
    told: list[str] = []
    done = threading.Event()
    watcher = FailureBoard(client(store), 0, 2)
    watcher.watch(lambda line: (told.append(line), done.set()))
    watcher.post("its own failure is not news")  # (a rank that posted ends by its own path)
    time.sleep(0.2)
    assert told == []
    store.delete_key(watcher.key)
    FailureBoard(client(store), 1, 2).post("OutOfMemoryError: CUDA out of memory")
    assert done.wait(60)
    assert told == ["rank 1: OutOfMemoryError: CUDA out of memory"]
    watcher.close()


def test_the_rank_that_holds_the_store_waits_for_the_others_after_its_failure(store, monkeypatch):
    monkeypatch.setattr(failure_board, "STORE_HOST_WAIT_SECONDS", 1.3)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    host, peer = FailureBoard(client(store), 0, 2), FailureBoard(client(store), 1, 2)
    started = time.monotonic()
    host.close(failed=True)  # (the peer never ends: the whole wait, so that it could read the line)
    assert time.monotonic() - started >= 1.3
    host, peer = FailureBoard(client(store), 0, 2, attempt="1"), FailureBoard(client(store), 1, 2, attempt="1")
    threading.Timer(0.2, peer.close).start()
    host.close(failed=True)
    assert store.check([f"{host.ended}/0", f"{host.ended}/1"])  # (both ended: the host left as soon as its peer had)
    host = FailureBoard(client(store), 0, 2, attempt="2")
    monkeypatch.setattr(failure_board, "STORE_HOST_WAIT_SECONDS", 60.0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # (torchrun's agent holds the store: no wait)
    started = time.monotonic()
    host.close(failed=True)
    assert time.monotonic() - started < 30


def registered_peer(store, rank: int) -> subprocess.Popen:
    """A real process of this machine, said on the board to be ``rank``'s (as a watching rank says its own)."""
    peer = subprocess.Popen(["sleep", "60"])
    store.set(f"{failure_board.PROCESS}/0/{rank}", str(Process.of(peer.pid)))
    return peer


def watching(store, rank: int, world_size: int) -> tuple[FailureBoard, list[str], threading.Event]:
    told: list[str] = []
    done = threading.Event()
    board = FailureBoard(client(store), rank, world_size)
    board.watch(lambda line: (told.append(line), done.set()))
    return board, told, done


def test_a_peer_on_this_machine_killed_outright_is_posted_as_gone(store, monkeypatch):
    monkeypatch.setattr(failure_board, "POLL_SECONDS", 0.05)
    peer = registered_peer(store, 1)
    watcher, told, done = watching(store, 0, 3)
    time.sleep(0.2)
    assert told == []  # (alive)
    peer.send_signal(signal.SIGKILL)  # (not reaped here: a zombie, as until its parent reads its exit)
    assert done.wait(60)
    peer.wait()
    (line,) = told
    assert line == (
        f"rank 1: its process ended without a line (pid {peer.pid} on {os.uname().nodename}: killed, as by the "
        "kernel's out-of-memory killer (dmesg lists those), or aborted, as by NCCL's watchdog after a failed "
        "collective (its log says))"
    )
    assert FailureBoard(client(store), 2, 3).read() == line  # (posted for the ranks of other machines)
    watcher.close()


def test_a_peer_that_ended_its_run_is_not_taken_for_gone(store):
    peer = registered_peer(store, 1)
    FailureBoard(client(store), 1, 2).close()  # (its run ended: it says so before its process goes)
    peer.kill()
    peer.wait()
    watcher = FailureBoard(client(store), 0, 2)
    assert watcher.gone() is None and watcher.read() is None
    assert watcher.neighbours[1] is not None  # (watched, and found ended)


def test_peers_elsewhere_are_not_watched(store):
    """A peer on another machine (another boot) or in another PID namespace: its pid means nothing here."""
    here = Process.of(os.getpid())
    gone = 2**22 + 1  # (above the kernel's pid_max: no process has it)
    elsewhere = (
        Process("another-boot", here.namespace, gone, "1", "n2"),
        Process(here.boot, "pid:[1]", gone, "1", "container"),
    )
    for rank, process in enumerate(elsewhere, start=1):
        store.set(f"{failure_board.PROCESS}/0/{rank}", str(process))
    watcher = FailureBoard(client(store), 0, 3)
    assert watcher.gone() is None and watcher.neighbours == {1: None, 2: None}


def test_a_process_is_known_by_its_start_time_as_well_as_its_pid():
    here = Process.of(os.getpid())
    assert here.running()
    assert not Process(here.boot, here.namespace, here.pid, str(int(here.started) + 1), here.host).running()
    assert Process.parse(str(here)).running()
    assert Process.parse("not a process") is None and Process.parse("b ns pid 1 host") is None


def test_a_watcher_that_fails_says_so(store, monkeypatch, capsys):
    monkeypatch.setattr(failure_board, "POLL_SECONDS", 0.05)

    def broken(self):
        raise ValueError("a store answer it cannot read")

    monkeypatch.setattr(FailureBoard, "read", broken)
    watcher = FailureBoard(client(store), 3, 4)
    watcher.watch(lambda line: None)
    watcher.thread.join(5)
    assert not watcher.thread.is_alive()
    assert capsys.readouterr().err == (
        "warning: rank 3: the failure board's watcher stopped (ValueError: a store answer it cannot read): should "
        "another rank fail, this one waits parallel.timeout_minutes before it ends\n"
    )


def test_a_store_that_does_not_answer_leaves_the_run_without_a_board_and_says_so(monkeypatch, capsys):
    from megatransformer.training.runtime.distributed import free_port

    monkeypatch.setattr(failure_board, "STORE_TIMEOUT", timedelta(seconds=1))
    port = free_port()  # (nothing listens there)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    assert FailureBoard.connect(local_rank=1) is None
    said = capsys.readouterr().err
    assert said.startswith(f"warning: the job's store at 127.0.0.1:{port} does not answer (")
    assert said.endswith("should a rank fail, the others wait parallel.timeout_minutes before they end\n")


def test_one_rank_has_no_board(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert FailureBoard.connect(local_rank=0) is None


def test_a_machines_other_ranks_wait_until_its_first_rank_has_printed_the_error(store, monkeypatch):
    """Under torchrun a config error's quiet ranks return once their machine's first local rank has said it printed
    the line (torchrun would end it as they exit), or after the longest wait; elsewhere at once."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(failure_board, "PRINTED_WAIT_SECONDS", 0.5)

    def as_rank(rank: int, local_rank: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))

    def waited() -> float:
        started = time.monotonic()
        failure_board.wait_until_printed()
        return time.monotonic() - started

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    as_rank(1, 1)
    assert waited() < 0.4  # (srun, or no launcher: nothing ends a rank before it prints)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    as_rank(2, 0)
    failure_board.say_printed()  # (another machine's first rank)
    as_rank(1, 1)
    assert waited() >= 0.5
    as_rank(0, 0)
    failure_board.say_printed()
    as_rank(1, 1)
    assert waited() < 0.4
