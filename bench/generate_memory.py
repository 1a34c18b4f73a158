"""The peak resident memory of generation (``model.generate``: a prompt's forward, then a token at a time) with
the output head on each row's last position alone, against the head on every prompt position (the code before:
[B, T, V] logits of the prompt), side by side in fresh processes; random weights, a large vocabulary.

    OMP_NUM_THREADS=2 python bench/generate_memory.py [--rows 4] [--prompt 512] [--vocab 128256]

Memory is not load-sensitive; each figure is one process's peak RSS (torch and the model's own included).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, resource, sys, torch
from megatransformer.config import RunConfig
from megatransformer.model import build_model, generate
from megatransformer.model import transformer
rows, prompt, vocab, every = map(int, sys.argv[1:5])
if every:  # (the head on every position, as before logits_to_keep)
    transformer.last_positions = lambda hidden, count: hidden
cfg = RunConfig.model_validate({"model": {"d_model": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "d_ff": 512,
    "vocab_size": vocab, "max_seq_len": prompt + 16}, "data": {"seq_len": prompt}})
model = build_model(cfg.model, 0).eval()
ids = torch.randint(0, vocab, (rows, prompt), generator=torch.Generator().manual_seed(0))
out = generate(model, ids, 8)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"tokens": out.tolist(), "peak_kib": peak}))
"""


def measured(rows: int, prompt: int, vocab: int, every: bool) -> dict:
    argv = [sys.executable, "-c", CHILD, str(rows), str(prompt), str(vocab), str(int(every))]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    last = measured(args.rows, args.prompt, args.vocab, every=False)
    every = measured(args.rows, args.prompt, args.vocab, every=True)
    logits_mib = args.rows * args.prompt * args.vocab * 4 / 2**20
    print(
        f"rows {args.rows}, prompt {args.prompt} tokens, vocabulary {args.vocab:,}: prompt logits {logits_mib:,.0f} MiB"
    )
    for name, result in (("last position", last), ("every position", every)):
        print(f"  head on {name}: peak {result['peak_kib'] / 1024:,.0f} MiB")
    print(f"  same tokens: {last['tokens'] == every['tokens']}")
    print(f"  peak ratio (last / every): {last['peak_kib'] / every['peak_kib']:.2f}")


if __name__ == "__main__":
    main()
