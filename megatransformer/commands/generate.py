"""``megatransformer generate``: sample from a checkpoint, streaming tokens to the terminal, or beam search."""

from __future__ import annotations

import argparse
import sys

from megatransformer.console import to_stderr


def register(subparsers: argparse._SubParsersAction) -> None:
    from megatransformer.commands.arguments import add_beam_arguments, add_dtype_argument, add_zero_stage_argument

    p = subparsers.add_parser(
        "generate",
        help="continue a prompt with a trained model (KV-cached)",
        description="Continue --prompt with a checkpoint's model, streaming the text, or beam-search it (--num-beams); "
        "under torchrun with --zero-stage 3 every rank holds a part of the model and rank 0 prints; "
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
    add_dtype_argument(p)
    add_zero_stage_argument(p)
    add_beam_arguments(p)
    p.add_argument("overrides", nargs="*", metavar="model.key=value", help="e.g. model.attention_window=64")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import io
    import os

    from megatransformer.commands.arguments import zero_stage
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
    stage = zero_stage(args)
    partitioned = stage == 3
    speaks = os.environ.get("RANK", "0") == "0" or not partitioned  # (partitioned, rank 0 alone prints)
    say = to_stderr if speaks else lambda line: None
    # (PyTorch and the weights: seconds, on a busy machine tens of them; on stderr: stdout holds the text)
    say(f"loading {args.checkpoint}")
    import torch

    from megatransformer.commands.eval import bf16_matmuls
    from megatransformer.inference import inference_device, load_model
    from megatransformer.lockstep import joined, rank_0s
    from megatransformer.training.threads import say_threads

    say_threads(say)
    device = inference_device(say)
    with joined(torch.device(device), int(os.environ.get("WORLD_SIZE", 1)) if partitioned else 1):
        loaded = load_model(args.checkpoint, device, args.overrides, args.dtype, stage, "generate")
        # Partitioned, every rank runs every forward (each gathers every layer), so all must take the same number:
        # each step takes rank 0's token (beam search: rank 0's ranked candidates), broadcast. Each rank's own
        # sample from its own logits could differ in a last bit (another GPU's reduction order), and a token or an
        # EOS that differs would end one rank's decoding while the others wait in the next forward's gathers. One
        # small broadcast a step, beside a gather of the whole model.
        agreed = rank_0s if partitioned else None
        out = sys.stdout if speaks else io.StringIO()
        with bf16_matmuls(args.dtype, loaded.device)():
            decode(args, loaded, out, agreed)
    return 0


def decode(args: argparse.Namespace, loaded, out, agreed) -> None:
    """``--prompt`` continued by ``loaded``'s model, written to ``out``: streamed as sampled, or beam-searched."""
    import torch

    from megatransformer.config import ConfigError
    from megatransformer.inference import beam_decode, decoder_start_id, new_token_limit
    from megatransformer.model import stream

    tok = loaded.tokenizer
    if tok is None:
        raise ConfigError(f"{loaded.path} has no tokenizer.json to encode the prompt with")
    prompt = tok.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt encodes to no tokens")
    max_new_tokens = new_token_limit(loaded.cfg, len(prompt), args.max_new_tokens)
    decoder = loaded.cfg.model.arch == "decoder"
    if args.num_beams > 1:
        tokens = beam_decode(
            loaded, [prompt], args.num_beams, args.length_penalty, args.length_penalty_form, max_new_tokens, 1, agreed
        )[0]
        text = tok.decode(tokens, skip_special=True)
        print(args.prompt + text if decoder else text, file=out)
        return
    # (the same seed on another device draws other samples)
    generator = torch.Generator(device=loaded.device).manual_seed(args.seed)
    tokens, shown = [], ""
    if decoder:
        out.write(args.prompt)
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
        agreed=agreed,
    ):
        if int(token[0]) == tok.eos_id:
            break
        tokens.append(int(token[0]))
        text = tok.decode(tokens, skip_special=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(text[len(shown) :])
            out.flush()
            shown = text
    out.write("\n")
