"""``megatransformer plan``: the layouts a config can train in on given devices, each rank's memory by part and
the step time, ranked, and why the first wins (design and checks: docs/planner.md)."""

from __future__ import annotations

import argparse
import json

from megatransformer.commands.arguments import add_config_argument
from megatransformer.config import ConfigError, RunConfig, load_config
from megatransformer.console import to_stderr

GEMM_SECONDS = 0.3  # how long a CPU's GEMM speed is measured
COLUMNS = (  # (memory part, column title)
    ("weights", "weights"),
    ("master_weights", "master"),
    ("gradients", "grads"),
    ("optimizer_states", "optim"),
    ("activations", "activ"),
    ("loss_chunk", "loss"),
    ("attention_transients", "bwd"),
    ("communication_buffers", "comm"),
    ("checkpoint_staging", "ckpt"),
    ("overheads", "other"),
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="rank the layouts (dp x tp x sp, ZeRO, checkpointing, tiles, offload, micro batch) by step time",
        description="For the config's model and data shape, list the layouts the devices allow with each rank's "
        "memory at its peak, split into parts, and an estimated step time; mark what fits and rank it. Without "
        "GPU options on a machine without a GPU, the plan is for this CPU.",
    )
    add_config_argument(parser)
    parser.add_argument("--gpu", default=None, metavar="NAME", help="the GPU model, e.g. H100, A100, H200")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GiB", help="memory per device")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, metavar="T", help="dense bf16 TFLOP/s per device (a GPU not known)"
    )
    parser.add_argument(
        "--host-memory",
        type=float,
        default=None,
        metavar="GiB",
        help="host memory per node, shared by its ranks (default: this machine's, or 240 GiB per GPU of the table)",
    )
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="N", help="devices (ranks) per node")
    parser.add_argument("--nodes", type=int, default=1, metavar="M", help="nodes")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="layouts to list (0: all)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--verbose", action="store_true", help="also list the layouts that cannot exist, and why")
    parser.add_argument(
        "overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. model.n_layers=4"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    for name in ("gpus_per_node", "nodes", "top"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "top" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {0 if name == 'top' else 1}, got {value}")
    for name in ("gpu_memory", "peak_tflops", "host_memory"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
    # (a named GPU needs no PyTorch: one it does not know is one line; --host-memory checks the device first too)
    early = args.gpu is not None or args.gpu_memory is not None or args.peak_tflops is not None
    early = early or args.host_memory is not None
    if early:
        device, per_node = resolve_device(args, cfg)
    if args.host_memory is not None:
        from dataclasses import replace

        if device.kind == "cpu":
            raise ConfigError("--host-memory is for GPU plans: a CPU's ranks share this machine's memory")
        device = replace(device, host_gib=args.host_memory / per_node)
    to_stderr(f"plan: {cfg.run_dir}: loading PyTorch, then ranking layouts")
    from megatransformer.planner import plan

    if not early:
        device, per_node = resolve_device(args, cfg)
    world = per_node * args.nodes
    current, global_batch = config_layout(cfg, world, device.kind)
    result = plan(cfg, device, world, per_node, current, global_batch)
    note = batch_note(cfg, world)
    top = args.top or None
    if args.json:
        out = result.as_dict(top)
        if not args.verbose:
            del out["skipped"]
        out["batch_note"] = note
        print(json.dumps(out, indent=2))
        return 0
    print(render(cfg, result, top, args.verbose))
    if note:
        print(note)
    return 0


def resolve_device(args: argparse.Namespace, cfg: RunConfig):
    """The device the plan is for, and ranks per node: ``--gpu`` (the table's, or an unknown one given its
    memory and peak), else this machine's GPU, else its CPU."""
    from dataclasses import replace

    from megatransformer.planner import GPUS, Device, find_gpu

    if args.gpu is None and args.gpu_memory is None and args.peak_tflops is None:
        return local_device(cfg, args.gpus_per_node)
    known = find_gpu(args.gpu) if args.gpu else None
    if known is None and (args.gpu_memory is None or args.peak_tflops is None):
        names = ", ".join(g.name for g in GPUS)
        what = f"--gpu {args.gpu} is not one the planner knows ({names})" if args.gpu else "an unnamed GPU"
        raise ConfigError(f"{what}: give its --gpu-memory GiB and --peak-tflops (dense bf16 TFLOP/s per device)")
    device = known or Device(args.gpu or "GPU", args.gpu_memory, args.peak_tflops, 450, 50)
    if args.gpu_memory is not None:
        device = replace(device, memory_gib=args.gpu_memory)
    if args.peak_tflops is not None:
        device = replace(device, peak_tflops=args.peak_tflops)
    return device, args.gpus_per_node or 8


def local_device(cfg: RunConfig, ranks_per_node: int | None, need_peak: bool = True):
    """This machine's GPU (all of them on a node, unless ``ranks_per_node``), else its CPU (one rank unless
    told otherwise, its memory shared by the node's ranks), and the ranks per node. The peak (a CPU's GEMM
    measured, a GPU's from the table or ``train.peak_tflops``) is 0 where not ``need_peak`` and not known."""
    from dataclasses import replace

    import torch

    from megatransformer.planner import Device, cpu_device, find_gpu

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        known = find_gpu(name) or Device(name, 0, 0, 450, 50)
        peak = cfg.train.peak_tflops or known.peak_tflops
        if not peak and need_peak:
            raise ConfigError(f"the planner does not know {name}: give its --gpu-memory GiB and --peak-tflops")
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        ranks = ranks_per_node or torch.cuda.device_count()
        host = cpu_device(ranks).memory_gib
        return replace(known, name=name, memory_gib=memory, peak_tflops=peak, host_gib=host), ranks
    ranks = ranks_per_node or 1
    if need_peak:  # (the GEMMs measured with the threads a run would pick here)
        from megatransformer.training.threads import say_threads

        say_threads(to_stderr)
    return replace(cpu_device(ranks), peak_tflops=cpu_tflops(cfg.precision) if need_peak else 0.0), ranks


WHEN = {
    "construction": "while it builds the model",
    "engine_start": "when DeepSpeed's engine starts",
    "loading": "while it loads a checkpoint",
    "step": "at its step's peak",
}


def check_layout_fits(cfg: RunConfig, world: int, ranks_per_node: int) -> str | None:
    """Stop before any rank allocates when the run's own layout cannot fit, at its start or in its steps, in its
    device's or its host's memory: one line with the moment, where, by how much, and the best layout that fits
    (``train.check_memory`` turns it off). A layout that fits, but only under the plan's assumption that freed
    host memory is reused: the line that says so (else None)."""
    from dataclasses import replace

    from megatransformer.planner import GIB, PARTS, keep_heap_growth, memory_parts, overflow, peaks, plan

    device, per_node = local_device(cfg, ranks_per_node, need_peak=False)
    current, global_batch = config_layout(cfg, world, device.kind)
    if current is None:
        return None  # (the layout's own checks say why)
    need = memory_parts(cfg, current, device)
    moments = peaks(cfg, current, device, need)
    over = overflow(moments, device)
    if over is None:
        grown = moments["step"].on(device) * keep_heap_growth(cfg, current, device)
        if grown <= device.memory_gib * GIB:
            return None
        return (
            f"memory: this layout's step needs {moments['step'].on(device) / GIB:.1f} GiB per rank of the "
            f"{device.memory_gib:.1f} GiB here, but at ZeRO-3 under train.host_memory=keep glibc's heap grows to "
            f"~{grown / GIB:.1f} GiB over the steps (measured up to 1.55x); train.host_memory=release holds it to the "
            "plan, at a slower step"
        )
    moment, where, needed, limit_gib = over
    what = device.name if where == "device" or device.kind == "cpu" else "host (per rank)"
    largest = max(PARTS, key=lambda part: need[part])
    detail = f" (largest part: {largest.replace('_', ' ')}, {need[largest] / GIB:.1f} GiB)" if moment == "step" else ""
    if not device.peak_tflops:  # (the step times that rank the layouts: any peak ranks a GPU's alike)
        device = replace(device, peak_tflops=cpu_tflops(cfg.precision) if device.kind == "cpu" else 1.0)
    fitting = [p for p in plan(cfg, device, world, per_node, current, global_batch).layouts if p.fits]
    best = f"the best layout that fits: {fitting[0].layout.describe()}" if fitting else "no layout fits"
    raise ConfigError(
        f"this run's layout ({current.describe()}) needs {needed / GIB:.1f} GiB per rank {WHEN[moment]}, "
        f"{needed / GIB - limit_gib:.1f} GiB more than the {limit_gib:.1f} GiB of its {what}{detail}; {best} "
        "(megatransformer plan ranks them); train.check_memory=false skips this check"
    )


def config_layout(cfg: RunConfig, world: int, kind: str):
    """The layout the config itself describes on ``world`` ranks (None where its tp x sp does not divide the
    world), and the global batch every layout keeps."""
    from megatransformer.planner import Layout
    from megatransformer.training.runtime.layout import BatchSizes, engine_zero_stage, resolve_batch_sizes

    p, m = cfg.parallel, cfg.model
    group = p.tensor_parallel * p.sequence_parallel
    dp = max(1, world // group)
    try:
        sizes = resolve_batch_sizes(cfg.train, dp)
    except ConfigError:  # (batch_note says so) the batch left to the launch: one row per data-parallel rank
        sizes = BatchSizes(cfg.train.micro_batch_size or 1, cfg.train.grad_accum or 1, dp)
    if world % group:
        return None, sizes.global_batch
    layout = Layout(
        dp,
        p.tensor_parallel,
        p.sequence_parallel,
        engine_zero_stage(cfg, dp, kind),
        m.activation_checkpointing,
        m.mlp_tiles,
        p.offload_optimizer,
        sizes.micro,
        sizes.accum,
    )
    return layout, sizes.global_batch


def batch_note(cfg: RunConfig, world: int) -> str | None:
    """A line when the config's batch cannot be laid out on ``world`` ranks and the plan takes another
    (:func:`config_layout`'s), saying why and which; None when the plan keeps the config's."""
    from megatransformer.training.runtime.layout import resolve_batch_sizes

    p = cfg.parallel
    dp = max(1, world // (p.tensor_parallel * p.sequence_parallel))
    try:
        resolve_batch_sizes(cfg.train, dp)
        return None
    except ConfigError as err:
        t = cfg.train
        micro, accum = t.micro_batch_size or 1, t.grad_accum or 1
        return (
            f"note: the config's batch does not work on {world} rank{'s' * (world != 1)} ({err}): planning global "
            f"batch {micro * accum * dp} (micro {micro} x accum {accum} x dp {dp}) instead; `train` would refuse it"
        )


def cpu_tflops(precision: str) -> float:
    """This CPU's GEMM speed in the run's precision (the best of a few 1024^3 products), in TFLOP/s."""
    import time

    import torch

    from megatransformer.training.runtime.cpu_bf16 import native_bf16_gemm

    dtype = torch.bfloat16 if precision != "fp32" and native_bf16_gemm() else torch.float32
    a, out = torch.randn(1024, 1024, dtype=dtype), torch.empty(1024, 1024, dtype=dtype)
    torch.matmul(a, a, out=out)  # (the thread pool started, the output's pages touched)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < GEMM_SECONDS:  # the best of a few tenths of a second: a busy machine's
        begin = time.perf_counter()  # other work takes the cores now and then, and the best product is the
        torch.matmul(a, a, out=out)  # speed the step gets between its interruptions
        best = min(best, time.perf_counter() - begin)
    return 2 * 1024**3 / best / 1e12


def parameters_text(count: int) -> str:
    """``count`` parameters in the unit that shows it: 1.63 M, 6.74 B."""
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"


def render(cfg: RunConfig, result, top: int | None, verbose: bool) -> str:
    from megatransformer.flops import model_size
    from megatransformer.planner import GIB

    d = result.device
    params = model_size(cfg.model, cfg.data.seq_len).params
    if d.kind == "cpu":
        from megatransformer.training.threads import other_load

        peak = f"GEMMs measured at {d.peak_tflops * 1e3:,.0f} GFLOP/s"
        if (load := other_load()) >= 1:  # (the step times are as slow as the GEMMs were then)
            peak += f" while {load:.0f} tasks of other work ran"
    else:
        peak = f"{d.peak_tflops:g} TFLOP/s bf16, host {d.host_gib:,.0f} GiB per rank"
    lines = [
        f"plan: {parameters_text(params)} parameters, seq_len {cfg.data.seq_len}, global batch "
        f"{result.global_batch} rows, {cfg.precision}, on {result.world} x {d.name} ({d.memory_gib:,.1f} GiB, {peak})",
        f"{'#':>4}  {'layout':44s} {'GiB':>7} "
        + " ".join(f"{title:>7}" for _, title in COLUMNS)
        + f" {'start':>7} {'host':>7} {'s/step':>9}  fits",
    ]
    for i in result.shown(top):
        p = result.layouts[i]
        mark = " <- config" if i == result.current else ""
        lines.append(
            f"{i + 1:>4}  {p.layout.describe():44s} {p.memory['total'] / GIB:7.2f} "
            + " ".join(f"{p.memory[part] / GIB:7.2f}" for part, _ in COLUMNS)
            + f" {p.start_bytes / GIB:7.2f} {p.host_bytes / GIB:7.2f}"
            + f" {p.step_seconds:9.3g}  {'yes' if p.fits else 'no'}{mark}"
        )
    if result.current is None:
        lines.append("the config's own layout (parallel.*) does not divide these devices")
    lines.append(f"why: {result.why()}")
    if verbose:
        lines += [f"skipped {name}: {reason}" for name, reason in result.skipped]
    return "\n".join(lines)
