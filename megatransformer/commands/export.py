"""``megatransformer export`` and ``megatransformer import``: hand models to and from the ecosystem.

Formats: ``safetensors`` (our consolidated weights + config + tokenizer, readable without DeepSpeed) and
``hf`` (a ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen3ForCausalLM``, ``DeepseekV3ForCausalLM`` or
``GPT2LMHeadModel`` directory that ``transformers`` loads with no custom code; see megatransformer.hf).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatransformer.console import to_stderr


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint as consolidated safetensors or a HF model",
        description="Write a checkpoint's weights in one piece, whatever layout trained "
        "them: our safetensors format, or a directory that transformers loads "
        "with from_pretrained (Llama, Mistral, Qwen3, DeepSeek-V3 or GPT-2 architecture).",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint, checkpoints directory or run directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default="safetensors",
        help="safetensors: our weights + config + tokenizer; hf: a transformers Llama, Mistral, Qwen3, "
        "DeepSeek-V3 or GPT-2 directory",
    )
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the written weights")
    p.set_defaults(func=export)

    p = subparsers.add_parser(
        "import",
        help="turn a Hugging Face Llama, Mistral, Qwen3, DeepSeek-V3 or GPT-2 directory into a checkpoint for "
        "init_from=",
        description="Convert a Hugging Face Llama, Mistral, Qwen3, DeepSeek-V3 or GPT-2 model directory into a "
        "weights-only checkpoint that init_from=, eval and generate accept.",
    )
    p.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.set_defaults(func=import_hf)


def export(args: argparse.Namespace) -> int:
    import torch

    from megatransformer.checkpoint import find_checkpoint, load_weights, write_weights_checkpoint
    from megatransformer.config import ConfigError
    from megatransformer.hf import hf_family, hf_incompatibility, save_hf_dir

    checkpoint = find_checkpoint(args.checkpoint, f"--checkpoint {args.checkpoint}")
    cfg, weights = load_weights(checkpoint, lazy=True)  # (read a tensor, or a layer, at a time)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    out = Path(args.out)
    tokenizer = checkpoint / "tokenizer.json"
    if args.format == "hf":
        reason = hf_incompatibility(cfg.model)
        if reason:
            raise ConfigError(f"cannot export as a Hugging Face model: {reason}; use --format safetensors")
        if cfg.objective == "prefix_lm":
            to_stderr(
                "warning: this model was trained with objective=prefix_lm (a bidirectional prompt); "
                "a transformers causal LM reads prompts causally, so its outputs differ from `megatransformer "
                "generate`",
            )
        for note in hf_family(cfg.model).notes(cfg.model):
            to_stderr(f"note: {note} (the same outputs in evaluation mode)")
        special = _special_ids(tokenizer)
        family = save_hf_dir(out, cfg.model, weights, tokenizer if tokenizer.is_file() else None, special, dtype)
        print(f"wrote a {family.architecture} directory")
    else:
        write_weights_checkpoint(out, cfg, weights, tokenizer, dtype)
    print(f"exported {checkpoint} -> {out} ({args.format}, {args.dtype})")
    return 0


def _special_ids(tokenizer: Path) -> dict[str, int | None]:
    if not tokenizer.is_file():
        return {}
    from data_pipeline.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id, "unk": tok.unk_id}


def import_hf(args: argparse.Namespace) -> int:
    print(f"importing {args.hf}: loading PyTorch and the weights", flush=True)  # (stderr: an error's one line)
    from data_pipeline.settings import DataSettings
    from megatransformer.checkpoint import write_weights_checkpoint
    from megatransformer.config import ConfigError, RunConfig
    from megatransformer.hf import load_hf_dir

    out = Path(args.out)
    try:
        model_cfg, weights = load_hf_dir(Path(args.hf))
        run_cfg = RunConfig(model=model_cfg, data=DataSettings(seq_len=min(512, model_cfg.max_seq_len)))
        write_weights_checkpoint(out, run_cfg, weights, Path(args.hf) / "tokenizer.json")  # (a layer at a time)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    print(f"imported {args.hf} -> {out}; start a run from it with init_from={out}")
    return 0
