"""Each rank's peak resident memory and the wall time of ``eval --tasks`` under torchrun, each rank holding the
whole model (``--zero-stage 0``) or a part of it (``--zero-stage 3``: the forwards in step), measured from outside
(every rank under ``/usr/bin/time -f %M``) less the same command on a tiny model, as a fraction of the model's fp32
bytes. One multiple-choice task of items made from the demo corpus; random weights (the memory and the work do not
depend on them).

    OMP_NUM_THREADS=1 python bench/eval_memory.py --ranks 2 --rounds 2 [--dtype bf16]

Memory is not load-sensitive; the seconds are (compare them side by side only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIG = {"d_model": 1024, "n_layers": 12, "n_heads": 16, "n_kv_heads": 16, "d_ff": 2816}
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "d_ff": 96}
VOCAB = 4096
WRAPPER = """#!/bin/sh
exec /usr/bin/time -f %M -o "{out}/rss.$RANK" "{python}" -m megatransformer.cli "$@"
"""
TASK = """task: bench_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: {items}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list: [{{metric: acc}}]
"""


def make_sources(root: Path, items: int) -> tuple[Path, Path]:
    """A tokenizer and one task of ``items`` items (a document's first words, three continuations to choose from),
    in ``root``: (the tokenizer, the task's folder)."""
    from data_pipeline.corpus import write_demo_corpus
    from data_pipeline.tokenizer import train_tokenizer

    corpus = write_demo_corpus(root / "corpus.txt", max_bytes=300_000)
    tokenizer = root / "tokenizer.json"
    train_tokenizer([str(corpus)], VOCAB, tokenizer)
    docs = [d.split() for d in corpus.read_text().split("\n\n") if len(d.split()) >= 40][: items + 2]
    lines = []
    for i in range(items):
        choices = [" " + " ".join(docs[(i + k) % len(docs)][20:36]) for k in range(3)]
        lines.append(json.dumps({"context": " ".join(docs[i][:20]), "choices": choices, "gold": 0}))
    (root / "items.jsonl").write_text("\n".join(lines) + "\n")
    (root / "tasks").mkdir()
    (root / "tasks" / "bench_choice.yaml").write_text(TASK.format(items=root / "items.jsonl"))
    return tokenizer, root / "tasks"


def make_checkpoint(model: dict, tokenizer: Path, out: Path) -> int:
    """A weights checkpoint of a random Llama-style model of ``model``'s fields; its fp32 bytes."""
    from megatransformer.checkpoint import write_weights_checkpoint
    from megatransformer.config import RunConfig
    from megatransformer.model import build_model

    fields = model | {"vocab_size": VOCAB, "max_seq_len": 256}
    cfg = RunConfig.model_validate({"model": fields, "data": {"seq_len": 256}})
    state = build_model(cfg.model, 0).state_dict()
    write_weights_checkpoint(out, cfg, state, tokenizer)
    return sum(tensor.nbytes for tensor in state.values())


def measured(checkpoint: Path, tasks: Path, ranks: int, zero: int, root: Path, dtype: str) -> tuple[list[float], float]:
    """Each rank's peak RSS (MiB) and the command's seconds."""
    out = Path(tempfile.mkdtemp(dir=root))
    wrapper = out / "rank.sh"
    wrapper.write_text(WRAPPER.format(out=out, python=sys.executable))
    wrapper.chmod(0o755)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    command += ["--no-python", str(wrapper), "eval", "--checkpoint", str(checkpoint), "--include-path", str(tasks)]
    command += ["--tasks", "bench_choice", "--batch-size", "4", "--bootstrap-iters", "0", "--json"]
    command += ["--zero-stage", str(zero)] + (["--dtype", dtype] if dtype != "fp32" else [])
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_DATASETS_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"eval failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return [int((out / f"rss.{r}").read_text().split()[-1]) / 1024 for r in range(ranks)], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each stage, alternating")
    parser.add_argument("--items", type=int, default=24)
    parser.add_argument("--model", default=json.dumps(BIG), help="the model's fields as JSON")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="eval's --dtype")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer, tasks = make_sources(root, args.items)
        whole = make_checkpoint(json.loads(args.model), tokenizer, root / "big")
        make_checkpoint(TINY, tokenizer, root / "tiny")
        load = os.getloadavg()
        print(
            f"# model {whole / 2**20:,.0f} MiB in fp32, eval --dtype {args.dtype}, {args.ranks} ranks, {args.items} "
            f"items, load {load}"
        )
        print("| --zero-stage | peak RSS per rank above the tiny model's, MiB (fraction of the model) | seconds |")
        print("|---|---|---|")
        for _ in range(args.rounds):
            for zero in (0, 3):
                big, seconds = measured(root / "big", tasks, args.ranks, zero, root, args.dtype)
                tiny, _ = measured(root / "tiny", tasks, args.ranks, zero, root, args.dtype)
                above = [b - t for b, t in zip(big, tiny)]
                cells = " / ".join(f"{mib:,.0f} ({mib * 2**20 / whole:.2f})" for mib in above)
                print(f"| {zero} | {cells} | {seconds:.1f} |")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
