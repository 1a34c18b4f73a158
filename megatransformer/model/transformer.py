"""The model family: decoder-only, encoder-only and encoder-decoder Transformers.

Every model takes the batch keys of ``megatransformer.batch`` as keyword arguments and returns logits, or,
given ``labels``, the summed token loss computed without the logits (``head.linear_cross_entropy``).
Nothing here knows about parallelism or training: tensor parallelism is applied from ``tp_plan.TP_PLAN``.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megatransformer.config import ModelConfig
from megatransformer.model.attention import KVCache
from megatransformer.model.chunked_attention import in_core_forward
from megatransformer.model.head import LMHead
from megatransformer.model.layers import Block, make_norm
from megatransformer.model.masks import AttentionMask, ModelMasks, cross_attention_mask, self_attention_mask
from megatransformer.model.positions import Alibi, LearnedPositions, SinusoidalPositions, alibi_slopes
from megatransformer.model.rope_scaling import rotary


class Stack(nn.Module):
    """Positions, embedding dropout, the blocks and (pre-LN) the final norm; the self-attention mask gets the
    model's sliding window here, once per forward, for every layer."""

    def __init__(self, cfg: ModelConfig, n_layers: int, cross_attention: bool = False) -> None:
        super().__init__()
        self.positions = {
            "learned": lambda: LearnedPositions(cfg.max_seq_len, cfg.d_model),
            "sinusoidal": lambda: SinusoidalPositions(cfg.max_seq_len, cfg.d_model),
            "rope": lambda: None,
            "alibi": lambda: None,
        }[cfg.position]()
        self.rotary = rotary(cfg) if cfg.position == "rope" else None
        self.attention_window = cfg.attention_window
        self.alibi_heads = cfg.n_heads if cfg.position == "alibi" else None
        dropout = cfg.dropout if cfg.embedding_dropout is None else cfg.embedding_dropout
        self.embed_dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(Block(cfg, cross_attention) for _ in range(n_layers))
        use_final_norm = cfg.norm_position == "pre" and cfg.final_norm
        self.norm = make_norm(cfg) if use_final_norm else None
        self.activation_checkpointing = cfg.activation_checkpointing

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        mask: AttentionMask,
        memory: torch.Tensor | None = None,
        memory_mask: AttentionMask | None = None,
        caches: list[KVCache] | None = None,
        memory_kvs: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        if self.positions is not None:
            x = x + self.positions(position_ids).to(x.dtype)
        x = self.embed_dropout(x)
        mask = mask.with_window(self.attention_window)
        rope = self.rotary(position_ids, x.dtype) if self.rotary is not None else None
        alibi = None
        if self.alibi_heads is not None:  # slopes of all heads; each attention module takes its own
            alibi = Alibi(alibi_slopes(self.alibi_heads, x.device), position_ids, position_ids)
        for i, layer in enumerate(self.layers):
            cache = caches[i] if caches else None
            memory_kv = memory_kvs[i] if memory_kvs else None
            if self.activation_checkpointing and self.training:
                x = checkpoint(
                    layer,
                    x,
                    mask,
                    rope,
                    memory,
                    memory_mask,
                    alibi=alibi,
                    use_reentrant=False,
                    **({"context_fn": selective_contexts} if self.activation_checkpointing == "selective" else {}),
                )
            else:
                x = layer(x, mask, rope, memory, memory_mask, cache, memory_kv, alibi)
        return self.norm(x) if self.norm is not None else x


# the operations whose outputs selective activation checkpointing keeps: matrix products and attention kernels
# (the FLOPs of a block); everything else (norms, activations, rotations, dropout, masks) is recomputed
KEPT_BY_SELECTIVE_CHECKPOINTING = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective activation checkpointing's choice per operation: keep matrix products, recompute the rest (and
    every product inside the chunked attention core, which keeps its inputs and recomputes its chunks itself)."""
    if op in KEPT_BY_SELECTIVE_CHECKPOINTING and not in_core_forward():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy)


def kv_cache_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """What a layer's KV cache holds per token: (heads, key width, value width); under MLA one "head" of the
    latent (as keys) and the shared RoPE key (as values)."""
    if cfg.attention == "mla":
        return 1, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    return cfg.kv_heads, cfg.head_dim, cfg.head_dim


def default_positions(ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset, offset + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)


class TokenEmbedding(nn.Embedding):
    """nn.Embedding with the 2017 paper's optional sqrt(d_model) scale."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.vocab_size, cfg.d_model)
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(ids)
        return x * self.scale if self.scale != 1.0 else x


class LanguageModel(nn.Module):
    """Shared pieces: config, output head (tied or not), weight init, KV caches."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = TokenEmbedding(cfg)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)

    def _tie(self, embedding: nn.Embedding) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = embedding.weight

    def new_caches(self, batch: int, max_len: int) -> list[KVCache]:
        """A cache for each decoder layer (each sized by the keys and values it first holds)."""
        device, window = self.lm_head.weight.device, self.config.attention_window
        return [KVCache(batch, max_len, device, window) for _ in range(len(self.decoder.layers))]


def last_positions(hidden: torch.Tensor, count: int) -> torch.Tensor:
    """``hidden`` [B, T, d] of the last ``count`` positions (0: all of them)."""
    return hidden[:, -count:] if count else hidden


class DecoderLM(LanguageModel):
    """Decoder-only causal LM (optionally with a bidirectional prefix per row: prefix-LM)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.decoder = Stack(cfg, cfg.n_layers)
        self._tie(self.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        prefix_len: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
        masks: ModelMasks | None = None,
        labels: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """``masks``: built once per batch on the host (training); else built here from the inputs.
        ``labels``: return the summed token loss instead of the logits (``z_loss`` > 0: the pair of it with the
        z-loss added and the z-loss, see ``head.linear_cross_entropy``). ``logits_to_keep``: the logits of the
        last that many positions only (0: every position's), as a generation step needs."""
        held, seen = (caches[0].length, caches[0].seen) if caches else (0, 0)
        if position_ids is None:
            position_ids = default_positions(input_ids, seen)
        mask = masks.decoder if masks is not None else self_attention_mask(True, segment_ids, prefix_len, held)
        hidden = self.decoder(self.embed_tokens(input_ids), position_ids, mask, caches=caches)
        return self.lm_head(last_positions(hidden, logits_to_keep), labels, label_smoothing, z_loss)


class EncoderLM(LanguageModel):
    """Encoder-only bidirectional model with a token-prediction head (masked-LM)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.encoder = Stack(cfg, cfg.n_layers)
        self._tie(self.embed_tokens)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        masks: ModelMasks | None = None,
        labels: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = default_positions(input_ids)
        mask = masks.encoder if masks is not None else self_attention_mask(False, segment_ids)
        hidden = self.encoder(self.embed_tokens(input_ids), position_ids, mask)
        return self.lm_head(hidden, labels, label_smoothing, z_loss)


class EncoderDecoderLM(LanguageModel):
    """Encoder self-attention; decoder causal self-attention plus cross-attention to the encoder output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.decoder_embed_tokens = None if cfg.share_embeddings else TokenEmbedding(cfg)
        self.encoder = Stack(cfg, cfg.n_layers)
        self.decoder = Stack(cfg, cfg.decoder_layers, cross_attention=True)
        self._tie(self.decoder_embed_tokens or self.embed_tokens)

    def encode(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        if position_ids is None:
            position_ids = default_positions(input_ids)
        mask = mask or self_attention_mask(False, segment_ids)
        return self.encoder(self.embed_tokens(input_ids), position_ids, mask)

    def decode(
        self,
        decoder_input_ids: torch.Tensor,
        memory: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        decoder_position_ids: torch.Tensor | None = None,
        decoder_segment_ids: torch.Tensor | None = None,
        caches: list[KVCache] | None = None,
        memory_kvs: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        masks: ModelMasks | None = None,
        labels: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """``logits_to_keep``: as :meth:`DecoderLM.forward`'s."""
        held, seen = (caches[0].length, caches[0].seen) if caches else (0, 0)
        if decoder_position_ids is None:
            decoder_position_ids = default_positions(decoder_input_ids, seen)
        if masks is not None:
            mask, memory_mask = masks.decoder, masks.cross
        else:
            mask = self_attention_mask(True, decoder_segment_ids, q_offset=held)
            memory_mask = cross_attention_mask(decoder_segment_ids, segment_ids)
        embed = self.decoder_embed_tokens or self.embed_tokens
        hidden = self.decoder(
            embed(decoder_input_ids),
            decoder_position_ids,
            mask,
            memory=None if memory_kvs else memory,
            memory_mask=memory_mask,
            caches=caches,
            memory_kvs=memory_kvs,
        )
        return self.lm_head(last_positions(hidden, logits_to_keep), labels, label_smoothing, z_loss)

    def project_memory(self, memory: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Cross-attention keys/values of every decoder layer, computed once for generation."""
        return [layer.cross_attn.project_memory(memory) for layer in self.decoder.layers]

    def forward(
        self,
        input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        decoder_position_ids: torch.Tensor | None = None,
        decoder_segment_ids: torch.Tensor | None = None,
        masks: ModelMasks | None = None,
        labels: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
    ) -> torch.Tensor:
        memory = self.encode(input_ids, position_ids, segment_ids, masks.encoder if masks is not None else None)
        return self.decode(
            decoder_input_ids,
            memory,
            segment_ids,
            decoder_position_ids,
            decoder_segment_ids,
            masks=masks,
            labels=labels,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
        )


ARCHITECTURES: dict[str, type[LanguageModel]] = {
    "decoder": DecoderLM,
    "encoder": EncoderLM,
    "encoder_decoder": EncoderDecoderLM,
}


def build_model(cfg: ModelConfig, seed: int | None = None) -> LanguageModel:
    """Build and initialise the model a config describes (fp32, on the CPU): :func:`init_weights` with ``seed``, or
    with one drawn from torch's global generator (so ``torch.manual_seed`` still decides the model)."""
    model = construct(cfg)
    init_weights(model, cfg, seed)
    return model


def construct(cfg: ModelConfig) -> LanguageModel:
    """The model a config describes, made (on torch's default device) with no random values: its modules' random
    default draws skipped (:class:`RandomInitsSkipped`), for :func:`init_weights` to set."""
    with RandomInitsSkipped(cfg) as skipping:
        model = ARCHITECTURES[cfg.arch](cfg)
    skipping.check(model)
    return model


def build_shapes(cfg: ModelConfig) -> LanguageModel:
    """The model a config describes on the meta device, uninitialised: the names and shapes of its parameters, in
    milliseconds (initialising meta tensors runs torch's reference implementations, and imports dynamo)."""
    with torch.device("meta"), _Uninitialised():
        return ARCHITECTURES[cfg.arch](cfg)


class _Uninitialised(TorchFunctionMode):
    """``torch.nn.init``'s functions leave their tensor as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


class RandomInitsSkipped(TorchFunctionMode):
    """Modules made in it skip ``torch.nn.init``'s random draws (a linear layer's, an embedding's), which
    :func:`init_weights` replaces: a rank of a large model draws only the values it keeps. Its constant ones (a
    LayerNorm's ones and zeros) run. :meth:`check` then says if a parameter it skipped is not one
    :func:`initial_values` sets, which would be left as it was allocated."""

    RANDOM = frozenset(
        ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_")
        + ("xavier_normal_", "orthogonal_", "sparse_")
    )

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.skipped: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" and func.__name__ in self.RANDOM:
            tensor = args[0] if args else kwargs["tensor"]
            self.skipped[id(tensor)] = tensor
            return tensor
        return func(*args, **kwargs)

    def check(self, model: nn.Module) -> None:
        drawn = {id(param) for _, param, _ in initial_values(model, self.cfg)}
        left = [name for name, p in model.named_parameters() if id(p) in self.skipped and id(p) not in drawn]
        if left:
            raise RuntimeError(f"{left[0]}: its module's random initialisation was skipped and init_weights sets none")


RESIDUAL_OUTPUTS = ("o_proj", "down_proj")
# the rows drawn at once, one generator each: no draw holds a whole tensor, and a rank that holds a small partition of
# a large matrix (ZeRO-3 over many ranks) draws little more than it (bench/init_draws.py)
INIT_BLOCK_ELEMENTS = 1 << 18

# draw(target, shape, start): elements start.. of a parameter of ``shape``, flattened, into ``target``
Draw = Callable[[torch.Tensor, torch.Size, int], None]
Fill = Callable[[nn.Parameter, Draw], None]


def initial_values(model: nn.Module, cfg: ModelConfig) -> list[tuple[str, nn.Parameter, float | None]]:
    """(name, parameter, std) of every parameter the initialisation sets: Normal(0, std), or zeros (std None).
    Normal(0, init_std) everywhere; residual output projections scaled by 1/sqrt(2 * layers) so the residual
    stream's variance does not grow with depth (GPT-2); sqrt(d)-scaled embeddings get std d^-0.5. The others
    (norms) keep the values their module sets."""
    rules: list[tuple[str, nn.Parameter, float | None]] = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, nn.Linear):
            if name == "lm_head" and cfg.tie_embeddings:
                continue  # the embedding table, initialised as such
            std = cfg.init_std
            if cfg.depth_scaled_init and name.endswith(RESIDUAL_OUTPUTS):
                std /= math.sqrt(2 * _stack_depth(model, name))
            rules.append((prefix + "weight", module.weight, std))
            if module.bias is not None:
                rules.append((prefix + "bias", module.bias, None))
        elif isinstance(module, nn.Embedding):
            std = cfg.d_model**-0.5 if cfg.scale_embeddings else cfg.init_std
            rules.append((prefix + "weight", module.weight, std))
        elif isinstance(module, LearnedPositions):
            rules.append((prefix + "weight", module.weight, cfg.init_std))
    return rules


def parameter_generator(seed: int, name: str, block: int) -> torch.Generator:
    """The generator of rows block ``block`` of parameter ``name``: seeded from the run's seed and the two, so a
    parameter's values do not depend on where, in what order or how partitioned it is built."""
    digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def draw_into(target: torch.Tensor, seed: int, name: str, std: float | None) -> None:
    """Fill ``target`` (the whole parameter ``name``, any device and dtype) with its initial values: fp32 draws on
    the host, a block of rows at a time (a block a thread at once), cast into ``target``."""
    draw_part_into(target, seed, name, std, target.shape)


@torch.no_grad()
def draw_part_into(
    target: torch.Tensor,
    seed: int,
    name: str,
    std: float | None,
    whole: torch.Size,
    dim: int = 0,
    index: int = 0,
    parts: int = 1,
    start: int = 0,
) -> None:
    """Fill contiguous ``target`` with elements ``start`` to ``start + target.numel()`` (flattened) of part ``index``
    of ``parts`` equal ones of parameter ``name`` (of shape ``whole``) cut along ``dim``: :func:`draw_into`'s values
    of those elements, drawn from the blocks of rows that hold them alone (the host holds a block a thread, never
    the parameter). Elements past the part's end are left as they are."""
    whole = whole or torch.Size([1])
    if dim == 0 and parts > 1:  # (a part of rows is a flat range of the whole)
        start, index, parts = start + index * math.prod(whole) // parts, 0, 1
    width = math.prod(whole[1:]) // parts  # (a row of the part)
    flat = target.view(-1)
    end = min(start + flat.numel(), whole[0] * width)
    if std is None:
        flat[: max(end - start, 0)].zero_()
        return
    rows = [(b, first, stop) for b, first, stop in _row_blocks(whole) if first * width < end and stop * width > start]

    def write(block: int, first_row: int, end_row: int) -> None:
        values = _drawn(seed, name, std, block, (end_row - first_row, *whole[1:]))
        if parts > 1:
            size = whole[dim] // parts
            values = values.narrow(dim, index * size, size)
        low, high = max(first_row * width, start), min(end_row * width, end)
        flat[low - start : high - start].copy_(values.reshape(-1)[low - first_row * width : high - first_row * width])

    _on_intra_op_threads(write, rows)


def _on_intra_op_threads(work: Callable[..., None], items: list[tuple]) -> None:
    """``work(*item)`` for each of ``items``, on as many threads at once as torch's intra-op threads, each of them
    running its ops on one (a block's draw is one serial kernel; parallel copies beside them would have OpenMP's
    threads spin for cores the draws need), in the caller's grad mode. ``work`` of different items must touch
    different memory."""
    intra_op = torch.get_num_threads()
    threads = min(intra_op, len(items))
    if threads <= 1:
        for item in items:
            work(*item)
        return
    grad = torch.is_grad_enabled()  # (thread-local: a new thread starts with it on, whatever the caller's)

    def run(item: tuple) -> None:
        with torch.set_grad_enabled(grad):
            work(*item)

    torch.set_num_threads(1)  # (read by each new thread as it starts)
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="initial-values") as pool:
            for done in [pool.submit(run, item) for item in items]:
                done.result()
    finally:
        torch.set_num_threads(intra_op)


def _drawn(seed: int, name: str, std: float, block: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Rows block ``block`` of parameter ``name``'s initial values, in fp32 on the host."""
    values = torch.empty(shape, dtype=torch.float32, device="cpu")  # (whatever the default device)
    return values.normal_(0.0, std, generator=parameter_generator(seed, name, block))


def _row_blocks(shape: torch.Size) -> Iterator[tuple[int, int, int]]:
    """(block, first row, end row) of each block of rows a parameter of ``shape`` is drawn in, a vector's elements
    being its rows: as many rows as ``INIT_BLOCK_ELEMENTS`` holds, at least one."""
    per_block = max(1, INIT_BLOCK_ELEMENTS // max(math.prod(shape[1:]), 1))
    for block, start in enumerate(range(0, shape[0], per_block)):
        yield block, start, min(start + per_block, shape[0])


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, seed: int | None = None, fill: Fill | None = None) -> None:
    """Set the parameters :func:`initial_values` names, each from generators of its own (:func:`draw_into`), so
    every build of one seed has the same weights. ``fill(parameter, draw)``: how a parameter is written, where it
    is not whole (the caller has ``draw`` write the elements it holds, :func:`draw_part_into`); by default in
    place."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), device="cpu").item())
    for name, param, std in initial_values(model, cfg):

        def draw(target: torch.Tensor, shape: torch.Size, start: int, name: str = name, std: float | None = std):
            draw_part_into(target, seed, name, std, shape, start=start)

        if param.is_meta:
            continue  # (a model built on the meta device for its shapes: nothing to write)
        if fill is None:
            draw(param, param.shape, 0)
        else:
            fill(param, draw)


def _stack_depth(model: nn.Module, name: str) -> int:
    stack = model.get_submodule(name.split(".layers.")[0])
    return len(stack.layers)
