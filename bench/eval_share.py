"""The in-loop evaluation's share of a training run's wall time: `megatransformer train` of a config (the
quickstart's by default) with train.evals running a local multiple-choice task made from the demo corpus, at
train.evals.every's default (0: once, at the end of training) or at --every; the seconds each evaluation took
(``eval_s`` of metrics.jsonl's validation records) against the wall time of the whole process, start-up
included.

    python bench/eval_share.py                                  # the quickstart run, 300 steps, 100 items
    python bench/eval_share.py --every 100                      # an evaluation every 100 steps
    python bench/eval_share.py --steps 10 --items 20 --set model.n_layers=1 model.d_model=64   # a smoke run

The share depends on how long the run is and how large the task: with the default interval the harness runs
once, so a longer run has a smaller share. On a machine shared with other work both sides are slowed alike, or
not: say which load it ran under.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="quickstart", help="a config name or YAML file (default: quickstart)")
    p.add_argument("--steps", type=int, default=300, help="train.max_steps")
    p.add_argument("--every", type=int, default=None, help="train.evals.every (default: the config's own)")
    p.add_argument("--items", type=int, default=100, help="items of the multiple-choice task")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more overrides of the config")
    p.add_argument("--work", type=Path, default=None, help="folder for the data and the run (default: a temporary one)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from megatransformer.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        every = [f"train.evals.every={args.every}"] if args.every is not None else []
        cfg = load_config(args.config, [*args.set, *every])
        shards, tokenizer, corpus = prepare_data(work, cfg.model.vocab_size)
        task = write_task(corpus, work / "tasks", args.items)
        run_dir = work / "run"
        overrides = [
            f"run_dir={run_dir}",
            f"data.train={shards}",
            f"data.tokenizer={tokenizer}",
            f"train.max_steps={args.steps}",
            f"train.evals.tasks=[{task}]",
            *every,
            f"checkpoint.every={args.steps}",
            "wandb.mode=disabled",
            *args.set,
        ]
        started = time.perf_counter()
        log = work / "train.log"
        with log.open("w") as out:
            command = [sys.executable, "-m", "megatransformer.cli", "train", "--config", args.config, *overrides]
            code = subprocess.run(command, env=environment(), stdout=out, stderr=subprocess.STDOUT).returncode
        wall = time.perf_counter() - started
        if code != 0:
            sys.stderr.write("".join(log.read_text().splitlines(keepends=True)[-15:]))
            raise SystemExit(f"megatransformer train exited {code}; its output: {log}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evaluations = [r for r in records if "eval_s" in r]
    result = {
        "config": args.config,
        "steps": args.steps,
        "every": cfg.train.evals.every,
        "items": args.items,
        "evaluations": len(evaluations),
        "eval_s": sum(r["eval_s"] for r in evaluations),
        "wall_s": wall,
        "share": sum(r["eval_s"] for r in evaluations) / wall,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{args.config}, {args.steps} steps, train.evals.every={result['every']} ({len(evaluations)} evaluations of "
        f"{args.items} multiple-choice items): {result['eval_s']:.1f} s of {wall:.1f} s wall time = "
        f"{result['share']:.1%}"
    )
    return 0


def environment() -> dict[str, str]:
    """This checkout's code; nothing downloaded."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def prepare_data(work: Path, vocab: int) -> tuple[Path, Path, Path]:
    """``(shards, tokenizer, corpus)``: the demo corpus, a tokenizer of ``vocab`` tokens and its shards in
    ``work`` (once)."""
    shards, tokenizer, corpus = work / "shards", work / "tokenizer.json", work / "corpus.txt"
    if (shards / "manifest.json").is_file():
        return shards, tokenizer, corpus
    work.mkdir(parents=True, exist_ok=True)
    for words in (
        ("data", "demo-corpus", "--out", str(corpus)),
        ("data", "tokenizer", "--input", str(corpus), "--vocab-size", str(vocab), "--out", str(tokenizer)),
        ("data", "shard", "--input", str(corpus), "--tokenizer", str(tokenizer), "--out", str(shards), "--overwrite"),
    ):
        command = [sys.executable, "-m", "megatransformer.cli", *words]
        subprocess.run(command, env=environment(), check=True, stdout=subprocess.DEVNULL)
    return shards, tokenizer, corpus


def write_task(corpus: Path, folder: Path, items: int) -> Path:
    """A multiple-choice task of ``items`` items from the corpus's documents (a document's first words; its next
    four words and those of three other documents as the choices) and its YAML."""
    docs = [d.split() for d in (p.strip() for p in corpus.read_text().split("\n\n")) if len(d.split()) >= 40]
    if len(docs) < items + 3:
        raise SystemExit(f"the demo corpus has {len(docs)} documents of 40 words or more; ask for fewer --items")
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "choices.jsonl"
    with data.open("w") as f:
        for i in range(items):
            cut = 8 + i % 24
            gold = i % 4
            choices = [" " + " ".join(docs[i + (k - gold) % 4][cut : cut + 4]) for k in range(4)]
            f.write(json.dumps({"context": " ".join(docs[i][:cut]), "choices": choices, "gold": gold}) + "\n")
    task = folder / "bench_choices.yaml"
    task.write_text(
        f"task: bench_choices\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data.resolve()}}}}}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: gold\n'
        "metric_list: [{metric: acc}, {metric: acc_norm}]\n"
    )
    return task


if __name__ == "__main__":
    sys.exit(main())
