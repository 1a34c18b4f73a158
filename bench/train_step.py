"""Training-step throughput: megatransformer vs transformers.LlamaForCausalLM, same weights, batch and optimizer.

Both models are built from one ModelConfig (weights copied through ``megatransformer.hf``), see the same
token batch, compute the loss the way our trainer does (fp32 cross-entropy over the logits) and step the
same torch AdamW. Runs alternate (every runner once per round, the order reversed on odd rounds) so that load from other
processes on a shared machine hits all alike; the reported figure is the median over rounds of the per-round ratio
``their step time / our step time`` (> 1 means we are faster).

Precision modes (``--modes``):
  fp32        fp32 weights and compute.
  autocast    fp32 weights, ``torch.autocast(bfloat16)`` around forward and loss (what a plain HF script does).
  bf16        bf16 weights and activations, fp32 master weights in the optimizer: what DeepSpeed's
              ``"bf16": {"enabled": true}`` does and therefore what ``megatransformer train precision=bf16``
              runs. Mimicked with a plain torch loop (grads cast to fp32, fp32 AdamW step, weights copied back
              to bf16) so the bench needs no distributed init; DeepSpeed's BF16_Optimizer does the same work.

All runners (implementation x mode) are timed in one rotation, so cross-mode ratios are side by side too;
the table adds the headline comparison: each of our modes vs HF with bf16 autocast.

Peak memory: on CPU there is no ``max_memory_allocated``; we profile one step with
``torch.profiler(profile_memory=True)`` and integrate the allocator's alloc/free events to get the peak of
live tensor bytes during the step, and add the bytes alive before it (weights, master weights, optimizer
state). That counts tensors only (not Python/allocator overhead), identically for both implementations.

    python bench/train_step.py                        # d512 L8 H8 KV4 FFN1408 V8192, batch 4 x 512
    python bench/train_step.py --modes bf16 --rounds 5 --steps 3
    python bench/train_step.py --profile ours-chunked --modes bf16   # where the time goes
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatransformer.batch import IGNORE_INDEX  # noqa: E402
from megatransformer.config import ModelConfig  # noqa: E402
from megatransformer.hf import hf_family  # noqa: E402
from megatransformer.model import build_model  # noqa: E402
from megatransformer.training.runtime.cpu_bf16 import CHOICES, gemms_as_fp32, matmul_context  # noqa: E402

MODES = ("fp32", "autocast", "bf16")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The workload's options (model shape and batch), shared by the benches that time a training step."""
    p.add_argument("--d-model", type=int, default=512, help="model width")
    p.add_argument("--layers", type=int, default=8, help="decoder layers")
    p.add_argument("--heads", type=int, default=8, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (grouped-query attention)")
    p.add_argument("--ffn", type=int, default=1408, help="SwiGLU hidden size")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size")
    p.add_argument("--batch", type=int, default=4, help="sequences per (micro) batch")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    p.add_argument("--tie", action="store_true", help="tie embeddings (Llama default: untied)")


def parse_args(argv: list[str] | None = None, parents: tuple[argparse.ArgumentParser, ...] = ()) -> argparse.Namespace:
    """This bench's options, plus those of ``parents`` (a bench built on this one adds its own)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=list(parents))
    add_model_args(p)
    p.add_argument(
        "--backends", default="sdpa,chunked", help="our model.attention_backend(s), each timed side by side against HF"
    )
    p.add_argument("--modes", default="fp32,autocast,bf16", help=f"comma list of {MODES}")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per mode (ratio = median)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per implementation and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per implementation and mode")
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--no-memory", action="store_true", help="skip the profiled peak-memory step")
    p.add_argument("--profile", help="ours-<backend> or hf: print a torch.profiler table of one step and exit")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: process CPU time, immune to other processes' load (use with --threads 1)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--cpu-bf16-matmul",
        choices=CHOICES,
        default="auto",
        help="bf16 GEMMs of both implementations on a CPU, as train.cpu_bf16_matmul",
    )
    args = p.parse_args(argv)
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {MODES}")
    return args


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        d_ff=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=max(args.seq, 2048),
        norm="rmsnorm",
        position="rope",
        ffn="swiglu",
        tie_embeddings=args.tie,
        norm_eps=1e-6,
    )


# ------------------------------------------------------------------------------------------ training step


class Runner:
    """One model + optimizer in one precision mode; ``step()`` is a full training step.

    ``adamw``: keyword arguments for ``torch.optim.AdamW`` over the defaults (lr 1e-4, weight decay 0.1,
    torch's default implementation), e.g. a run config's betas and ``fused=True`` as the trainer uses them.
    ``cpu_bf16_matmul``: how bf16 GEMMs run on a CPU, as the trainer's ``train.cpu_bf16_matmul``.
    ``z_loss``: our head's z-loss coefficient, as the trainer's ``train.z_loss``.
    ``grad_clip``: clip the global gradient norm (of the fp32 gradients in bf16) to this, with PyTorch's foreach
    kernels on the device, as the trainer's ``train.grad_clip`` (None: no clipping).
    """

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        mode: str,
        device: str,
        compile_: bool,
        adamw: dict | None = None,
        cpu_bf16_matmul: str = "auto",
        z_loss: float = 0.0,
        grad_clip: float | None = None,
    ) -> None:
        self.name, self.mode, self.device, self.grad_clip = name, mode, device, grad_clip
        self.objective = {"z_loss": z_loss} if z_loss else {}
        dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        self.matmuls = matmul_context(gemms_as_fp32(cpu_bf16_matmul, device, dtype, compile_))
        model = model.to(device)
        if mode == "bf16":
            model = model.to(torch.bfloat16)
            self.master = [p.detach().float().clone() for p in model.parameters()]
            for m in self.master:
                m.grad = torch.zeros_like(m)
            opt_params = self.master
        else:
            self.master = None
            opt_params = list(model.parameters())
        self.model = model.train()
        self.forward = torch.compile(model) if compile_ else model
        self.params = list(model.parameters())
        self.optimizer = torch.optim.AdamW(opt_params, **{"lr": 1e-4, "weight_decay": 0.1, **(adamw or {})})
        self.is_hf = name == "hf"

    def logits(self, input_ids: torch.Tensor, **inputs) -> torch.Tensor:
        out = self.forward(input_ids=input_ids, **inputs)
        return out.logits if self.is_hf else out

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, **inputs) -> float:
        """``inputs``: further model inputs (position_ids, masks= built once per batch, ...)."""
        autocast = torch.autocast(self.device, torch.bfloat16) if self.mode == "autocast" else contextlib.nullcontext()
        with self.matmuls():
            with autocast:
                if self.is_hf:
                    loss = F.cross_entropy(self.logits(input_ids, **inputs).float().flatten(0, 1), labels.flatten())
                else:  # the loss fused into our head, as the trainer computes it (model.head.linear_cross_entropy)
                    loss = self.forward(input_ids=input_ids, labels=labels, **inputs, **self.objective)
                    loss = (loss[0] if self.objective else loss) / (labels != IGNORE_INDEX).sum()
            loss.backward()
        if self.master is not None:  # DeepSpeed bf16: fp32 grads -> fp32 AdamW -> copy weights back to bf16
            for p, m in zip(self.params, self.master):
                m.grad.copy_(p.grad)
                p.grad = None
            if self.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.master, self.grad_clip, foreach=True)
            self.optimizer.step()
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)
        else:
            if self.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip, foreach=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def state_bytes(self) -> int:
        """Bytes alive between steps: weights, master weights (+ their grad buffers), optimizer state."""
        tensors = {id(p): p for p in self.params}
        for m in self.master or []:
            tensors[id(m)], tensors[id(m.grad)] = m, m.grad
        for state in self.optimizer.state.values():
            for t in state.values():
                if torch.is_tensor(t):
                    tensors[id(t)] = t
        return sum(t.numel() * t.element_size() for t in tensors.values())


def build_runners(cfg: ModelConfig, mode: str, args: argparse.Namespace) -> dict[str, Runner]:
    """``ours-<backend>`` for each backend and ``hf``, all holding the same initial weights."""
    torch.manual_seed(0)
    state = build_model(cfg).state_dict()
    runners = {}
    for backend in args.backends.split(","):
        ours = build_model(cfg.model_copy(update={"attention_backend": backend}))
        ours.load_state_dict(state)
        runners[f"ours-{backend}"] = Runner(
            "ours", ours, mode, args.device, args.compile, cpu_bf16_matmul=args.cpu_bf16_matmul
        )
    runners["hf"] = hf_runner(cfg, state, mode, args.device, args.compile, args.cpu_bf16_matmul)
    return runners


def hf_runner(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    mode: str,
    device: str,
    compile_: bool,
    cpu_bf16_matmul: str = "auto",
) -> Runner:
    """The transformers model ``cfg`` maps onto (LlamaForCausalLM or GPT2LMHeadModel, SDPA attention) holding
    our weights ``state``, with torch's default AdamW."""
    import transformers

    family = hf_family(cfg)
    config = transformers.AutoConfig.for_model(family.model_type, **family.config(cfg))
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(family.to_hf(state, cfg), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set()), missing
    return Runner("hf", hf, mode, device, compile_, cpu_bf16_matmul=cpu_bf16_matmul)


def make_batch(cfg: ModelConfig, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1].contiguous().to(args.device), tokens[:, 1:].contiguous().to(args.device)


def timed_steps(runner: Runner, batch, steps: int, clock: str) -> float:
    """Median seconds per step over ``steps`` steps (wall clock, or this process's CPU time)."""
    now = time.perf_counter if clock == "wall" else time.process_time
    times = []
    for _ in range(steps):
        start = now()
        runner.step(*batch)
        times.append(now() - start)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------ memory


def peak_step_bytes(runner: Runner, batch) -> int:
    """Peak live tensor bytes during one step: state before the step + max of the alloc/free running sum."""
    from torch.profiler import ProfilerActivity, profile

    before = runner.state_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.step(*batch)
    # every allocator alloc (+bytes) / free (-bytes) of the step, with its own timestamp
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return before + peak


# ------------------------------------------------------------------------------------------ report


@dataclass
class Timings:
    """Per-round median step seconds of every (implementation, mode) runner, all measured in one rotation."""

    seconds: dict[tuple[str, str], list[float]]
    peak: dict[tuple[str, str], int]

    def step_s(self, key: tuple[str, str]) -> float:
        return statistics.median(self.seconds[key])

    def ratios(self, ours: tuple[str, str], theirs: tuple[str, str]) -> list[float]:
        """Per-round speed-up of ``ours`` over ``theirs`` (their time / our time, same round)."""
        return [t / o for o, t in zip(self.seconds[ours], self.seconds[theirs])]


def run_all(cfg: ModelConfig, modes: list[str], args: argparse.Namespace, batch) -> Timings:
    runners: dict[tuple[str, str], Runner] = {}
    for mode in modes:
        for name, runner in build_runners(cfg, mode, args).items():
            runners[(name, mode)] = runner
            for _ in range(args.warmup):
                runner.step(*batch)
    keys = list(runners)
    seconds: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    for rnd in range(args.rounds):
        for key in keys if rnd % 2 == 0 else reversed(keys):
            seconds[key].append(timed_steps(runners[key], batch, args.steps, args.clock))
        print(f"# round {rnd + 1}: " + ", ".join(f"{k[0]}-{k[1]} {v[-1]:.3f}s" for k, v in seconds.items()), flush=True)
    peak = {} if args.no_memory else {k: peak_step_bytes(r, batch) for k, r in runners.items()}
    return Timings(seconds, peak)


def profile_one(cfg: ModelConfig, mode: str, args: argparse.Namespace, batch) -> None:
    from torch.profiler import ProfilerActivity, profile

    runner = build_runners(cfg, mode, args)[args.profile]
    runner.step(*batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step(*batch)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def header(cfg: ModelConfig, args: argparse.Namespace) -> str:
    import transformers

    params = sum(p.numel() for p in build_model(cfg).parameters())
    return (
        f"# {datetime.date.today()} {platform.processor() or platform.machine()} threads={torch.get_num_threads()}"
        f" torch={torch.__version__} transformers={transformers.__version__}\n"
        f"# model d{cfg.d_model} L{cfg.n_layers} H{cfg.n_heads} KV{cfg.kv_heads} FFN{cfg.d_ff} V{cfg.vocab_size}"
        f" tie={cfg.tie_embeddings} params={params / 1e6:.1f}M"
        f" compile={args.compile}; batch {args.batch} x {args.seq}; clock={args.clock};"
        f" cpu_bf16_matmul={args.cpu_bf16_matmul};"
        f" {args.rounds} rounds x {args.steps} steps (+{args.warmup} warmup)\n"
        f"# command: python {' '.join(sys.argv)}"
    )


def table(t: Timings, modes: list[str], backends: list[str], tokens: int) -> str:
    def mib(key):
        return f"{t.peak[key] / 2**20:,.0f}" if key in t.peak else "-"

    pairs = [(m, m) for m in modes]
    if "autocast" in modes:  # the headline: each of our modes vs what an HF user runs for bf16
        pairs += [(m, "autocast") for m in modes if m != "autocast"]
    lines = [
        "| ours (backend, mode) | HF mode | ours tok/s | HF tok/s | speed-up ours/HF (median; per round)"
        " | ours peak MiB | HF peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for ours_mode, hf_mode in pairs:
        for backend in backends:
            ours, hf = (f"ours-{backend}", ours_mode), ("hf", hf_mode)
            ratios = t.ratios(ours, hf)
            lines.append(
                f"| {backend}, {ours_mode} | {hf_mode} | {tokens / t.step_s(ours):,.0f} | {tokens / t.step_s(hf):,.0f}"
                f" | **{statistics.median(ratios):.2f}x**; {', '.join(f'{x:.2f}' for x in ratios)}"
                f" | {mib(ours)} | {mib(hf)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = model_config(args)
    batch = make_batch(cfg, args)
    modes = args.modes.split(",")
    if args.profile:
        profile_one(cfg, modes[0], args, batch)
        return 0
    print(header(cfg, args), flush=True)
    timings = run_all(cfg, modes, args, batch)
    print(table(timings, modes, args.backends.split(","), args.batch * args.seq))
    return 0


if __name__ == "__main__":
    sys.exit(main())
