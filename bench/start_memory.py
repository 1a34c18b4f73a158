"""Each rank's peak resident memory over a whole short training run (start-up, the model's construction, one
step, the end), measured from outside: every torchrun rank runs under ``/usr/bin/time -f %M`` (torchrun
``--no-python`` with a wrapper that writes ``rss.$RANK``), and the same run of a tiny model (the process's own
cost) is subtracted (DESIGN.md section 14). The planner's figure for the layout (its largest moment, as ``plan``
reports it) is printed beside it, with the ratio.

    OMP_NUM_THREADS=1 python bench/start_memory.py                  # 53.5M decoder, 4 ranks, ZeRO-3, bf16
    OMP_NUM_THREADS=1 python bench/start_memory.py --zero 1 --ranks 2

Memory is not load-sensitive: the numbers hold on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIG = {"d_model": 768, "n_layers": 8, "n_heads": 12, "n_kv_heads": 4, "d_ff": 2048}
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 96}
VOCAB = 4096
WRAPPER = """#!/bin/sh
exec /usr/bin/time -f %M -o "{out}/rss.$RANK" "{python}" -m megatransformer.cli train --config /dev/null "$@"
"""


def make_data(root: Path) -> tuple[Path, Path]:
    from data_pipeline.corpus import write_demo_corpus
    from data_pipeline.shard import write_shards
    from data_pipeline.tokenizer import train_tokenizer

    corpus = write_demo_corpus(root / "corpus.txt", max_bytes=1_000_000)
    tokenizer = root / "tokenizer.json"
    train_tokenizer([str(corpus)], VOCAB, tokenizer)
    shards = root / "shards"
    write_shards([str(corpus)], str(tokenizer), shards, shard_mb=1, valid_every=50, workers=1, progress=False)
    return tokenizer, shards


def overrides(model: dict, data: tuple[Path, Path], run_dir: Path, zero: int, precision: str) -> list[str]:
    tokenizer, shards = data
    return [
        *(f"model.{k}={v}" for k, v in (model | {"vocab_size": VOCAB, "max_seq_len": 128}).items()),
        f"data.train={shards}",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=128",
        "train.micro_batch_size=1",
        "train.grad_accum=1",
        "train.max_steps=1",
        "checkpoint.every=1000",
        "wandb.mode=disabled",
        f"precision={precision}",
        f"parallel.zero_stage={zero}",
        f"run_dir={run_dir}",
    ]


def torchrun(ranks: int) -> list[str]:
    """torchrun on this machine for ``ranks`` ranks, each running the command that follows (``--no-python``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "--no-python"]


def peak_rss_mib(
    model: dict, data: tuple[Path, Path], root: Path, ranks: int, zero: int, precision: str
) -> list[float]:
    """Each rank's peak RSS (MiB) over the run."""
    out = Path(tempfile.mkdtemp(dir=root))
    wrapper = out / "rank.sh"
    wrapper.write_text(WRAPPER.format(out=out, python=sys.executable))
    wrapper.chmod(0o755)
    command = [
        *torchrun(ranks),
        str(wrapper),
        *overrides(model, data, out / "run", zero, precision),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if done.returncode != 0:
        raise SystemExit(f"the run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return [int((out / f"rss.{r}").read_text().split()[-1]) / 1024 for r in range(ranks)]


def planned_mib(model: dict, ranks: int, zero: int, precision: str) -> tuple[float, str]:
    """The planner's figure per rank for the layout, as ``megatransformer plan`` and ``train.check_memory`` compare
    it with this machine's memory: the largest of its moments (construction, engine start, loading, the step; device
    and host together on a CPU), and which moment that is."""
    from megatransformer.commands.plan import config_layout
    from megatransformer.config import load_config
    from megatransformer.planner import cpu_device, memory_parts, peaks

    cfg = load_config(None, overrides(model, (Path("t"), Path("s")), Path("r"), zero, precision))
    device = cpu_device(ranks)
    layout, _ = config_layout(cfg, ranks, "cpu")
    moments = peaks(cfg, layout, device, memory_parts(cfg, layout, device))
    moment = max(moments, key=lambda name: moments[name].on(device))
    return moments[moment].on(device) / 2**20, moment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--precision", default="bf16")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_data(root)
        tiny = peak_rss_mib(TINY, data, root, args.ranks, args.zero, args.precision)
        big = peak_rss_mib(BIG, data, root, args.ranks, args.zero, args.precision)
    above = [b - t for b, t in zip(big, tiny)]
    print(f"{args.ranks} ranks, ZeRO-{args.zero}, {args.precision}, d 768 x 8 layers (53.5M), one step")
    print("peak RSS per rank (MiB):    " + "  ".join(f"{v:7.0f}" for v in big))
    print("tiny model's run (MiB):     " + "  ".join(f"{v:7.0f}" for v in tiny))
    print("above the tiny run (MiB):   " + "  ".join(f"{v:7.0f}" for v in above) + f"   (largest {max(above):.0f})")
    plan, moment = planned_mib(BIG, args.ranks, args.zero, args.precision)
    print(f"planner (MiB):              {plan:7.0f}   ({moment}; largest / planner: {max(above) / plan:.2f})")


if __name__ == "__main__":
    main()
