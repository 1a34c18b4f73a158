"""``megatransformer generate``: sample from a checkpoint, streaming tokens to the terminal, or beam search."""

from __future__ import annotations

import argparse
import sys

from megatransformer.console import to_stderr


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="continue a prompt with a trained model (KV-cached)",
        description="Continue --prompt with a checkpoint's model, streaming the text, or beam-search it (--num-beams); "
        "model.* overrides that keep the weights' shapes may follow the options (e.g. model.max_seq_len=4096 "
        "model.rope_scaling='{type: dynamic, factor: 2, original_max_seq_len: 2048}').",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint, checkpoints directory or run directory")
    p.add_argument("--prompt", required=True, help="text to continue (encoder input for encoder-decoder models)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="stop after this many new tokens (or at EOS); default: 64 for decoders, the input length "
        "+ 50 for encoder-decoders",
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only (default: all)")
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="sample from the smallest set of tokens whose probability reaches p (default: off)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed gives the same text)")
    add_beam_arguments(p)
    p.add_argument("overrides", nargs="*", metavar="model.key=value", help="e.g. model.attention_window=64")
    p.set_defaults(func=run)


def add_beam_arguments(p: argparse.ArgumentParser) -> None:
    """Beam search options, shared with ``eval --bleu``."""
    p.add_argument(
        "--num-beams",
        type=int,
        default=1,
        help="beam search with this many beams (generate: 1 samples as --temperature says; eval --bleu: 1 is greedy)",
    )
    p.add_argument(
        "--length-penalty",
        type=float,
        default=0.6,
        help="beam search: alpha of the length penalty (the 2017 paper: 0.6)",
    )
    p.add_argument(
        "--length-penalty-form",
        choices=["gnmt", "hf"],
        default="gnmt",
        help="gnmt: score / ((5 + |Y|) / 6) ** alpha; hf: score / |Y| ** alpha, as transformers",
    )


def run(args: argparse.Namespace) -> int:
    from megatransformer.config import ConfigError

    if (
        args.temperature < 0
        or (args.top_p is not None and not 0 < args.top_p <= 1)
        or (args.top_k is not None and args.top_k < 1)
    ):
        raise ConfigError("need --temperature >= 0, 0 < --top-p <= 1 and --top-k >= 1")
    if args.num_beams < 1 or (args.num_beams > 1 and (args.top_k is not None or args.top_p is not None)):
        raise ConfigError(
            "--num-beams must be >= 1 and does not combine with --top-k / --top-p (beam search does not sample)"
        )
    # (PyTorch and the weights: seconds, on a busy machine tens of them; stderr: stdout holds the text)
    to_stderr(f"loading {args.checkpoint}")
    import torch

    from megatransformer.training.threads import say_threads

    say_threads(to_stderr)

    from megatransformer.inference import (
        beam_decode,
        decoder_start_id,
        inference_device,
        load_for_inference,
        new_token_limit,
    )
    from megatransformer.model import stream

    loaded = load_for_inference(args.checkpoint, inference_device(to_stderr), args.overrides)
    tok = loaded.tokenizer
    if tok is None:
        raise ConfigError(f"{loaded.path} has no tokenizer.json to encode the prompt with")
    prompt = tok.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt encodes to no tokens")
    max_new_tokens = new_token_limit(loaded.cfg, len(prompt), args.max_new_tokens)
    if args.num_beams > 1:
        tokens = beam_decode(
            loaded, [prompt], args.num_beams, args.length_penalty, args.length_penalty_form, max_new_tokens
        )[0]
        text = tok.decode(tokens, skip_special=True)
        print(args.prompt + text if loaded.cfg.model.arch == "decoder" else text)
        return 0
    # (the same seed on another device draws other samples)
    generator = torch.Generator(device=loaded.device).manual_seed(args.seed)
    tokens, shown = [], ""
    if loaded.cfg.model.arch == "decoder":
        sys.stdout.write(args.prompt)
    for token in stream(
        loaded.model,
        torch.tensor([prompt], device=loaded.device),
        max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tok.eos_id,
        generator=generator,
        decoder_start_id=decoder_start_id(loaded.cfg, tok),
        prefix_lm=loaded.cfg.objective == "prefix_lm",
    ):
        if int(token[0]) == tok.eos_id:
            break
        tokens.append(int(token[0]))
        text = tok.decode(tokens, skip_special=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[len(shown) :])
            sys.stdout.flush()
            shown = text
    sys.stdout.write("\n")
    return 0
