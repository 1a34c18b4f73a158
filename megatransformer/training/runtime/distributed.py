"""Process-group set-up: whatever launched us (nothing, torchrun, or Slurm through ``launch``) has put
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment; DeepSpeed does the rest."""

from __future__ import annotations

import os
import re
import socket
import sys
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

EXIT_COLLECTIVE_FAILED = 4  # a collective timed out or lost a peer: another rank is stalled or dead
_started = False  # a process group has run in this process (it may have ended since)


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: str  # "cpu" or "cuda:N"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_deprecated_collectives() -> None:
    """DeepSpeed gathers ZeRO and bf16 partitions with all_gather_into_tensor and reduces ZeRO-3's gradients with
    reduce_scatter_tensor, which torch deprecates: FutureWarnings on every rank, shown again every step (the
    warnings registry is reset whenever a filter changes), that are DeepSpeed's to act on, not the user's."""
    warnings.filterwarnings(
        "ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning
    )


def setup(timeout_minutes: float = 10.0) -> Dist:
    """Initialise torch.distributed through DeepSpeed (NCCL on GPUs, gloo on CPU); a collective that waits
    longer than ``timeout_minutes`` for the other ranks fails (parallel.timeout_minutes)."""
    import torch

    # dynamo loaded before the first process group: loaded after it (with the first torch.optim optimizer), it left
    # gloo's threads running past destroy_process_group in torch 2.13 (tests/e2e/test_group_shutdown.py); every
    # training process loads it then anyway
    import torch._dynamo  # noqa: F401

    if "TORCHELASTIC_RUN_ID" in os.environ:
        end_with_launcher()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "WORLD_SIZE" not in os.environ:  # a plain single process: a world of one
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    if os.environ.get("MASTER_PORT") == "0":  # torchrun --master_port=0 exports 0: every rank would wait forever
        from megatransformer.config import ConfigError

        raise ConfigError(
            "MASTER_PORT=0 cannot be reached by the other ranks; use `torchrun --standalone` "
            "or pass a free port with --master_port"
        )
    problem = gloo_interface_problem(os.environ)
    if problem is not None:
        from megatransformer.config import ConfigError

        raise ConfigError(problem)
    import deepspeed
    import torch.distributed as dist

    from megatransformer.training.runtime.builds import skip_collective_build

    quiet_deprecated_collectives()

    if os.environ["WORLD_SIZE"] == "1":
        skip_collective_build()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = select_cuda_device(local_rank) if cuda else None
    if not dist.is_initialized():
        timeout = timedelta(minutes=timeout_minutes)
        # DeepSpeed makes groups of its own (ZeRO's clone of the world group, tensor/data-parallel groups)
        # without a timeout, and torch gives those its module default (30 min for gloo), not the world
        # group's: set that default too, or a rank stalled in ZeRO's gradient all-reduce hangs the others
        from torch.distributed import distributed_c10d

        distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", timeout=timeout)
    note_group_started()
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, f"cuda:{device}" if cuda else "cpu")


def cuda_device(local_rank: int, count: int) -> tuple[int, str | None]:
    """The CUDA device a rank uses among the ``count`` it sees: ``local_rank``, or ``local_rank % count`` where
    that is no device here (Slurm's ``--gpus-per-task=1`` or a default ``--gpu-bind`` shows each task its own
    GPU only, as device 0), with one line for the log saying so; None when ``local_rank`` is used."""
    if local_rank < count:
        return local_rank, None
    index = local_rank % count
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    line = (
        f"device: local rank {local_rank} sees {count} GPU{'s' if count > 1 else ''} (CUDA_VISIBLE_DEVICES="
        f"{visible}: Slurm's --gpus-per-task or --gpu-bind binds each task to its own); using cuda:{index} "
        "(local_rank % device_count)"
    )
    if count > 1:
        line += "; ranks that share a GPU fail under NCCL: give each task one GPU or all of the node's"
    return index, line


def select_cuda_device(local_rank: int) -> int:
    """Make this rank's CUDA device (:func:`cuda_device`) the current one, saying so when it is not its local
    rank; its index."""
    import torch

    index, line = cuda_device(local_rank, torch.cuda.device_count())
    if line is not None:
        print(line, flush=True)
    torch.cuda.set_device(index)
    tell_deepspeed_the_device(index)
    return index


def tell_deepspeed_the_device(index: int) -> None:
    """DeepSpeed takes its CUDA device from LOCAL_RANK (``zero.Init``, the engine), which is no device where
    :func:`cuda_device` fell back: there LOCAL_RANK becomes the device's index (this rank's place on its node is
    read before: the process's first-on-node lines; the failure board takes it from the process group's start)."""
    os.environ["LOCAL_RANK"] = str(index)


def gloo_interface_problem(env: Mapping[str, str]) -> str | None:
    """Why gloo, which the checkpoint writers' group uses on every device (and training on CPUs), could not reach
    the other nodes, in one line with the fix; None when it can or the run is on one node (loopback serves).
    gloo listens on the address this host's name resolves to, or on ``GLOO_SOCKET_IFNAME``'s interfaces; a name
    that resolves to a loopback address (127.0.1.1, as Debian's /etc/hosts has it) fails at the first save."""
    world = int(env.get("WORLD_SIZE", "1"))
    local = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    if world <= local and int(env.get("SLURM_NNODES", "1")) <= 1:
        return None
    if is_loopback(env.get("MASTER_ADDR", "")):  # (the "nodes" are this host's, as a one-machine cluster's)
        return None
    named = env.get("GLOO_SOCKET_IFNAME")
    fix = (
        f"set GLOO_SOCKET_IFNAME to the network interface of this host that reaches MASTER_ADDR="
        f"{env.get('MASTER_ADDR', '?')} (e.g. GLOO_SOCKET_IFNAME=eth0; `ip -br addr` lists them)"
    )
    if named:
        interfaces = sorted(name for _, name in socket.if_nameindex())
        missing = [name for name in named.split(",") if name not in interfaces]
        if missing:
            return (
                f"GLOO_SOCKET_IFNAME={named}: this host has no interface {missing[0]} (it has "
                f"{', '.join(interfaces)}); {fix}"
            )
        return None
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return f"this host's name {host} does not resolve, so gloo (the checkpoint writers) cannot listen; {fix}"
    if address.startswith("127.") or address == "::1":
        return (
            f"this host's name {host} resolves to {address}, a loopback address the other nodes cannot reach: gloo "
            f"(the checkpoint writers' group) would fail at the first save; {fix}, or map {host} to its network "
            "address in /etc/hosts"
        )
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface, which only this machine's ranks reach."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def end_with_launcher() -> None:
    """A rank torchrun started ends with it: torchrun starts each rank in a session of its own, so a launcher
    killed outright (SIGKILL, the OOM killer) would leave its ranks training on, writing into the run directory
    and holding its lock, while a restarted run waits for them. Linux ends them then (PR_SET_PDEATHSIG);
    elsewhere nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != launcher:  # (the launcher ended before the signal was asked for)
        os.kill(os.getpid(), signal.SIGKILL)


def note_group_started() -> None:
    """(Whoever starts this process's group.) From now on an error may be this rank's own: each rank reports its
    own (:func:`group_started`)."""
    global _started
    _started = True


def group_started() -> bool:
    """Whether this process has run a process group (:func:`setup`), ended or not: an error found since may be
    this rank's own."""
    return _started


def teardown() -> None:
    """Destroy every process group at the end of a run, as torchtitan does, after the train module is closed
    (``TrainModule.close``): their gloo threads, sockets and the TCP store end here rather than in the
    interpreter's shutdown. DeepSpeed's own ``destroy_process_group`` also drops the groups its modules keep
    (``deepspeed.utils.groups``: ZeRO's clone of the world group; DeepSpeed 0.19.8), which torch's leaves alive
    with their threads; the collection ends the engine's objects that still hold one."""
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
    gc.collect()


def groups_end_after_failure() -> bool:
    """Whether this process's groups can be ended (:func:`teardown`) after a collective of theirs failed for want
    of another rank: gloo's can, at once (0.1 s here, the peer dead or stalled past the timeout with collectives
    still queued; the group of the failed collective may stay held from C++, its threads idle), and the process
    then ends as a finished one does; NCCL's may wait on the peer that is gone, and closing the engine
    synchronizes the device (torchtitan ends its groups only after a successful run), so they are left as they
    are."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "gloo"


_COMM_FILES = (f"torch{os.sep}distributed{os.sep}", f"deepspeed{os.sep}comm{os.sep}")
# ZeRO-3 waits on its parameter gathers' handles itself (each layer's, before its forward and backward), outside
# the two above: the commonest place a ZeRO-3 rank meets a peer that stalled or died
_ZERO3_GATHER = f"deepspeed{os.sep}runtime{os.sep}zero{os.sep}partition_parameters.py"
_OWN_FILES = (f"megatransformer{os.sep}", f"data_pipeline{os.sep}")
_PEER_GONE = re.compile(r"connection (closed|reset|refused)|broken pipe", re.IGNORECASE)


def _collective(frames: list[traceback.FrameSummary]) -> str | None:
    """The collective a traceback failed in, as its line names it; None if it failed in none."""
    comm = [f for f in frames if any(part in f.filename for part in _COMM_FILES)]
    if comm:
        return comm[-1].name
    if any(f.filename.endswith(_ZERO3_GATHER) for f in frames):
        return "ZeRO-3's gather of a layer's parameters"
    return None


def collective_failure(err: BaseException, timeout_minutes: float) -> str | None:
    """One line for a collective that failed for want of another rank (gloo raises when one waits longer
    than the timeout, or when a peer's connection drops): which collective, called from where, and why;
    None for any other error. The traceback names the collective; gloo's message does not."""
    frames = traceback.extract_tb(err.__traceback__)
    collective = _collective(frames)
    if collective is None:
        return None
    own = [f for f in frames if any(part in f.filename for part in _OWN_FILES)]
    # the innermost two of our frames: e.g. "in step (engine.py:154) < run (loop.py:106)"
    where = (
        " in " + " < ".join(f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})" for f in own[:-3:-1]) if own else ""
    )
    reason = re.sub(r"^\[[^\]]*\] ", "", str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
    reason = reason.split(". This is typically caused by")[0]  # (gloo's advice: to look at the other rank's log)
    if "timed out" in reason.lower():
        return (
            f"{collective}{where} timed out: no answer from another rank within parallel.timeout_minutes="
            f"{timeout_minutes:g}; a rank is stalled or dead ({reason})"
        )
    if _PEER_GONE.search(reason):
        return f"{collective}{where} failed: another rank is gone ({reason})"
    return None


def on_first_rank(compute: Callable[[], Any]) -> Any:
    """``compute()`` on rank 0, its result on every rank; should it fail, rank 0 raises its error and the
    others a ConfigError with the same message (none is left waiting)."""
    import torch.distributed as dist

    from megatransformer.config import ConfigError

    if not (dist.is_available() and dist.is_initialized()):
        return compute()
    box: list[Any] = [(None, None)]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = (compute(), None)
        except Exception as err:
            failure, box[0] = err, (None, str(err))
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    value, error = box[0]
    if error is not None:
        raise ConfigError(error)
    return value
