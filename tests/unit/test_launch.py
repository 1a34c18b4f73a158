"""launch: environment parsing (torchrun, srun, batch script, nothing): ranks, master address and port."""

from __future__ import annotations

import pytest

from launch.env import PORT_BASE, PORT_SPAN, DistEnv, LaunchError, detect, master_address, slurm_port, tasks_per_node

UNRESOLVABLE = "no-such-node.invalid"  # .invalid never resolves (RFC 2606)


def fake_scontrol(hostnames: str, node_addr: str | None = None, calls: list | None = None):
    def run(*args: str) -> str:
        if calls is not None:
            calls.append(args)
        if args[:2] == ("show", "hostnames"):
            return hostnames
        if args[:2] == ("show", "node"):
            return (
                f"NodeName={args[2]} Arch=x86_64 NodeAddr={node_addr} NodeHostName=vm Port=17001"
                if node_addr
                else f"NodeName={args[2]} Arch=x86_64"
            )
        raise AssertionError(f"unexpected scontrol {args}")

    return run


def srun_task(
    procid: int,
    localid: int = 0,
    nodeid: int = 0,
    ntasks: int = 2,
    job_id: int = 4242,
    tasks_per_node_spec: str = "1(x2)",
    **extra: str,
) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node_spec,
        "SLURM_STEP_NODELIST": f"{UNRESOLVABLE.split('.')[0]}[1-2]",
        "SLURM_JOB_NODELIST": "ignored[1-2]",
    }
    return env | extra


# ------------------------------------------------------------------------------------------ torchrun


def test_torchrun_environment_is_kept():
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
    }  # torchrun inside an srun step: torchrun's view wins
    dist = detect(env, scontrol=fake_scontrol(""))
    assert dist == DistEnv("torchrun", 3, 1, 4, 2, "10.0.0.7", 29500)
    assert dist.variables() == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29500",
    }


def test_partial_torchrun_environment_names_what_is_missing():
    with pytest.raises(LaunchError, match="MASTER_ADDR, MASTER_PORT"):
        detect({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})


def test_rank_outside_world_is_an_error():
    env = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}
    with pytest.raises(LaunchError, match="RANK=2 is outside WORLD_SIZE=2"):
        detect(env)


# --------------------------------------------------------------------------------------------- Slurm


def test_srun_tasks_agree_on_master_and_get_their_ranks():
    """Every task derives the same address and port on its own; ranks come from SLURM_PROCID/LOCALID."""
    tasks = [
        srun_task(0, 0, 0, ntasks=4, tasks_per_node_spec="2(x2)"),
        srun_task(1, 1, 0, ntasks=4, tasks_per_node_spec="2(x2)"),
        srun_task(2, 0, 1, ntasks=4, tasks_per_node_spec="2(x2)"),
        srun_task(3, 1, 1, ntasks=4, tasks_per_node_spec="2(x2)"),
    ]
    calls: list = []
    scontrol = fake_scontrol("no-such-node1\nno-such-node2\n", node_addr="10.1.2.3", calls=calls)
    dists = [detect(env, scontrol) for env in tasks]
    assert [(d.rank, d.local_rank, d.world_size, d.local_world_size) for d in dists] == [
        (0, 0, 4, 2),
        (1, 1, 4, 2),
        (2, 0, 4, 2),
        (3, 1, 4, 2),
    ]
    assert {(d.launcher, d.master_addr, d.master_port) for d in dists} == {("slurm", "10.1.2.3", slurm_port(4242))}
    assert calls[0] == ("show", "hostnames", "no-such-node[1-2]")  # the step's nodes, not the job's
    assert calls[1] == ("show", "node", "no-such-node1", "-o")  # the first node's NodeAddr (name unresolvable)


def test_resolvable_first_host_is_used_without_asking_the_controller():
    calls: list = []
    assert master_address("localhost,x", fake_scontrol("localhost\nx\n", calls=calls)) == "localhost"
    assert calls == [("show", "hostnames", "localhost,x")]


def test_unresolvable_node_without_node_addr_is_an_error():
    with pytest.raises(LaunchError, match="export MASTER_ADDR"):
        master_address("n1", fake_scontrol("no-such-node.invalid\n"))


def test_exported_master_address_and_port_win():
    env = srun_task(1, MASTER_ADDR="head.example", MASTER_PORT="31000")
    dist = detect(env, scontrol=fake_scontrol(""))  # scontrol must not be needed
    assert (dist.master_addr, dist.master_port, dist.rank) == ("head.example", 31000, 1)


def test_port_is_derived_from_the_job_id():
    ports = [slurm_port(job) for job in range(1000, 1100)]
    assert len(set(ports)) == 100  # nearby jobs do not collide
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    assert slurm_port(7) == slurm_port(7)


@pytest.mark.parametrize(
    "spec, expected", [("1", [1]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("4,2(x2)", [4, 2, 2])]
)
def test_tasks_per_node(spec, expected):
    assert tasks_per_node(spec) == expected


def test_bad_slurm_values_are_errors():
    with pytest.raises(LaunchError, match="SLURM_STEP_TASKS_PER_NODE"):
        tasks_per_node("2x3")
    with pytest.raises(LaunchError, match="SLURM_PROCID='zero' is not an integer"):
        detect(srun_task(0) | {"SLURM_PROCID": "zero"}, fake_scontrol("localhost"))
    with pytest.raises(LaunchError, match="SLURM_PROCID=2 is outside SLURM_STEP_NUM_TASKS=2"):
        detect(srun_task(2), fake_scontrol("localhost"))


def test_batch_script_without_srun_is_one_process_and_says_so():
    env = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    dist = detect(env, scontrol=fake_scontrol(""))
    assert dist.launcher == "single" and dist.variables() == {}
    assert "srun" in dist.note


def test_no_launcher_is_a_single_process():
    dist = detect({"PATH": "/usr/bin"})
    assert dist == DistEnv("single") and dist.variables() == {} and not dist.note
