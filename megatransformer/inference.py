"""Loading a checkpoint's consolidated weights into a plain model, for eval, generation and export."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from megatransformer.config import ConfigError, RunConfig, precision_dtype
from megatransformer.model import LanguageModel, construct


@dataclass
class Loaded:
    cfg: RunConfig
    model: LanguageModel
    tokenizer: object | None  # data_pipeline.tokenizer.TokenizerInfo
    path: Path

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def inference_device(say: Callable[[str], None]) -> str:
    """Where a command runs the model: this rank's GPU as training picks it (``LOCAL_RANK``'s; Slurm may show a task
    its own GPU only, which ``say`` is told), or the CPU where there is none."""
    if not torch.cuda.is_available():
        return "cpu"
    from megatransformer.training.runtime.distributed import cuda_device, tell_deepspeed_the_device

    index, line = cuda_device(int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count())
    if line is not None:
        say(line)
        tell_deepspeed_the_device(index)  # (--zero-stage 3 builds the model under DeepSpeed's zero.Init)
    return f"cuda:{index}"


# Model fields that act only in training: an override of one would change nothing in evaluation or generation.
TRAINING_ONLY = (
    "dropout",
    "attention_dropout",
    "embedding_dropout",
    "init_std",
    "depth_scaled_init",
    "activation_checkpointing",
    "mlp_tiles",
)


def load_model(
    path: str | Path, device: str, model_overrides: list[str], dtype: str, zero_stage: int, command: str
) -> Loaded:
    """The checkpoint's model as ``command`` runs it: whole on ``device`` (:func:`load_for_inference`), or at
    ``zero_stage`` 3 partitioned over the process group's ranks (:func:`load_partitioned`)."""
    if zero_stage != 3:
        return load_for_inference(path, device, model_overrides, dtype, command)
    from megatransformer.console import held_stdout
    from megatransformer.training.runtime.host_memory import map_large_blocks

    map_large_blocks()  # (each layer's gathered parameters returned to the kernel when freed, not kept)
    with held_stdout():
        return load_partitioned(path, dtype, model_overrides)


def load_for_inference(
    path: str | Path,
    device: str = "cpu",
    model_overrides: list[str] = (),
    dtype: str = "fp32",
    command: str = "generate",
) -> Loaded:
    """The checkpoint's model on ``device`` in ``dtype`` (fp32 | bf16), with ``model.*`` overrides applied (see
    :func:`with_model_overrides`): made there, then its weights read into it one tensor at a time (the host holds
    one tensor, not the model), each cast as it is copied in. A model larger than the device's free memory is
    refused before a weight is read (:func:`refuse_unless_it_fits`, whose fix names ``command``)."""
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.checkpoint import find_checkpoint, load_state, load_weights

    directory = find_checkpoint(path, f"--checkpoint {path}")
    cfg, weights = load_weights(directory, lazy=True)
    cfg = with_model_overrides(cfg, model_overrides)
    refuse_unless_it_fits(cfg, device, dtype, command)
    with torch.device(device), default_dtype(precision_dtype(dtype)):
        model = construct(cfg.model)  # (no initial values: the checkpoint's replace them all)
    load_state(model, weights)
    tokenizer_path = directory / "tokenizer.json"
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path.is_file() else None
    return Loaded(cfg, model.eval(), tokenizer, directory)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors made inside without a dtype are ``dtype`` (a model's parameters and buffers, as casting it after)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def load_partitioned(path: str | Path, dtype: str = "fp32", model_overrides: list[str] = ()) -> Loaded:
    """The checkpoint's model, with ``model.*`` overrides applied, partitioned over the process group's ranks by
    ZeRO-3, on each rank's current device (DeepSpeed's accelerator's), each rank reading its partitions alone
    (``training.engine.construction.partitioned_for_inference``): every rank runs each forward together."""
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.checkpoint import find_checkpoint, load_weights
    from megatransformer.training.engine.construction import partitioned_for_inference

    directory = find_checkpoint(path, f"--checkpoint {path}")
    cfg, weights = load_weights(directory, lazy=True, shared=True)  # (each file hashed by one rank)
    cfg = with_model_overrides(cfg, model_overrides)
    model = partitioned_for_inference(cfg, weights, torch.distributed.get_world_size(), precision_dtype(dtype))
    tokenizer_path = directory / "tokenizer.json"
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path.is_file() else None
    return Loaded(cfg, model, tokenizer, directory)


def available_host_bytes() -> int | None:
    """The host memory the kernel can give without swapping (``MemAvailable``); None where it does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def free_bytes(device: str) -> int | None:
    """The memory free on ``device``: a GPU's (``torch.cuda.mem_get_info``), the host's for the CPU; None where
    it cannot be read."""
    if torch.device(device).type == "cuda":
        try:
            return torch.cuda.mem_get_info(torch.device(device))[0]
        except RuntimeError:
            return None
    return available_host_bytes()


def whole_model_bytes(cfg: RunConfig, dtype: str) -> int:
    """The bytes of the model's parameters in ``dtype`` (fp32 | bf16)."""
    from megatransformer.planner import parameter_counts

    return sum(parameter_counts(cfg.model)) * precision_dtype(dtype).itemsize


def refuse_unless_it_fits(cfg: RunConfig, device: str, dtype: str, command: str) -> None:
    """A :class:`ConfigError` naming the sizes and the fix (``command`` partitioned over enough torchrun ranks)
    when the whole model in ``dtype`` is larger than ``device``'s free memory; nothing where that is unknown. Ranks
    of a process group refuse together, should any (each rank's device has its own free memory)."""
    refusal = fit_refusal(cfg, device, dtype, command)
    if torch.distributed.is_initialized():
        every: list[str | None] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, refusal)
        refusal = next((line for line in every if line is not None), None)
    if refusal is not None:
        raise ConfigError(refusal)


def fit_refusal(cfg: RunConfig, device: str, dtype: str, command: str) -> str | None:
    """Why the whole model in ``dtype`` does not fit ``device``'s free memory, and the fix; None where it fits."""
    from megatransformer.planner import gathered_elements

    held, free = whole_model_bytes(cfg, dtype), free_bytes(device)
    if free is None or held <= free:
        return None
    # a ZeRO-3 rank holds its 1/N of the model and the layers it gathers for a forward
    room = free - gathered_elements(cfg.model, 1) * precision_dtype(dtype).itemsize
    ranks = max(2, -(-held // room)) if room > 0 else None
    fix = (
        f"partition it over {ranks} or more such devices: torchrun --nproc-per-node {ranks} -m megatransformer.cli "
        f"{command} ... --zero-stage 3"
        if ranks
        else "even partitioned (--zero-stage 3) a rank's gathered layers would not fit: use devices with more memory"
    )
    if dtype == "fp32" and held // 2 <= free:
        fix += f"; or --dtype bf16 ({size_text(held // 2)})"
    return f"the model's {size_text(held)} in {dtype} do not fit in the {size_text(free)} free on {device}; {fix}"


def size_text(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def with_model_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """``cfg`` with ``model.*`` overrides that keep the weights' shapes (a window, a RoPE scaling, a longer
    max_seq_len, another attention core...); one that would change a shape or that acts only in training is
    refused in one line, as is any other key."""
    from megatransformer.checkpoint import shape_differences
    from megatransformer.config import apply_overrides, validate

    for item in overrides:
        key = item.partition("=")[0]
        field = key.split(".")[1] if key.startswith("model.") else None
        if field is None:
            raise ConfigError(f"{item}: only model.* overrides apply to a trained model here")
        if field in TRAINING_ONLY:
            raise ConfigError(f"{item}: model.{field} acts only in training; it would change nothing here")
    if not overrides:
        return cfg
    new = validate(apply_overrides(cfg.model_dump(mode="json"), list(overrides)))
    changed = shape_differences(cfg.model, new.model)
    if changed:
        raise ConfigError(
            f"model.{changed[0]}={getattr(new.model, changed[0])} would change the shapes of the checkpoint's weights "
            f"(model.{changed[0]}={getattr(cfg.model, changed[0])} there); only model fields that keep them apply"
        )
    return new


def decoder_start_id(cfg: RunConfig, tokenizer) -> int | None:
    """The token encoder-decoder training put first in the decoder input (see data_pipeline.objectives)."""
    if cfg.model.arch != "encoder_decoder":
        return None
    if cfg.objective == "prefix_lm" and tokenizer.bos_id is not None:
        return tokenizer.bos_id
    return tokenizer.pad_id


@torch.no_grad()
def logits_of(model: LanguageModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**{k: v for k, v in batch.items() if k != "labels"})


DEFAULT_NEW_TOKENS = 64  # decoders; encoder-decoders default to the source length + 50 (the 2017 paper)


def new_token_limit(cfg: RunConfig, prompt_len: int, requested: int | None) -> int:
    """How many tokens generation may add to a prompt (decoder) or after a source (encoder-decoder):
    ``requested``, or the default capped at what model.max_seq_len leaves; a request beyond that is an error
    (ALiBi models have no position table and no such limit)."""
    decoder = cfg.model.arch == "decoder"
    if cfg.model.position == "alibi":  # no position table: any length
        return requested if requested is not None else DEFAULT_NEW_TOKENS if decoder else prompt_len + 50
    if not decoder and prompt_len > cfg.model.max_seq_len:
        raise ConfigError(f"the input has {prompt_len} tokens, more than model.max_seq_len={cfg.model.max_seq_len}")
    room = cfg.model.max_seq_len - (prompt_len if decoder else 1)
    if room < 1:
        raise ConfigError(
            f"the prompt ({prompt_len} tokens) leaves no room in model.max_seq_len={cfg.model.max_seq_len}"
        )
    if requested is None:
        return min(DEFAULT_NEW_TOKENS if decoder else prompt_len + 50, room)
    if requested > room:
        raise ConfigError(
            f"--max-new-tokens {requested} exceeds what model.max_seq_len={cfg.model.max_seq_len} "
            f"leaves after the prompt ({room})"
        )
    return requested


def beam_decode(
    loaded: Loaded,
    prompts: list[list[int]],
    num_beams: int,
    alpha: float,
    form: str,
    max_new_tokens: int | None = None,
    batch_size: int = 1,
    agreed: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[list[int]]:
    """The best beam-search continuation of every prompt (token ids), without its EOS. Prompts of equal length
    are searched together, ``batch_size`` at a time (no padding needed, and the same length limit for all);
    ``agreed``: as ``beam_search`` takes it."""
    from megatransformer.model.beam import beam_search

    tok = loaded.tokenizer
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    results: list[list[int]] = [[] for _ in prompts]
    for length, indices in by_length.items():
        limit = new_token_limit(loaded.cfg, length, max_new_tokens)
        for start in range(0, len(indices), batch_size):
            batch = indices[start : start + batch_size]
            best = beam_search(
                loaded.model,
                torch.tensor([prompts[i] for i in batch], device=loaded.device),
                limit,
                num_beams,
                tok.eos_id,
                alpha,
                form,
                decoder_start_id=decoder_start_id(loaded.cfg, tok),
                prefix_lm=loaded.cfg.objective == "prefix_lm",
                agreed=agreed,
            )
            for i, hyp in zip(batch, best):
                ends = hyp.tokens and hyp.tokens[-1] == tok.eos_id
                results[i] = hyp.tokens[:-1] if ends else hyp.tokens
    return results
