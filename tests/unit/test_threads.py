"""Intra-op threads on a shared machine: the cores a process may use, the load of other work, the choice."""

from __future__ import annotations

import pytest
import torch

from megatransformer.training.threads import cgroup_quota, pick_threads, set_threads_for_machine, usable_cores


@pytest.mark.parametrize(
    "cores, load, processes, threads",
    [
        (2, 0.2, 1, 2),  # quiet: every core
        (2, 0.9, 1, 1),  # one core taken by other work
        (2, 14.0, 1, 1),  # far oversubscribed: one thread, never none
        (16, 3.2, 1, 13),
        (16, 0.0, 4, 4),  # four local ranks share the cores
        (16, 8.0, 4, 2),
        (1.5, 0.0, 1, 1),  # a cgroup quota of 1.5 cores
    ],
)
def test_the_threads_are_the_cores_other_work_leaves(cores, load, processes, threads):
    assert pick_threads(cores, load, processes) == threads


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    assert cgroup_quota(tmp_path) is None  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(tmp_path) == 1.5 and usable_cores(tmp_path) <= 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(v1) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    assert cgroup_quota(v1) == 0.5


def test_a_busy_machine_is_said_in_one_line_and_omp_num_threads_decides(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr("megatransformer.training.threads.other_load", lambda: 14.0)
        monkeypatch.setattr("megatransformer.training.threads.usable_cores", lambda: 2.0)
        torch.set_num_threads(2)
        line = set_threads_for_machine({})
        assert torch.get_num_threads() == 1
        assert line == (
            "busy machine: load 14.0 on the 2 cores this process may use: 1 intra-op thread instead of 2 (threads "
            "that wait for cores slow every step; OMP_NUM_THREADS=N chooses)"
        )
        torch.set_num_threads(2)
        assert set_threads_for_machine({"OMP_NUM_THREADS": "2"}) is None and torch.get_num_threads() == 2
        monkeypatch.setattr("megatransformer.training.threads.other_load", lambda: 0.0)
        assert set_threads_for_machine({}) is None and torch.get_num_threads() == 2  # quiet: nothing to say
    finally:
        torch.set_num_threads(before)


def test_other_work_is_counted_now_without_this_process():
    from megatransformer.training.threads import other_load

    load = other_load(readings=3, interval=0.0)
    assert load >= 0 and load == int(load)  # (a median of three whole counts, this process left out)


def test_the_wait_policy_is_passive_on_a_busy_machine_unless_the_user_chose(monkeypatch):
    from megatransformer.training.threads import set_wait_policy

    monkeypatch.setattr("megatransformer.training.threads.usable_cores", lambda: 2.0)
    environ = {}
    assert set_wait_policy(environ, load=14.0) and environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "10000"}):
        environ = dict(chosen)
        assert not set_wait_policy(environ, load=14.0) and environ == chosen
    environ = {}
    assert not set_wait_policy(environ, load=0.0) and environ == {}  # quiet: OpenMP's default
