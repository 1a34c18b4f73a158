"""The checkpoint writers' gloo group: an interface the other nodes can reach, checked at start-up, and a
timeout of its own (checkpoint.timeout_minutes)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatransformer.config import ConfigError, validate
from megatransformer.training.checkpointing.checkpointer import writer_group
from megatransformer.training.runtime.distributed import gloo_interface_problem, setup

TWO_NODES = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}


def resolving_to(monkeypatch, address: str) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "node7")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: address)


def test_a_host_name_resolving_to_loopback_is_refused_across_nodes(monkeypatch):
    resolving_to(monkeypatch, "127.0.1.1")
    line = gloo_interface_problem(TWO_NODES)
    assert line is not None and "\n" not in line
    assert "node7 resolves to 127.0.1.1, a loopback address" in line
    assert "set GLOO_SOCKET_IFNAME" in line and "MASTER_ADDR=10.0.0.1" in line
    assert gloo_interface_problem({**TWO_NODES, "LOCAL_WORLD_SIZE": "4"}) is None  # (one node: loopback serves)
    assert gloo_interface_problem({**TWO_NODES, "GLOO_SOCKET_IFNAME": "lo"}) is None
    resolving_to(monkeypatch, "10.0.0.7")
    assert gloo_interface_problem(TWO_NODES) is None


def test_nodes_that_meet_at_a_loopback_address_are_one_machine_s(monkeypatch):
    """A cluster of one machine's nodes (the tests' Slurm cluster: MASTER_ADDR=127.0.0.1): loopback reaches them all."""
    resolving_to(monkeypatch, "127.0.1.1")
    for address in ("127.0.0.1", "localhost", "::1"):
        assert gloo_interface_problem({**TWO_NODES, "MASTER_ADDR": address, "SLURM_NNODES": "2"}) is None
    assert gloo_interface_problem({**TWO_NODES, "MASTER_ADDR": "node1"}) is not None


def test_an_interface_the_host_lacks_is_named(monkeypatch):
    resolving_to(monkeypatch, "10.0.0.7")
    line = gloo_interface_problem({**TWO_NODES, "GLOO_SOCKET_IFNAME": "lo,nope0"})
    assert line is not None and line.startswith("GLOO_SOCKET_IFNAME=lo,nope0: this host has no interface nope0")


def test_the_check_is_made_before_any_process_group(monkeypatch):
    resolving_to(monkeypatch, "127.0.1.1")
    for key, value in {**TWO_NODES, "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    with pytest.raises(ConfigError, match="resolves to 127.0.1.1"):
        setup(0.1)
    assert not dist.is_initialized()


def test_the_writers_group_has_the_timeout_of_checkpoint_timeout_minutes(tmp_path):
    assert validate({"checkpoint": {"timeout_minutes": 45}}).checkpoint.timeout_minutes == 45
    with pytest.raises(ConfigError, match="timeout_minutes"):
        validate({"checkpoint": {"timeout_minutes": 0}})
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(minutes=10))
    try:
        group = writer_group(45)
        assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(minutes=45)
    finally:
        dist.destroy_process_group()


def test_a_writers_timeout_ends_the_run_in_one_line_naming_the_setting(tmp_path):
    """The writer thread's collective timed out (a rank slower than checkpoint.timeout_minutes): raised in the
    main thread as a failed write naming the setting, not the thread's traceback."""
    import threading
    from pathlib import Path
    from types import SimpleNamespace

    from data_pipeline import WriteFailed
    from megatransformer.training.checkpointing.checkpointer import Checkpointer

    def writer() -> None:
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation")

    saver = Checkpointer.__new__(Checkpointer)
    saver.cfg = SimpleNamespace(checkpoint=SimpleNamespace(timeout_minutes=0.05), run_dir=str(tmp_path))
    saver.outcome, saver.writer_error, saver.done, saver.failure = None, None, [], None
    saver.writing = Path(tmp_path / "checkpoints" / "step_000004")
    saver.thread = threading.Thread(target=lambda: saver._write(None))
    saver._write_job = lambda job: writer()
    saver.thread.start()
    with pytest.raises(WriteFailed, match=r"step_000004 failed: .* within checkpoint.timeout_minutes=0.05") as err:
        saver.wait()
    assert "\n" not in str(err.value) and saver.thread is None
