"""Peak resident memory of the commands that read or write a model's weights: ``export`` (``--format safetensors``
and ``hf``), ``average`` of two checkpoints, ``import --hf`` and ``generate`` (one token: loading the model is
the work), each measured from outside (``/usr/bin/time -f %M``) and less the same command on a tiny model (the
process's own cost), as a fraction of the model's fp32 bytes. Each
checkout given (``--code NAME=PATH``, repeatable: this one, a worktree of an earlier commit) runs every command,
the checkouts alternating over ``--rounds``, so an earlier version and this one are read side by side.

    git worktree add /tmp/before <commit>
    OMP_NUM_THREADS=1 python bench/weights_io.py --code after=. --code before=/tmp/before

The default model (d 2048, 8 layers, d_ff 5504, vocabulary 32000: 0.54B parameters, 2.1 GB in fp32) fits one
5 GB weights file, so the new code holds a whole file of it; above 5 GB it holds one file of at most that.
Memory is not load-sensitive: the numbers hold on a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

BIG = {"d_model": 2048, "n_layers": 8, "n_heads": 16, "n_kv_heads": 16, "d_ff": 5504, "vocab_size": 32000}
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "d_ff": 96, "vocab_size": 32000}


def commands(source: Path, out: Path) -> dict[str, list[str]]:
    """The measured commands, reading the checkpoints and transformers directory made in ``source``."""
    c1, c2, hf = (str(source / name) for name in ("c1", "c2", "hf"))
    return {
        "export safetensors bf16": ["export", "--checkpoint", c1, "--out", str(out), "--dtype", "bf16"],
        "export hf bf16": ["export", "--checkpoint", c1, "--out", str(out), "--format", "hf", "--dtype", "bf16"],
        "average 2": ["average", "--checkpoints", c1, c2, "--out", str(out)],
        "import hf (bf16)": ["import", "--hf", hf, "--out", str(out)],
        "generate 1 token": ["generate", "--checkpoint", c1, "--prompt", "The", "--max-new-tokens", "1"],
    }


def make_sources(model: dict, root: Path) -> int:
    """Two fp32 weights checkpoints of a random Llama-style model (with a tokenizer) and its bf16
    transformers directory, in ``root``; the model's fp32 bytes."""
    from data_pipeline.corpus import write_demo_corpus
    from data_pipeline.tokenizer import train_tokenizer
    from megatransformer.checkpoint import write_weights_checkpoint
    from megatransformer.config import RunConfig
    from megatransformer.hf import save_hf_dir
    from megatransformer.model import build_model

    cfg = RunConfig.model_validate({"model": model | {"max_seq_len": 128}, "data": {"seq_len": 128}})
    state = build_model(cfg.model, 0).state_dict()
    tokenizer = root / "tokenizer.json"
    train_tokenizer([str(write_demo_corpus(root / "corpus.txt", max_bytes=100_000))], 1024, tokenizer)
    write_weights_checkpoint(root / "c1", cfg, state, tokenizer)
    write_weights_checkpoint(root / "c2", cfg, ((name, tensor * 2) for name, tensor in state.items()), tokenizer)
    save_hf_dir(root / "hf", cfg.model, state, dtype=torch.bfloat16)
    return sum(tensor.nbytes for tensor in state.values())


def peak_mib(tree: Path, argv: list[str], work: Path) -> float:
    """The peak resident MiB of ``megatransformer ARGV`` run from the sources in ``tree`` (its working directory:
    python puts that first on its path)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    record = work / "rss"
    subprocess.run(
        ["/usr/bin/time", "-f", "%M", "-o", str(record), sys.executable, "-m", "megatransformer.cli", *argv],
        env=env,
        cwd=tree,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return int(record.read_text().split()[-1]) / 1024


def check_tree(tree: Path) -> None:
    """``tree``'s sources, not the installed ones, are what runs with it as PYTHONPATH and working directory."""
    probe = [sys.executable, "-c", "import megatransformer; print(megatransformer.__file__)"]
    found = subprocess.run(probe, env={**os.environ, "PYTHONPATH": str(tree)}, cwd=tree, capture_output=True, text=True)
    if not found.stdout.strip().startswith(str(tree)):
        raise SystemExit(f"--code {tree}: python imports {found.stdout.strip() or found.stderr} instead")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", action="append", default=[], help="NAME=PATH of a checkout (repeatable)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", default=json.dumps(BIG), help="the model's fields as JSON")
    args = parser.parse_args()
    codes = {name: Path(path).resolve() for name, path in (c.split("=", 1) for c in args.code)}
    codes = codes or {"here": Path(".").resolve()}
    for tree in codes.values():
        check_tree(tree)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "big").mkdir()
        (root / "tiny").mkdir()
        whole = make_sources(json.loads(args.model), root / "big")
        make_sources(TINY, root / "tiny")
        print(f"model: {whole / 2**30:.2f} GiB in fp32; peak RSS above the tiny model's run, MiB (fraction of it)")
        results: dict[str, dict[str, list[float]]] = {}
        for _ in range(args.rounds):
            for code, tree in codes.items():
                for name, argv in commands(root / "big", root / "out").items():
                    big = peak_mib(tree, argv, root)
                    shutil.rmtree(root / "out", ignore_errors=True)
                    tiny = peak_mib(tree, commands(root / "tiny", root / "out")[name], root)
                    shutil.rmtree(root / "out", ignore_errors=True)
                    results.setdefault(name, {}).setdefault(code, []).append(big - tiny)
        ratio = " ratio |" if len(codes) == 2 else ""
        print(f"| command | {' | '.join(codes)} |{ratio}")
        print("|---|" + "---|" * (len(codes) + bool(ratio)))
        for name, by_code in results.items():
            figures = [min(by_code[code]) for code in codes]
            cells = " | ".join(f"{mib:,.0f} ({mib * 2**20 / whole:.2f})" for mib in figures)
            print(f"| {name} | {cells} |" + (f" {figures[0] / figures[1]:.2f}x |" if ratio else ""))


if __name__ == "__main__":
    main()
