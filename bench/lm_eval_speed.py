"""Requests per second of our lm-eval LM (megatransformer/harness.py) against lm-eval's own Hugging Face model
(``hf``) on the same weights (an ``export --format hf`` of them), request kind by kind, side by side:

  loglikelihood          multiple-choice style: a context and 4 continuations per item
  loglikelihood_rolling  whole documents, longer than the model's length (several windows each)
  generate_until         greedy, up to 32 new tokens or a newline

Both run the same requests at the same batch size, in one process, fp32 on the CPU (or --device), each kind
run by one right after the other (the order reversed every other round); the table gives each one's median
requests/s and the median over rounds of ours / theirs (each round's pair under the same load). Random weights
of a small Llama-style decoder and a tokenizer trained on the demo corpus; nothing is downloaded. On a machine
shared with other work, only the ratios mean anything, and those only for that load.

    python bench/lm_eval_speed.py                                  # 3 rounds, 64 items, batch 16
    python bench/lm_eval_speed.py --items 16 --rounds 1            # a quick check that it runs
    python bench/lm_eval_speed.py --d-model 512 --layers 8 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=64, help="items (documents, prompts) per request kind")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="model.max_seq_len")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import torch
    from lm_eval.models.huggingface import HFLM

    with tempfile.TemporaryDirectory() as tmp:
        cfg, model, tok, hf_dir = build(Path(tmp), args)
        from megatransformer import harness

        ours = harness.HarnessLM(
            model.to(args.device).eval(), cfg, tok, harness.Placement(torch.device(args.device)), args.batch_size
        )
        theirs = HFLM(pretrained=str(hf_dir), dtype="float32", batch_size=args.batch_size, device=args.device)
        kinds = request_sets(tok, Path(tmp) / "corpus.txt", args.items)
        rates: dict[str, dict[str, list[float]]] = {kind: {"ours": [], "hf": []} for kind in kinds}
        for round_ in range(args.rounds):
            for kind, requests in kinds.items():
                order = [("ours", ours), ("hf", theirs)]
                for name, lm in order if round_ % 2 == 0 else order[::-1]:
                    with harness.quiet():
                        started = time.perf_counter()
                        getattr(lm, kind)(requests)
                        rates[kind][name].append(len(requests) / (time.perf_counter() - started))
    table = {
        kind: {
            "requests": len(kinds[kind]),
            "ours_per_s": statistics.median(r["ours"]),
            "hf_per_s": statistics.median(r["hf"]),
            "ratio": statistics.median(a / b for a, b in zip(r["ours"], r["hf"])),
        }
        for kind, r in rates.items()
    }
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    print(
        f"d_model {args.d_model}, {args.layers} layers, max_seq_len {args.seq_len}, batch {args.batch_size}, "
        f"{args.rounds} rounds on {args.device}"
    )
    print(f"{'request kind':<24}{'requests':>9}{'ours/s':>10}{'hf/s':>10}{'ours/hf':>9}")
    for kind, row in table.items():
        print(f"{kind:<24}{row['requests']:>9}{row['ours_per_s']:>10.1f}{row['hf_per_s']:>10.1f}{row['ratio']:>8.2f}x")
    return 0


def build(tmp: Path, args):
    """A random Llama-style decoder, a demo-corpus tokenizer and the transformers export of both."""
    import torch

    from data_pipeline.corpus import write_demo_corpus
    from data_pipeline.tokenizer import train_tokenizer
    from megatransformer.config import RunConfig
    from megatransformer.hf import save_hf_dir
    from megatransformer.model import build_model

    corpus = write_demo_corpus(tmp / "corpus.txt", max_bytes=300_000)
    tok = train_tokenizer([str(corpus)], 1024, tmp / "tokenizer.json")
    model_cfg = {
        "d_model": args.d_model,
        "n_layers": args.layers,
        "n_heads": max(args.d_model // 64, 1),
        "vocab_size": tok.vocab_size,
        "max_seq_len": args.seq_len,
        "tie_embeddings": False,
        "init_std": 0.05,
    }
    cfg = RunConfig.model_validate({"model": model_cfg, "data": {"seq_len": args.seq_len}})
    torch.manual_seed(0)
    model = build_model(cfg.model)
    ids = {role: getattr(tok, f"{role}_id") for role in ("bos", "eos", "pad")}
    save_hf_dir(tmp / "hf", cfg.model, model.state_dict(), tmp / "tokenizer.json", ids)
    return cfg, model, tok, tmp / "hf"


def request_sets(tok, corpus: Path, items: int) -> dict[str, list]:
    """The three request kinds, ``items`` items each, from the corpus's documents."""
    from lm_eval.api.instance import Instance

    docs = [d.strip() for d in corpus.read_text().split("\n\n") if len(d.split()) >= 20][: items + 4]
    choice, rolling, generation = [], [], []
    for i in range(items):
        words = docs[i].split()
        context = " ".join(words[: 8 + i % 24])
        for k in range(4):
            continuation = " " + " ".join(docs[i + k].split()[8 + i % 24 :][:4])
            choice.append(Instance("loglikelihood", {}, (context, continuation), len(choice)))
        rolling.append(Instance("loglikelihood_rolling", {}, (docs[i][:3000],), i))
        until = {"until": ["\n"], "max_gen_toks": 32, "do_sample": False}
        generation.append(Instance("generate_until", {}, (context, until), i))
    return {"loglikelihood": choice, "loglikelihood_rolling": rolling, "generate_until": generation}


if __name__ == "__main__":
    sys.exit(main())
