"""The planner's memory estimate against the measured peak of a training step, per rank, on CPU.

A point is a run config (model, seq_len, micro batch, precision, ZeRO stage, tp, sp, activation checkpointing,
MLP tiles) and a runner:

- ``bare``: the model's own step in one process, no engine: forward with the fused loss, backward, torch's fused
  AdamW (``bench/train_step.py``'s Runner: in bf16 with fp32 master weights, as DeepSpeed keeps them).
- ``engine``: the trainer's step, ``TrainModule.step`` (DeepSpeed engine, ZeRO, AutoTP, Ulysses) on ``ranks``
  gloo processes; the largest peak over the ranks.

The measured peak is the running maximum of live tensor bytes (``torch.profiler`` with ``profile_memory``)
during the third step, with the profiler on from before the model is built, so that what was live before the
step (weights, gradients, optimizer states, DeepSpeed's buffers) is counted too (DESIGN.md section 12).
The table gives the plan's total (``megatransformer.planner``) beside it and their ratio.

    python bench/plan_memory.py                 # the grid of BENCHMARKS.md
    python bench/plan_memory.py --quick         # a few points
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gloo_ranks import join  # noqa: E402

from megatransformer.batch import IGNORE_INDEX  # noqa: E402
from megatransformer.config import RunConfig  # noqa: E402
from megatransformer.training.runtime.distributed import free_port  # noqa: E402

MARK = "plan_memory.measured_step"


def live_peak(build: Callable[[], Callable[[], None]], warmup: int = 2, by_address: bool = False) -> int:
    """Peak live tensor bytes of one call of the step ``build()`` returns, after ``warmup`` calls, counting
    everything allocated since ``build`` began (the profiler sees every allocation from there on): the running
    sum of the profiler's allocations and frees.

    ``by_address``: blocks told apart by address instead. Some frees on the engine's path reach neither the
    profiler nor the CPU allocator's own total, so the running sum (and that total) keeps counting a block whose
    address has since been handed out again (BENCHMARKS.md 5v); an address allocated anew ends the block it
    held. It reads the profiler's experimental event tree, with which a rank of the engine's runs now and then
    aborted at its end ("terminate called without an active exception"), so it is not the default."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = build()
        for _ in range(warmup):
            step()
        with record_function(MARK):
            step()
    if by_address:
        return peak_by_address(prof)
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == MARK)
    end = mark.start_ns() + mark.duration_ns()
    live = peak = 0
    for start, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if start > end:
            break
        live += nbytes
        if start >= mark.start_ns():
            peak = max(peak, live)
    return peak


def peak_by_address(prof) -> int:
    from torch._C._profiler import _EventType

    allocations, nodes = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.tag == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        elif node.name == MARK:
            start, end = node.start_time_ns, node.end_time_ns
    blocks: dict[int, int] = {}
    live = peak = 0
    for time, address, nbytes in sorted(allocations):
        if time > end:
            break
        live -= blocks.pop(address, 0)
        if nbytes > 0:
            blocks[address] = nbytes
            live += nbytes
        if time >= start:
            peak = max(peak, live)
    return peak


OBJECTIVES = {"decoder": "autoregressive", "encoder": "masked_lm", "encoder_decoder": "span_corruption"}


def run_config(point: dict) -> RunConfig:
    """The run config of a grid point: {"model": {...}, "seq_len", "micro_batch", "precision", "zero", "tp",
    "sp", "offload", "objective", "ranks"}."""
    return RunConfig.model_validate(
        {
            "model": point["model"],
            "objective": point.get("objective", OBJECTIVES[point["model"].get("arch", "decoder")]),
            "data": {"seq_len": point["seq_len"]},
            "train": {"micro_batch_size": point["micro_batch"], "grad_accum": 1},
            "parallel": {
                "zero_stage": point.get("zero", 0),
                "tensor_parallel": point.get("tp", 1),
                "sequence_parallel": point.get("sp", 1),
                "offload_optimizer": point.get("offload", False),
            },
            "precision": point.get("precision", "fp32"),
            "run_dir": tempfile.gettempdir(),
        }
    )


def host_batch(cfg: RunConfig) -> dict[str, torch.Tensor]:
    """One micro batch as the loader delivers it: rows packed with documents of 300-700 tokens (positions
    restart, segments count them), every position a loss target (the masked-LM encoder: 15% of them; prefix-LM:
    the positions after a prefix of half of each document, which every position of it carries)."""
    gen = torch.Generator().manual_seed(0)
    rows, length, vocab = cfg.train.micro_batch_size, cfg.data.seq_len, cfg.model.vocab_size
    segments, positions, prefixes = [], [], []
    for _ in range(rows):
        lengths = []
        while sum(lengths) < length:
            lengths.append(int(torch.randint(300, 701, (1,), generator=gen)))
        lengths[-1] -= sum(lengths) - length
        segments.append(torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)]))
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
        starts = torch.tensor([0, *lengths[:-1]]).cumsum(0)
        prefixes.append(torch.cat([torch.full((n,), int(s) + n // 2) for s, n in zip(starts, lengths)]))
    ids = torch.randint(0, vocab, (rows, length + 1), generator=gen)
    batch = {
        "input_ids": ids[:, :-1].contiguous(),
        "labels": ids[:, 1:].contiguous(),
        "segment_ids": torch.stack(segments),
        "position_ids": torch.stack(positions),
    }
    if cfg.model.arch == "encoder":
        drop = torch.rand(rows, length, generator=gen) > 0.15
        batch["labels"] = batch["labels"].masked_fill(drop, IGNORE_INDEX)
    if cfg.objective == "prefix_lm":
        batch["prefix_len"] = torch.stack(prefixes)
        inside = torch.arange(length) < batch["prefix_len"] - 1
        batch["labels"] = batch["labels"].masked_fill(inside, IGNORE_INDEX)
    if cfg.model.arch == "encoder_decoder":  # the decoder's row: as long as the planner says (span corruption:
        # the targets of the row's examples, side by side)
        from megatransformer.planner import row_lengths

        target = row_lengths(cfg)[1]
        decoder = {"segment_ids": [], "position_ids": []}
        for row in batch["segment_ids"]:
            documents = torch.bincount(row)[1:]
            lengths = (documents * target // length).clamp(min=1)
            lengths[-1] += target - lengths.sum()
            decoder["segment_ids"].append(torch.repeat_interleave(torch.arange(1, len(lengths) + 1), lengths))
            decoder["position_ids"].append(torch.cat([torch.arange(int(n)) for n in lengths]))
        batch["decoder_input_ids"] = torch.randint(0, vocab, (rows, target), generator=gen)
        batch["labels"] = torch.randint(0, vocab, (rows, target), generator=gen)
        batch["decoder_segment_ids"] = torch.stack(decoder["segment_ids"])
        batch["decoder_position_ids"] = torch.stack(decoder["position_ids"])
    return batch


def bare_peak(cfg: RunConfig, by_address: bool = False) -> int:
    import train_step

    from megatransformer.model import build_model
    from megatransformer.model.masks import batch_masks
    from megatransformer.training.engine.tiled_mlp import apply_tiled_mlp

    def build() -> Callable[[], None]:
        torch.manual_seed(0)
        model = build_model(cfg.model)
        if cfg.model.mlp_tiles > 1:  # (as the trainer applies them)
            apply_tiled_mlp(model, cfg.model.mlp_tiles)
        runner = train_step.Runner("ours", model, cfg.precision, "cpu", False, {"fused": True})
        batch = host_batch(cfg)
        masks = batch_masks(cfg.model.arch, batch)
        labels = batch.pop("labels")
        input_ids = batch.pop("input_ids")
        batch.pop("segment_ids")  # (the masks carry them)
        for key in ("decoder_segment_ids", "prefix_len"):
            batch.pop(key, None)
        return lambda: runner.step(input_ids, labels, masks=masks, **batch)

    return live_peak(build, by_address=by_address)


def engine_rank(rank: int, ranks: int, port: int, point: dict, out: str) -> None:
    import torch.distributed as dist

    from megatransformer.training.engine.train_module import TrainModule
    from megatransformer.training.runtime.distributed import teardown

    cfg = run_config(point)
    dist_info = join(rank, ranks, port)
    modules = []

    def build() -> Callable[[], None]:
        module = TrainModule(cfg, dist_info, zero_stage=cfg.parallel.zero_stage)
        modules.append(module)
        batch = host_batch(cfg)

        def batches():
            while True:
                yield batch

        stream = batches()
        return lambda: module.step(stream)

    peak = live_peak(build, by_address=point.get("by_address", False))
    peaks = [None] * ranks
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        Path(out).write_text(json.dumps(max(peaks)))
    for module in modules:
        module.close()
    teardown()


def engine_peak(point: dict) -> int:
    """The largest rank's peak. A run one of whose ranks aborts in C++ (SIGABRT: now and then the profiler's
    "terminate called without an active exception" as its profile ends, BENCHMARKS.md 5v) is run once more."""
    try:
        return spawn_ranks(point)
    except mp.ProcessExitedException as error:
        if error.signal_name != "SIGABRT":
            raise
        print(f"plan_memory: {error}; running the point once more", file=sys.stderr)
        return spawn_ranks(point)


def spawn_ranks(point: dict) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "peak.json")
        mp.spawn(engine_rank, args=(point.get("ranks", 1), free_port(), point, out), nprocs=point.get("ranks", 1))
        return json.loads(Path(out).read_text())


def planned(point: dict) -> dict[str, int]:
    from megatransformer.planner import Layout, cpu_device, memory_parts

    cfg = run_config(point)
    p = cfg.parallel
    ranks = point.get("ranks", 1)
    layout = Layout(
        dp=ranks // (p.tensor_parallel * p.sequence_parallel),
        tp=p.tensor_parallel,
        sp=p.sequence_parallel,
        zero=p.zero_stage if point["runner"] == "engine" else 0,
        activation_checkpointing=cfg.model.activation_checkpointing,
        mlp_tiles=cfg.model.mlp_tiles,
        offload=p.offload_optimizer,
        micro_batch=cfg.train.micro_batch_size,
        accum=1,
    )
    parts = memory_parts(cfg, layout, cpu_device(), engine=point["runner"] == "engine")
    # (the measured steps come before any save: the checkpointer's copies do not exist yet)
    parts["total"] -= parts.pop("checkpoint_staging")
    return parts


def measure(point: dict) -> dict:
    cfg = run_config(point)
    measured = bare_peak(cfg, point.get("by_address", False)) if point["runner"] == "bare" else engine_peak(point)
    parts = planned(point)
    return {**point, "measured": measured, "planned": parts["total"], "parts": parts}


MODELS = {
    "decoder-gqa": dict(d_model=128, n_layers=2, n_heads=8, n_kv_heads=2, d_ff=352, vocab_size=2048),
    "decoder-mha": dict(d_model=128, n_layers=2, n_heads=4, d_ff=352, vocab_size=2048, ffn="gelu"),
    "encoder": dict(arch="encoder", d_model=128, n_layers=2, n_heads=4, d_ff=512, vocab_size=2048, ffn="gelu"),
    "encoder-decoder": dict(
        arch="encoder_decoder", d_model=128, n_layers=2, n_heads=4, d_ff=512, vocab_size=2048, ffn="relu"
    ),
}
# the attention kinds and terms the grid above leaves out, on the decoder
VARIANTS = {
    "decoder-mla": dict(MODELS["decoder-gqa"], n_kv_heads=None, attention="mla", kv_lora_rank=64, q_lora_rank=96),
    "decoder-qk-norm": dict(MODELS["decoder-gqa"], qk_norm=True),
    "decoder-window": dict(MODELS["decoder-gqa"], attention_window=256),
}


def grid(quick: bool) -> list[dict]:
    points = []

    def add(model: str, seq_len: int, runner: str = "bare", **extra) -> None:
        fields = dict((MODELS | VARIANTS)[model], max_seq_len=seq_len, attention_backend="chunked")
        fields |= {k: extra.pop(k) for k in ("activation_checkpointing", "mlp_tiles") if k in extra}
        name = " ".join([model, *([extra["objective"]] if "objective" in extra else [])])
        points.append({"name": name, "model": fields, "seq_len": seq_len, "micro_batch": 1, "runner": runner, **extra})

    if quick:
        add("decoder-gqa", 512)
        add("decoder-gqa", 512, runner="engine")
        return points
    for model in MODELS:
        for seq_len in (512, 2048):
            add(model, seq_len)
    for seq_len in (512, 4096):
        add("decoder-gqa", seq_len, activation_checkpointing=True)
        add("decoder-gqa", seq_len, mlp_tiles=4)
        add("decoder-gqa", seq_len, precision="bf16")
    for precision in ("fp32", "bf16"):
        add("decoder-gqa", 2048, runner="engine", precision=precision)
        for zero in (0, 1, 2, 3):
            add("decoder-gqa", 1024, runner="engine", precision=precision, zero=zero, ranks=2)
    add("decoder-gqa", 2048, runner="engine", tp=2, ranks=2)
    add("decoder-gqa", 2048, runner="engine", sp=2, ranks=2)
    add("decoder-gqa", 4096, runner="engine", sp=2, ranks=2, mlp_tiles=4)
    add("encoder-decoder", 1024, runner="engine", zero=2, ranks=2, precision="bf16")
    for model in VARIANTS:
        for seq_len in (512, 2048):
            add(model, seq_len)
    add("decoder-gqa", 2048, objective="prefix_lm")
    add("decoder-window", 8192)
    add("decoder-mla", 2048, runner="engine", tp=2, ranks=2)
    add("decoder-qk-norm", 2048, runner="engine", tp=2, ranks=2)
    add("decoder-gqa", 1024, runner="engine", objective="prefix_lm", zero=2, ranks=2)
    for precision in ("fp32", "bf16"):
        add("decoder-gqa", 2048, runner="engine", precision=precision, zero=3, tp=2, ranks=2)
        for zero in (1, 2, 3):
            add("decoder-gqa", 1024, runner="engine", precision=precision, zero=zero, ranks=2, offload=True)
    add("decoder-gqa", 1024, runner="engine", zero=3, tp=2, ranks=4)
    add("decoder-gqa", 2048, runner="engine", zero=2, offload=True)
    for model in MODELS:  # (the slowest last)
        add(model, 8192)
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few points only")
    parser.add_argument("--only", default=None, help="run the points whose description contains this")
    parser.add_argument("--by-address", action="store_true", help="tell blocks apart by address (live_peak)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, one thread per rank")
    columns = ["model", "seq_len", "runner", "ranks", "precision", "zero", "tp", "sp", "ckpt", "tiles", "offload"]
    columns += ["measured MiB", "plan MiB", "plan / measured"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for point in grid(args.quick):
        label = json.dumps(point)
        if args.only and args.only not in label:
            continue
        point["by_address"] = args.by_address
        r = measure(point)
        m = r["model"]
        print(
            f"| {r['name']} | {r['seq_len']} | {r['runner']} | {r.get('ranks', 1)} | {r.get('precision', 'fp32')} | "
            f"{r.get('zero', 0)} | {r.get('tp', 1)} | {r.get('sp', 1)} | "
            f"{'on' if m.get('activation_checkpointing') else 'off'} | {m.get('mlp_tiles', 1)} | "
            f"{'on' if r.get('offload') else 'off'} | "
            f"{r['measured'] / 2**20:.2f} | {r['planned'] / 2**20:.2f} | {r['planned'] / r['measured']:.3f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
