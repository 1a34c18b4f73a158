"""The one command that verifies a GPU machine: ``python bench/gpu_check.py [--out DIR]``.

1. Every ``gpu``-marked test of the repository, real kernels: flash-attn and PyTorch's ``varlen_attn``
   against ``eager`` for every mask (causal, bidirectional, prefix-LM per row and per document, packed
   documents, padding, packed cross-attention, KV cache; each with a sliding window too), with and without
   ALiBi; the loss fused into the head
   against the plain head; the loader's page-locked batches. Each must pass, and none skip but the expected
   skips (``EXPECTED_SKIPS``: flash-attn 2 where it is not installed, multi-GPU tests on fewer GPUs, flash-attn 4
   on a torch that passes it wrong windows), which are reported with their reasons.
2. Host syncs and collective devices of one optimizer step on CUDA (``bench/step_probe.py``): the waits our
   code asks for and every wait CUDA itself sees (its sync debug mode, with the line that asked for each),
   within the budgets below.
3. A short packed bf16 training run through the real trainer (``megatransformer quickstart`` with a larger
   model), reporting tokens/s, MFU and peak memory from its metrics.jsonl.

Prints one JSON object (also written to DIR/gpu_check.json) and exits 0 when every check passed, 1 when one
failed, 2 on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN_OVERRIDES = [  # ~120M-parameter Llama-style decoder, 8 x 1024 tokens, packed documents, bf16
    "model.d_model=768",
    "model.n_layers=12",
    "model.n_heads=12",
    "model.n_kv_heads=4",
    "model.d_ff=2048",
    "model.max_seq_len=1024",
    "data.seq_len=1024",
    "train.micro_batch_size=8",
    "train.max_steps=60",
    "train.log_every=10",
    "train.eval_every=0",
    "train.sample_prompt=",
    "precision=bf16",
    "model.attention_backend=auto",
    "checkpoint.every=1000",
    "wandb.mode=disabled",
]
# Waits for the GPU in one optimizer step. Our code waits once (the step's verdict, read in one transfer); the
# rest are DeepSpeed's (gradient clipping, overflow checks: deepspeed/runtime/utils.py, ZeRO-2's overflow flag).
# The CUDA-seen totals by ZeRO stage are the first H200's (BENCHMARKS.md): more is a regression.
OUR_SYNC_BUDGET = 1
HOST_SYNC_BUDGET = 5  # the reads of device values the host asks for, DeepSpeed's .item() calls included
CUDA_SYNC_BUDGET = {0: 3, 1: 5, 2: 9}  # every wait CUDA's sync debug mode sees
GPU_MARK = re.compile(r"\bmark\.gpu\b")


def gpu_test_files() -> list[str]:
    """Every test file that marks a test ``gpu``: the ones pytest collects, so that a module of CPU tests whose
    imports the GPU machine lacks (pyarrow's data tests, lm-eval's) neither fails nor skips the collection."""
    files = sorted((ROOT / "tests").rglob("test_*.py"))
    return [str(f.relative_to(ROOT)) for f in files if GPU_MARK.search(f.read_text())]


def gpu_tests_command() -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rs", "-p", "no:cacheprovider", *gpu_test_files()]


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, **kwargs)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


# Skips a GPU machine may show, each with the fact about the machine that makes it expected there: reported, not
# failures. Any other skip fails the check (a test that should have run on this machine did not).
EXPECTED_SKIPS = (
    (
        "flash-attn 2",
        re.compile(r"flash-attn package"),
        lambda machine, match: not machine["flash_attn"],
        "flash-attn 2 is not installed (PyPI has only its source, a build of hours; not installable offline)",
    ),
    (
        "fewer GPUs",
        re.compile(r"needs (\d+) CUDA GPUs"),
        lambda machine, match: machine["gpus"] < int(match.group(1)),
        "this machine has fewer GPUs than the test needs",
    ),
    (
        "flash-attn 4 on this torch",
        re.compile(r"flash-attn 4 on torch \S+: needs torch >= "),
        lambda machine, match: machine["fa4_torch_refusal"] is not None,
        "this torch passes flash-attn 4 wrong windows (gpu_cores.REGISTRY_TORCH)",
    ),
)


def machine_facts() -> dict:
    """What the expected skips depend on, read from this machine."""
    import torch

    from megatransformer.model import gpu_cores
    from megatransformer.model.attention import flash_attn_module

    return {
        "flash_attn": flash_attn_module() is not None,
        "gpus": torch.cuda.device_count(),
        "fa4_torch_refusal": gpu_cores.torch_refusal("fa4"),
    }


def sort_skips(skip_lines: list[str], machine: dict) -> tuple[list[dict], list[str]]:
    """pytest's ``SKIPPED`` lines as (expected: each with its rule and why, unexpected)."""
    expected, unexpected = [], []
    for line in skip_lines:
        for name, pattern, applies, why in EXPECTED_SKIPS:
            match = pattern.search(line)
            if match and applies(machine, match):
                expected.append({"skip": line, "rule": name, "why": why})
                break
        else:
            unexpected.append(line)
    return expected, unexpected


def gpu_tests(machine: dict | None = None) -> dict:
    """Every ``gpu``-marked test: all must pass, and none may skip but those ``EXPECTED_SKIPS`` allows on this
    machine (reported under ``expected_skips``); pytest exits 5 when none ran."""
    done = run(gpu_tests_command())
    summary = last_line(done.stdout)
    skip_lines = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    facts = machine if machine is not None or not skip_lines else machine_facts()
    expected, skipped = sort_skips(skip_lines, facts or {})
    ok = done.returncode == 0 and " passed" in summary and not skipped
    report = {"ok": ok, "summary": summary or last_line(done.stderr)}
    if expected:
        report["expected_skips"] = expected
    if skipped:
        report["skipped"] = skipped
    if not ok and not skipped:
        report["output"] = (done.stdout + done.stderr)[-3000:]
    return report


def probe_ok(probe: dict) -> bool:
    cuda_syncs, sites = probe.get("cuda_syncs"), probe.get("cuda_sync_sites") or {}
    ours = sum(waits for site, waits in sites.items() if not site.startswith("deepspeed/"))
    return (
        probe["collective_devices"] == ["cuda:0"]
        and probe["host_syncs"] <= HOST_SYNC_BUDGET
        and cuda_syncs is not None
        and cuda_syncs <= CUDA_SYNC_BUDGET[probe["zero"]]
        and ours <= OUR_SYNC_BUDGET
    )


def step_probe() -> dict:
    """Host syncs and collective devices of one step: ZeRO-0 in fp32 (the torch optimizer), ZeRO-1/2 in bf16
    must keep within the budgets above. bf16 with ZeRO-0 is reported, not judged: DeepSpeed's unfused bf16
    optimizer reads every parameter's overflow flag and norm (17 waits at 1 layer, 35 at 3 on CPU; the run log
    warns)."""
    cases = [
        {"layers": 2, "accum": 2, "zero": z, "precision": "fp32" if z == 0 else "bf16", "objective": o}
        for z in (0, 1, 2)
        for o in ("autoregressive", "prefix_lm")
    ]
    reported = [{"layers": 2, "accum": 2, "zero": 0, "precision": "bf16"}]
    done = run([sys.executable, "bench/step_probe.py", json.dumps(cases + reported)])
    probes = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    judged = probes[: len(cases)]
    ok = done.returncode == 0 and len(probes) == len(cases) + len(reported) and all(map(probe_ok, judged))
    return {
        "ok": ok,
        "probes": judged,
        "reported": probes[len(cases) :],
        **({} if ok else {"stderr": done.stderr[-2000:]}),
    }


def training_command(out: Path) -> list[str]:
    paths = [f"run_dir={out}/run", f"data.train={out}/data/shards", f"data.tokenizer={out}/data/tokenizer.json"]
    return [sys.executable, "-m", "megatransformer", "quickstart", *paths, *TRAIN_OVERRIDES]


def packed_attention_core(log_lines: list[str]) -> str | None:
    """The core the run log's attention line names for packed documents."""
    for line in log_lines:
        match = re.search(r"-> (\w+) for every mask|(\w+) for packed documents", line)
        if match:
            return match.group(1) or match.group(2)
    return None


def training(out: Path) -> dict:
    """The packed run must attend with a flash kernel: flash-attn 4 / 3 / 2, or PyTorch's ``varlen_attn``."""
    done = run(training_command(out))
    metrics_file = out / "run" / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    steps = [m for m in metrics if "tokens_per_s" in m]
    if done.returncode != 0 or not steps:
        return {"ok": False, "stderr": done.stderr[-3000:]}
    last = steps[-1]
    attention = [line for line in done.stdout.splitlines() if line.startswith("attention:")]
    return {
        "ok": packed_attention_core(attention) in ("fa4", "fa3", "flash", "varlen"),
        "attention": attention,
        "tokens_per_s": last["tokens_per_s"],
        "mfu": last["mfu"],
        "max_memory_gib": last.get("max_memory_gib"),
        "loss": last["loss"],
        "steps": last["step"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where to write data, the run and gpu_check.json")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device here; run this on a GPU machine", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    out.mkdir(parents=True, exist_ok=True)
    from megatransformer.model import gpu_cores
    from megatransformer.model.attention import flash_attn_module

    flash = flash_attn_module()
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": importlib.metadata.version("deepspeed"),
        "flash_attn": None if flash is None else flash.__version__,
        "flash_registry": {core: gpu_cores.registry_impl_installed(core) for core in gpu_cores.REGISTRY_IMPLS},
    }
    parts = {"gpu_tests": gpu_tests, "step_probe": step_probe, "training": lambda: training(out)}
    for name, part in parts.items():  # (the report on disk after each: what is known, should a time limit end it)
        report[name] = part()
        print(f"gpu_check: {name}: {'ok' if report[name]['ok'] else 'FAILED'}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    report["ok"] = all(report[name]["ok"] for name in parts)
    text = json.dumps(report, indent=2)
    (out / "gpu_check.json").write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
