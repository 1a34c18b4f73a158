"""Typed run configuration: one YAML file plus ``key.path=value`` overrides.

Every section is a pydantic model whose attribute docstrings are the field documentation
(``megatransformer info`` and the docs read them); the data pipeline's sections (``data``,
``objective_args``) are its own pydantic dataclasses (data_pipeline/settings.py), documented the same
way. Anything wrong with a config raises :class:`ConfigError` with one line that names the field and the
offending numbers; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import is_pydantic_dataclass
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from data_pipeline import DataError
from data_pipeline.settings import DataSettings, ObjectiveArgs

if TYPE_CHECKING:  # (torch is imported where it is used: the CLI starts without it)
    import torch


class ConfigError(ValueError):
    """A configuration or command-line value is wrong; the message says which and how to fix it."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings document fields, no float may be
    NaN or infinite (a NaN passes every ``<``/``>`` range check, then trains to NaN), and no number may be a
    boolean (pydantic reads ``optim.lr=true`` as 1.0)."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        values = value if isinstance(value, (list, tuple)) else [value]
        field = cls.model_fields[info.field_name]
        number = _admits(field, _number_type) and not _admits(field, _boolean_type)
        if number and any(isinstance(v, bool) for v in values):
            raise PydanticCustomError(BOOLEAN_NUMBER, "a boolean where a number is meant")
        return value


def _boolean_type(annotation: Any) -> bool:
    return annotation is bool or annotation is Any or isinstance(annotation, bool)


def _number_type(annotation: Any) -> bool:
    return annotation in (int, float) or (isinstance(annotation, (int, float)) and not isinstance(annotation, bool))


def _admits(field: FieldInfo, kind: Callable[[Any], bool]) -> bool:
    """Whether a field's annotation admits a value of ``kind`` anywhere (in a union, a list, a ``Literal``)."""

    def admits(annotation: Any) -> bool:
        return kind(annotation) or any(admits(arg) for arg in typing.get_args(annotation))

    return admits(field.annotation)


# Ranges of the schema's values: one out of range is refused with a line naming the key and the value.
Fraction = Annotated[float, Field(ge=0.0, lt=1.0)]
"""A probability that must leave something over: dropout, label smoothing, Adam betas."""
UnitInterval = Annotated[float, Field(ge=0.0, le=1.0)]
"""A fraction of a whole, both ends included."""
MAX_VOCAB = 1 << 22
"""Largest model.vocab_size accepted: the largest vocabularies in use hold about 256k tokens (Gemma's
262,144); 2**22 leaves 16x headroom and still refuses a typo such as 1e9, whose embedding table alone would
need terabytes (the run would die allocating it, with a traceback)."""
MAX_LAYERS = 1 << 12
"""Largest model.n_layers and n_decoder_layers accepted: models in use have up to about 130 blocks and the
deepest trained (DeepNet) 1,000; 4,096 leaves room and refuses a typo such as 10**6."""
MAX_WIDTH = 1 << 20
"""Largest model.d_model and d_ff accepted: the widest in use are about 25k (d_model) and 74k (PaLM's d_ff)."""
MAX_SEQ_LEN = 1 << 24
"""Largest model.max_seq_len accepted: the longest contexts in use hold about 10M tokens."""
MIN_LR = 1e-10
"""Smallest optim.lr accepted: fine-tuning rates go down to about 1e-7; a rate of 1e-10 moves a weight of 0.02 by
one part in a few hundred million a step, below fp32's resolution, so anything smaller (a typo such as 3e-40, or
5e-324) would train nothing while looking like a run."""
MAX_STEPS = 10**9
"""Largest train.max_steps accepted: the longest published pretraining runs take a few million optimizer steps;
a billion is decades at ten steps a second, and still refuses a typo such as 1e30."""


# --------------------------------------------------------------------------------------------- model


class RopeScaling(Section):
    """Rotary frequencies stretched for a context longer than the one trained, with transformers' formulas
    (``modeling_rope_utils``) and key names. A field of another type than ``type`` is refused."""

    type: Literal["linear", "dynamic", "yarn", "llama3"]
    """linear: positions divided by factor (position interpolation); dynamic: NTK-aware base growth for
    sequences beyond original_max_seq_len (the trained length), computed per forward from the longest position,
    up to model.max_seq_len (the longest sequence allowed); yarn: YaRN's per-frequency blend of interpolation
    and extrapolation plus its attention factor; llama3: Llama 3.1's wavelength bands (high frequencies kept, low
    ones divided by factor)."""
    factor: Annotated[float, Field(ge=1.0)]
    """How many times longer the context becomes (1 leaves the frequencies unchanged)."""
    original_max_seq_len: PositiveInt | None = None
    """yarn, llama3, dynamic: the context length the model was trained with before extension (required; at most
    model.max_seq_len, the longest sequence the extended model accepts)."""
    beta_fast: PositiveFloat | None = None
    """yarn (default 32): rotations per original context above which a frequency is extrapolated (kept)."""
    beta_slow: PositiveFloat | None = None
    """yarn (default 1): rotations per original context below which a frequency is interpolated (divided by
    factor)."""
    attention_factor: PositiveFloat | None = None
    """yarn: scale of cos/sin (so of attention logits, squared); default 0.1 * ln(factor) + 1."""
    truncate: bool | None = None
    """yarn (default true): round the blend's frequency band to whole dimensions."""
    low_freq_factor: PositiveFloat | None = None
    """llama3 (default 1): wavelengths above original_max_seq_len / low_freq_factor are divided by factor."""
    high_freq_factor: PositiveFloat | None = None
    """llama3 (default 4): wavelengths below original_max_seq_len / high_freq_factor are kept; those between
    blend."""

    @model_validator(mode="before")
    @classmethod
    def _type_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            defaults = _ROPE_SCALING_DEFAULTS.get(data.get("type"), {})
            data = {**defaults, **{k: v for k, v in data.items() if v is not None or k not in defaults}}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> RopeScaling:
        for name, types in _ROPE_SCALING_FIELDS.items():
            _require(
                getattr(self, name) is None or self.type in types,
                f"model.rope_scaling.{name} is for type {' or '.join(types)}, not type={self.type}",
            )
        _require(
            self.original_max_seq_len is not None or self.type == "linear",
            f"model.rope_scaling.type={self.type} needs original_max_seq_len (the trained context length)",
        )
        _require(
            self.type != "yarn" or self.beta_fast > self.beta_slow,
            f"model.rope_scaling.beta_fast={self.beta_fast} must exceed beta_slow={self.beta_slow} (beta_fast "
            "bounds the frequencies kept, beta_slow those interpolated)",
        )
        _require(
            self.type != "llama3" or self.high_freq_factor > self.low_freq_factor,
            f"model.rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
            f"low_freq_factor={self.low_freq_factor}",
        )
        return self


_ROPE_SCALING_FIELDS = {
    "original_max_seq_len": ("yarn", "llama3", "dynamic"),
    "beta_fast": ("yarn",),
    "beta_slow": ("yarn",),
    "attention_factor": ("yarn",),
    "truncate": ("yarn",),
    "low_freq_factor": ("llama3",),
    "high_freq_factor": ("llama3",),
}
_ROPE_SCALING_DEFAULTS = {
    "yarn": {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True},
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0},
}


class ModelConfig(Section):
    arch: Literal["decoder", "encoder", "encoder_decoder"] = "decoder"
    """decoder: causal LM; encoder: bidirectional (masked-LM); encoder_decoder: seq2seq with cross-attention."""
    d_model: Annotated[int, Field(gt=0, le=MAX_WIDTH)] = 512
    """Hidden size of the residual stream."""
    n_layers: Annotated[int, Field(gt=0, le=MAX_LAYERS)] = 6
    """Number of blocks (of the encoder, for encoder_decoder)."""
    n_decoder_layers: Annotated[int, Field(gt=0, le=MAX_LAYERS)] | None = None
    """Decoder blocks of an encoder_decoder model; defaults to n_layers."""
    n_heads: PositiveInt = 8
    """Query heads per attention layer."""
    n_kv_heads: PositiveInt | None = None
    """Key/value heads: n_heads for MHA, fewer for GQA, 1 for MQA; defaults to n_heads."""
    d_ff: Annotated[int, Field(gt=0, le=MAX_WIDTH)] = 2048
    """Inner width of the feed-forward network (per branch for swiglu)."""
    vocab_size: Annotated[int, Field(gt=0, le=MAX_VOCAB)] = 32000
    """Token vocabulary size (must cover the tokenizer's ids)."""
    max_seq_len: Annotated[int, Field(gt=0, le=MAX_SEQ_LEN)] = 2048
    """Longest sequence the model accepts (sizes learned and sinusoidal position tables; ALiBi has no limit)."""
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    """Normalisation layer."""
    norm_eps: PositiveFloat = 1e-5
    """Epsilon of the normalisation layers."""
    norm_position: Literal["pre", "post"] = "pre"
    """pre: x + f(norm(x)) (stable, default); post: norm(x + f(x)) as in Vaswani et al. 2017."""
    position: Literal["sinusoidal", "learned", "rope", "alibi"] = "rope"
    """Position information: added sinusoidal or learned embeddings, rotary embeddings in attention, or ALiBi's
    per-head linear distance bias on the attention scores (Press et al. 2022; evaluates beyond max_seq_len)."""
    rope_theta: PositiveFloat = 10000.0
    """Base of the rotary frequencies."""
    rope_scaling: RopeScaling | None = None
    """position=rope: stretch the rotary frequencies for a longer context (see RopeScaling); None: plain RoPE."""
    attention_window: PositiveInt | None = None
    """Local (sliding-window) self-attention, as in Mistral: causal query i sees keys j with
    i - window < j <= i; bidirectional (encoder) query i sees keys with |i - j| < window. Measured in
    positions of the row, within each packed document; cross-attention is never windowed; not with
    prefix-LM attention; at most max_seq_len (a wider window never narrows anything), except with ALiBi, which
    runs beyond max_seq_len. None: every allowed key."""
    qk_norm: bool = False
    """QK-norm (Qwen3, OLMo 2, Gemma 3): an RMSNorm (eps norm_eps) over each head's queries and keys, with learned
    weights of size head_dim, before RoPE, in self- and cross-attention: bounds the attention logits' growth. With
    ALiBi too (the bias is added to the scores of the normed queries and keys). Exports as Qwen3ForCausalLM."""
    ffn: Literal["relu", "gelu", "swiglu"] = "swiglu"
    """Feed-forward activation; swiglu uses gate_proj * up_proj."""
    bias: bool = False
    """Bias terms in linear and norm layers."""
    tie_embeddings: bool = True
    """Share the input embedding with the output projection."""
    share_embeddings: bool = True
    """encoder_decoder only: one embedding table for source and target tokens."""
    scale_embeddings: bool = False
    """Multiply token embeddings by sqrt(d_model) (the 2017 paper does)."""
    dropout: Fraction = 0.0
    """Dropout on residual branches."""
    attention_dropout: Fraction = 0.0
    """Dropout on attention probabilities."""
    embedding_dropout: Fraction | None = None
    """Dropout after the embeddings; defaults to dropout."""
    final_norm: bool = True
    """Normalise the output of a pre-LN stack (ignored for post-LN, whose blocks end in a norm)."""
    init_std: PositiveFloat = 0.02
    """Standard deviation of the normal weight init."""
    depth_scaled_init: bool = True
    """Scale residual output projections (o_proj, down_proj) by 1/sqrt(2 * n_layers)."""
    activation_checkpointing: bool | Literal["selective"] = False
    """Recompute each block's activations in the backward pass to save memory. selective: keep each block's
    matrix products (and attention outputs) and recompute only the cheap operations around them: less memory
    saved, almost no compute added."""
    mlp_tiles: PositiveInt = 1
    """Training: compute each MLP in this many tiles of the sequence (of each rank's slice under sequence
    parallelism) and recompute it one tile at a time in the backward pass, so that its hidden activations live
    for one tile instead of being kept for the whole sequence (DeepSpeed ALST's TiledMLP; one more MLP forward
    per step). 1: untiled. Needs dropout 0."""
    attention_backend: Literal["auto", "sdpa", "flex", "flash", "fa3", "fa4", "varlen", "eager", "chunked"] = "auto"
    """auto: the fastest exact core per call, by a table of GPU generation and mask kind (gpu_cores.SPEED_TABLE; GPU:
    flash-attn 3 / 4 where installed, else flash-attn 2, else PyTorch's varlen_attn for packed documents, prefix-LM
    and packed cross-attention (no attention dropout, no ALiBi), else sdpa; CPU: chunked, or sdpa with attention
    dropout); sdpa: PyTorch scaled_dot_product_attention; flex: FlexAttention block masks; flash: flash-attn 2
    (CUDA); fa4 / fa3: flash-attn 4 / 3 through PyTorch's flash registry (CUDA, no dropout, no ALiBi); varlen:
    PyTorch's varlen_attn; eager: plain matmul-softmax reference; chunked: exact attention in query chunks with
    recomputation (fastest for CPU training, memory linear in sequence length for every mask; see BENCHMARKS.md).
    The run log says which core runs and why (docs/gpu.md)."""
    attention: Literal["standard", "mla"] = "standard"
    """Self-attention kind. standard: q/k/v projections per head (MHA, GQA, MQA by model.n_kv_heads); mla:
    multi-head latent attention (DeepSeek-V2/V3; docs/attention.md): keys and values are up-projected from one
    latent of model.kv_lora_rank values per token, RoPE acts on a separate slice of every head whose key is
    shared by all heads, and the KV cache holds only the latent and that key. Needs position=rope; the
    cross-attention of an encoder_decoder stays standard."""
    kv_lora_rank: PositiveInt | None = None
    """attention=mla (required): width of the latent the keys and values of a token come from (DeepSeek-V3:
    512)."""
    q_lora_rank: PositiveInt | None = None
    """attention=mla: width of the latent the queries come from (DeepSeek-V3: 1536); None: queries projected
    directly from the hidden state."""
    qk_rope_head_dim: PositiveInt | None = None
    """attention=mla: the query/key slice of each head that RoPE rotates (even; DeepSeek-V3: 64); default:
    half of d_model / n_heads."""
    qk_nope_head_dim: PositiveInt | None = None
    """attention=mla: the query/key slice of each head without positions (DeepSeek-V3: 128); default: d_model /
    n_heads less qk_rope_head_dim."""
    v_head_dim: PositiveInt | None = None
    """attention=mla: value width of each head (DeepSeek-V3: 128); default d_model / n_heads."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def decoder_layers(self) -> int:
        return self.n_decoder_layers or self.n_layers

    @model_validator(mode="before")
    @classmethod
    def _latent_defaults(cls, data: Any) -> Any:
        """attention=mla: the head slices the config leaves out, from the head dim d_model / n_heads."""
        if not isinstance(data, dict) or data.get("attention") != "mla":
            return data
        fields = cls.model_fields
        d_model, n_heads = (data.get(k, fields[k].default) for k in ("d_model", "n_heads"))
        if not (isinstance(d_model, int) and isinstance(n_heads, int) and n_heads > 0):
            return data  # (the fields' own checks report it)
        head = d_model // n_heads
        data = dict(data)
        rope, nope = data.get("qk_rope_head_dim"), data.get("qk_nope_head_dim")
        if rope is None:
            rope = data["qk_rope_head_dim"] = max(2, head // 4 * 2)
        if nope is None:
            _require(
                not isinstance(rope, int) or rope < head,
                f"model.qk_rope_head_dim={rope} is not smaller than the head dim d_model/n_heads={head} it is a "
                "slice of; lower it or set model.qk_nope_head_dim",
            )
            data["qk_nope_head_dim"] = head - rope if isinstance(rope, int) else None
        data.setdefault("v_head_dim", head)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        self._latent_consistent()
        _require(
            self.d_model % self.n_heads == 0,
            f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}",
        )
        _require(
            self.n_heads % self.kv_heads == 0,
            f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}",
        )
        _require(
            self.position != "rope" or self.attention == "mla" or self.head_dim % 2 == 0,
            f"model.position=rope needs an even head dim, got d_model/n_heads={self.head_dim}",
        )
        _require(
            self.rope_scaling is None or self.position == "rope",
            f"model.rope_scaling needs model.position=rope, got model.position={self.position}",
        )
        original = self.rope_scaling and self.rope_scaling.original_max_seq_len
        _require(
            original is None or original <= self.max_seq_len,
            f"model.rope_scaling.original_max_seq_len={original} exceeds model.max_seq_len={self.max_seq_len}: "
            "the extended context must be the longer one (raise max_seq_len to the length you want to reach)",
        )
        _require(
            self.attention_window is None or self.attention_window <= self.max_seq_len or self.position == "alibi",
            f"model.attention_window={self.attention_window} exceeds model.max_seq_len={self.max_seq_len}, so it "
            "never narrows attention; lower it, or unset it for full attention",
        )
        _require(
            self.mlp_tiles == 1 or self.dropout == 0,
            f"model.mlp_tiles={self.mlp_tiles} recomputes the MLP in the backward pass, which would draw other "
            f"dropout masks than the forward; set model.dropout=0 (got {self.dropout}) or model.mlp_tiles=1",
        )
        _require(
            self.n_decoder_layers is None or self.arch == "encoder_decoder",
            f"model.n_decoder_layers is only for arch=encoder_decoder, not arch={self.arch}",
        )
        return self

    def _latent_consistent(self) -> None:
        latent = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        if self.attention != "mla":
            for name in latent:
                _require(getattr(self, name) is None, f"model.{name} is for model.attention=mla, not {self.attention}")
            return
        _require(
            not self.qk_norm,
            "model.qk_norm=true with model.attention=mla: DeepSeek's MLA normalises its latents (q_a_norm, "
            "kv_a_norm) and has no per-head query/key norm; set model.qk_norm=false",
        )
        _require(
            self.kv_lora_rank is not None,
            "model.attention=mla needs model.kv_lora_rank, the width of each token's key/value latent "
            "(DeepSeek-V3: 512)",
        )
        _require(
            self.qk_rope_head_dim % 2 == 0,
            f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs of values)",
        )
        _require(
            self.position == "rope",
            f"model.attention=mla needs model.position=rope (its decoupled RoPE key is its position scheme), "
            f"got model.position={self.position}",
        )
        _require(
            self.n_kv_heads in (None, self.n_heads),
            f"model.n_kv_heads={self.n_kv_heads} with model.attention=mla: its keys and values are up-projected "
            "for every head from one shared latent; leave model.n_kv_heads unset",
        )


# ------------------------------------------------------------------------------------------ training


class SpikesConfig(Section):
    """Loss spikes (training/spikes.py): a step whose loss or gradient norm is non-finite or far above the
    level of its recent values does not update the model; several within a short span roll the run
    back to the newest intact checkpoint before them and skip the data read since, plus a margin; too many
    rollbacks stop it."""

    enabled: bool = True
    """Detect spikes and respond (off: only non-finite steps are skipped, train.max_bad_steps stops)."""
    window: Annotated[int, Field(ge=2)] = 50
    """Recent accepted steps whose step-to-step differences measure the noise (their MAD: a trend, such as the
    run's early descent, moves them all alike and is not counted as noise)."""
    warmup: Annotated[int, Field(ge=2)] = 50
    """Accepted steps of history before a finite loss can be a spike (at most window)."""
    threshold: Annotated[float, Field(gt=0)] = 6.0
    """A spike lies this many robust standard deviations of the noise above the level (the median of the last
    20 accepted values)..."""
    min_rise: Annotated[float, Field(gt=0)] = 0.1
    """...and at least this fraction of the level above it (a flat curve has a noise near zero)."""
    grad_norm: bool = False
    """Judge the global gradient norm (before clipping) too, against its own level and noise over the same
    window: a step spikes when its loss or its gradient norm lies beyond its threshold. Off by default:
    a healthy run's norm may rise several times over within a window (the paper recipe's toy translation
    model: four times its median in 100 steps), and judged, that rise would skip updates and stop the run. A
    non-finite norm always spikes."""
    grad_norm_threshold: Annotated[float, Field(gt=0)] = 6.0
    """A gradient-norm spike lies this many robust standard deviations of its noise above its level..."""
    grad_norm_min_rise: Annotated[float, Field(gt=0)] = 3.0
    """...and at least this fraction of that level above it (norms are far noisier than losses: 3.0 is four
    times the level)."""
    rollback_after: PositiveInt = 3
    """Spikes within ``within`` steps that roll the run back."""
    within: PositiveInt = 50
    """Steps in which ``rollback_after`` spikes roll the run back."""
    margin_steps: NonNegativeInt = 20
    """Global batches skipped beyond the step that triggered a rollback."""
    max_rollbacks: NonNegativeInt = 3
    """Rollbacks in a run; a spike that would need one more stops the run (exit 3)."""

    @model_validator(mode="after")
    def _consistent(self) -> SpikesConfig:
        _require(
            self.warmup <= self.window,
            f"train.spikes.warmup={self.warmup} exceeds train.spikes.window="
            f"{self.window}: the window never holds that many steps; lower warmup",
        )
        _require(
            self.rollback_after <= self.within,
            f"train.spikes.rollback_after={self.rollback_after} spikes "
            f"cannot fall within train.spikes.within={self.within} steps; raise within or lower rollback_after",
        )
        return self


class WatchdogConfig(Section):
    """Hang diagnosis (training/watchdog.py): a step that takes far longer than usual makes every rank write
    the Python stacks of all its threads to RUN_DIR/hangs/rank_NNNNN.txt, before parallel.timeout_minutes
    ends the run."""

    enabled: bool = True
    """Arm the watchdog around every step."""
    factor: Annotated[float, Field(gt=1)] = 20.0
    """A step longer than this many times the median of recent steps is taken for a hang..."""
    min_seconds: PositiveFloat = 60.0
    """...and longer than this (first steps, a loaded machine); at most 0.8 x parallel.timeout_minutes."""
    limit_seconds: PositiveFloat | None = None
    """A fixed limit per step instead of factor and min_seconds (also capped by the collective timeout)."""


class EvalsConfig(Section):
    """Downstream tasks of lm-evaluation-harness run in the training process (docs/evaluation.md); results are
    logged as eval/<task>/<metric>. Needs the eval extra (`pip install -e '.[eval]'`)."""

    tasks: list[str] = Field(default_factory=list)
    """Task names the harness knows, names in include_path, or paths of task YAML files (empty: none)."""
    include_path: list[str] = Field(default_factory=list)
    """Folders of task YAMLs to index."""
    every: NonNegativeInt = 0
    """Steps between evaluations (0: only at the end of training)."""
    limit: PositiveInt | None = None
    """At most this many examples of each task (None: all)."""
    num_fewshot: NonNegativeInt | None = None
    """Few-shot examples in each prompt (None: each task's own count)."""
    batch_size: PositiveInt | None = None
    """Rows of model.max_seq_len tokens a forward (default: train.micro_batch_size)."""


class TrainConfig(Section):
    max_steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] = 1000
    """Optimizer steps to train, at least 1 (a run leaves a checkpoint), at most MAX_STEPS."""
    micro_batch_size: PositiveInt | None = None
    """Sequences per rank per forward pass."""
    global_batch_size: PositiveInt | None = None
    """Sequences per optimizer step across all ranks (= micro x grad_accum x data-parallel size)."""
    grad_accum: PositiveInt | None = None
    """Micro batches accumulated per optimizer step."""
    grad_clip: NonNegativeFloat = 1.0
    """Clip the global gradient norm to this value (0 disables)."""
    label_smoothing: Fraction = 0.0
    """Label smoothing of the cross-entropy loss (0.1 in the 2017 paper)."""
    z_loss: NonNegativeFloat = 0.0
    """z-loss coefficient (PaLM, OLMo): coefficient x log(Z)^2, the squared log of each loss token's softmax
    normalizer (logsumexp of its logits), averaged over the loss tokens, is added to the training loss and keeps
    the output logits from drifting; logged as z_loss beside the cross-entropy loss (PaLM: 1e-4). 0: off, not
    computed."""
    log_every: PositiveInt = 10
    """Steps between metrics.jsonl lines."""
    eval_every: NonNegativeInt = 0
    """Steps between validation passes (0: only at the end)."""
    eval_batches: PositiveInt = 10
    """Micro batches per validation pass, in all: the first ones of the validation split, dealt out to the
    data-parallel ranks (the numbers do not depend on the number of ranks)."""
    compile: bool | None = None
    """torch.compile each Transformer block (training/compiled.py); unset: on for CUDA runs, off on CPUs (where
    compiling takes minutes and gains little). The run log says which, and reports any recompilation or graph
    break after the first two steps."""
    gc_every: NonNegativeInt = 1000
    """Steps between collections of Python's garbage collector, which is frozen after start-up and otherwise off
    (a collection at a random point of a step stalls every rank that waits for this one); 0: Python's own
    schedule."""
    host_memory: Literal["keep", "release"] = "keep"
    """keep: host memory the process frees stays with it for the next step (glibc malloc maps no large
    blocks afresh and does not trim its heap), as PyTorch's caching allocator keeps GPU memory; a CPU step
    of a small model spent ~15% of its time in page faults without it (BENCHMARKS.md 5e). The process then
    holds its peak host memory. release: the C library's defaults, memory goes back to the system."""
    cpu_bf16_matmul: Literal["auto", "fp32", "native"] = "auto"
    """How a bf16 run's matrix products run on a CPU. auto: PyTorch's bf16 kernels where it has them for this
    CPU (oneDNN: AVX-512, AMX, Arm BF16), else fp32 GEMMs of the bf16 operands, which give the same products
    and sums (a bf16 step on an AVX2-only CPU took 25x as long without them, BENCHMARKS.md 5g); fp32: always
    the latter; native: always PyTorch's bf16 kernels. Nothing changes on GPUs, in fp32 or with compile."""
    max_bad_steps: Annotated[int, Field(ge=1)] = 5
    """Consecutive non-finite losses after which the run checkpoints and stops."""
    spikes: SpikesConfig = Field(default_factory=SpikesConfig)
    """Loss spikes: skip the update, roll back and skip the data, stop (SpikesConfig)."""
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    """Hang diagnosis: every rank's stacks on file when a step overruns (WatchdogConfig)."""
    peak_tflops: PositiveFloat | None = None
    """Per-device peak TFLOP/s for the MFU estimate (default: the GPU's dense peak from
    training.metrics.GPU_PEAK_TFLOPS, e.g. 989 for H100 SXM bf16; another GPU's measured matmul peak; on a CPU
    none: MFU is logged only when this is set, a CPU's measured speed being too unsteady to divide by)."""
    sample_prompt: str | None = None
    """Text to continue with a short generated sample at the end of training (decoder models)."""
    evals: EvalsConfig = Field(default_factory=EvalsConfig)
    """lm-evaluation-harness tasks during training (EvalsConfig)."""
    check_memory: bool = True
    """Before the first step, stop with one line when the planner's estimate of a rank's memory exceeds the
    device's (what overflows, by how much, the best layout that fits: ``megatransformer plan``)."""


class OptimConfig(Section):
    name: Literal["adamw", "adam", "muon"] = "adamw"
    """adamw: decoupled weight decay; adam: the 2017 paper's Adam (use weight_decay=0); muon: Muon (torch.optim.Muon's
    update) on the linear layers' weights, AdamW with the settings below on the rest (docs/optimizers.md)."""
    lr: Annotated[float, Field(ge=MIN_LR)] = 3e-4
    """Peak learning rate (the multiplier of the inverse_sqrt schedule); with muon, AdamW's part."""
    betas: tuple[Fraction, Fraction] = (0.9, 0.95)
    """Adam beta1, beta2 (the 2017 paper: 0.9, 0.98)."""
    eps: PositiveFloat = 1e-8
    """Adam epsilon (the 2017 paper: 1e-9)."""
    weight_decay: NonNegativeFloat = 0.1
    """Weight decay coefficient."""
    decay_norms_and_embeddings: bool = False
    """Also decay norm weights, biases and embeddings (off: they are excluded, the common practice)."""
    muon_lr: Annotated[float, Field(ge=MIN_LR)] = 0.02
    """Muon's peak learning rate (the schedule scales it as it scales lr); with muon_adjust_lr_fn=match_rms_adamw,
    about AdamW's lr."""
    muon_momentum: Fraction = 0.95
    """Muon's momentum."""
    muon_nesterov: bool = True
    """Nesterov momentum in Muon."""
    muon_ns_steps: Annotated[int, Field(ge=1, le=99)] = 5
    """Newton-Schulz iterations per Muon update."""
    muon_ns_dtype: Literal["bf16", "fp32"] = "bf16"
    """dtype of the Newton-Schulz iterations: bf16 as torch.optim.Muon, or fp32 (on CPUs without bf16 matrix
    units, or to reproduce a run on another layout to fp32 rounding)."""
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = "original"
    """Muon's learning rate per matrix shape (A x B), as torch.optim.Muon's adjust_lr_fn: original scales it by
    sqrt(max(1, A/B)) (Keller Jordan), match_rms_adamw by 0.2 sqrt(max(A, B)) (Moonshot: AdamW's update RMS)."""
    muon_weight_decay: NonNegativeFloat = 0.0
    """Decoupled weight decay of Muon's matrices (multiplied by the unadjusted muon_lr, as torch.optim.Muon)."""


class ScheduleConfig(Section):
    name: Literal["cosine", "linear", "constant", "inverse_sqrt", "wsd"] = "cosine"
    """Learning-rate schedule after warmup; inverse_sqrt is d_model^-0.5 * min(step^-0.5, step * warmup^-1.5);
    wsd (warmup-stable-decay) holds the peak until the last decay_steps (or decay_fraction) of the run."""
    warmup_steps: NonNegativeInt = 100
    """Linear warmup steps."""
    min_lr_ratio: UnitInterval = 0.1
    """Final learning rate as a fraction of optim.lr (cosine, linear, wsd)."""
    decay_steps: NonNegativeInt | None = None
    """wsd: steps of the final decay (default: decay_fraction of train.max_steps); the stable phase is the rest."""
    decay_fraction: UnitInterval = 0.2
    """wsd: the final decay's share of train.max_steps when decay_steps is not set."""
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "1-sqrt"
    """wsd: the decay's shape, from the peak to min_lr_ratio (1-sqrt: 1 - sqrt(progress), as OLMo-core's WSD)."""
    decay_from: str | None = None
    """wsd: a checkpoint of a run's stable phase to branch a decay from: this run continues it (weights, optimizer,
    data) in its own run_dir and decays from the checkpoint's step to train.max_steps."""


class CheckpointConfig(Section):
    every: PositiveInt = 1000
    """Steps between checkpoints (a final one is always written)."""
    every_minutes: Annotated[float, Field(gt=0)] | None = None
    """Also checkpoint once this many minutes of wall time have passed since the last checkpoint (or the start),
    whichever of the two comes first. The interval that wastes least is about sqrt(2 x save time x mean time
    between failures) (Young/Daly); the run log says each save's stall and write time."""
    keep: PositiveInt = 3
    """Most recent checkpoints kept (older ones are deleted)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of exported consolidated weights."""


class ParallelConfig(Section):
    zero_stage: Literal[0, 1, 2, 3] = 1
    """DeepSpeed ZeRO stage. Stages 1 and 2 over a single data-parallel rank run as stage 0 in fp32, and in any
    precision on a CPU (one partition is everything: nothing to save, only DeepSpeed's bucket copies to pay),
    unless offload_optimizer is set."""
    tensor_parallel: PositiveInt = 1
    """Tensor-parallel degree (DeepSpeed AutoTP); the other ranks form the data-parallel group."""
    sequence_parallel: PositiveInt = 1
    """Sequence-parallel degree (DeepSpeed-Ulysses): each group of this many consecutive ranks reads the same
    rows and holds 1/sequence_parallel of every sequence; attention exchanges sequence slices for head slices
    (all-to-all). Needs model.n_heads and data.seq_len divisible by it, and model.n_kv_heads divisible by it or
    dividing it (fewer key/value heads are replicated); not combined with tensor_parallel. The world size is
    data-parallel x tensor_parallel x sequence_parallel."""
    offload_optimizer: bool = False
    """Keep optimizer states on the CPU (ZeRO-Offload)."""
    timeout_minutes: Annotated[float, Field(gt=0, le=7 * 24 * 60)] = 10.0
    """Longest wait of a collective (all-reduce, broadcast, barrier) for the other ranks: a stalled or dead
    rank makes the others exit with an error after this long instead of hanging (at most a week)."""


class WandbConfig(Section):
    mode: Literal["online", "offline", "disabled"] | None = None
    """online, offline or disabled; default: online if WANDB_API_KEY is set, else offline."""
    project: str = "megatransformer"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""
    name: str | None = None
    """Run name; defaults to the run directory's name."""
    tags: list[str] = []
    """Run tags."""


# -------------------------------------------------------------------------------------------- run


class RunConfig(Section):
    """A complete training run."""

    run_dir: Annotated[str, Field(min_length=1)] = "runs/default"
    """Directory for config.yaml, metrics.jsonl, checkpoints and W&B files."""
    seed: Annotated[int, Field(ge=0, lt=1 << 63)] = 0
    """Seed of weights, data order and objectives."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataSettings = Field(default_factory=DataSettings)  # (data_pipeline's, like objective_args)
    objective: Literal["autoregressive", "masked_lm", "prefix_lm", "span_corruption"] = "autoregressive"
    """Training objective (batch builder)."""
    objective_args: ObjectiveArgs = Field(default_factory=ObjectiveArgs)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Training precision; bf16 keeps fp32 master weights, fp16 adds loss scaling (GPU)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: bool = False
    """Also write the metrics as TensorBoard event files into run_dir/tensorboard (needs the tensorboard package:
    pip install 'megatransformer[tensorboard]'; off by default, W&B and metrics.jsonl being always there)."""
    resume: str | None = None
    """auto: the latest complete checkpoint in run_dir/checkpoints (fresh start if none); or a checkpoint path."""
    resume_elastic: Literal["keep_batch", "allow_batch_change"] = "keep_batch"
    """A resume may change the data-parallel size, tensor_parallel and zero_stage (micro batch and grad_accum
    are derived again from train.global_batch_size); keep_batch refuses a global batch other than the
    checkpoint's, allow_batch_change continues the same data, step count and schedule with the new batch
    (not an exact continuation)."""
    init_from: str | None = None
    """Checkpoint whose weights (only) initialise this run, for fine-tuning."""

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        m, tp = self.model, self.parallel.tensor_parallel
        for name, value in (
            ("n_heads", m.n_heads),
            ("n_kv_heads", m.kv_heads),
            ("d_ff", m.d_ff),
            ("vocab_size", m.vocab_size),
        ):
            _require(value % tp == 0, f"parallel.tensor_parallel={tp} does not divide model.{name}={value}")
        self._sequence_parallel_fits()
        local = self.data.seq_len // self.parallel.sequence_parallel
        _require(
            m.mlp_tiles <= local,
            f"model.mlp_tiles={m.mlp_tiles} exceeds the {local} positions of a sequence each rank holds "
            "(data.seq_len / parallel.sequence_parallel)",
        )
        allowed = {
            "autoregressive": ("decoder",),
            "prefix_lm": ("decoder", "encoder_decoder"),
            "masked_lm": ("encoder",),
            "span_corruption": ("encoder_decoder",),
        }[self.objective]
        _require(
            m.arch in allowed,
            f"objective={self.objective} needs model.arch in {list(allowed)}, got model.arch={m.arch}",
        )
        _require(
            self.data.seq_len <= m.max_seq_len or m.position == "alibi",
            f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={m.max_seq_len}",
        )
        _require(
            self.resume is None or self.init_from is None,
            "resume and init_from are exclusive: resume continues a run, init_from starts a new one",
        )
        self._schedule_fits()
        _require(
            m.attention_window is None or (self.objective, m.arch) != ("prefix_lm", "decoder"),
            "model.attention_window does not combine with objective=prefix_lm on a decoder (its "
            "bidirectional prefix has no sliding window); drop one of them",
        )
        _require(
            self.precision != "fp16" or m.attention_backend != "flex",
            "precision=fp16 is not supported with model.attention_backend=flex; use bf16",
        )
        return self

    def _schedule_fits(self) -> None:
        s, total = self.schedule, self.train.max_steps
        if s.decay_from is not None:
            _require(s.name == "wsd", f"schedule.decay_from needs schedule.name=wsd, got schedule.name={s.name}")
            _require(
                self.resume in (None, "auto") and self.init_from is None,
                "schedule.decay_from continues its checkpoint: it excludes init_from and a resume path "
                "(resume=auto continues the decay run itself)",
            )
        if s.name == "wsd" and s.decay_from is None and s.decay_steps is not None:
            _require(
                s.warmup_steps + s.decay_steps <= total,
                f"schedule.warmup_steps={s.warmup_steps} + schedule.decay_steps={s.decay_steps} exceed "
                f"train.max_steps={total}; shorten the decay or lengthen the run",
            )

    def _sequence_parallel_fits(self) -> None:
        m, sp = self.model, self.parallel.sequence_parallel
        if sp == 1:
            return
        _require(
            self.parallel.tensor_parallel == 1,
            f"parallel.sequence_parallel={sp} with parallel.tensor_parallel={self.parallel.tensor_parallel}: "
            "sequence and tensor parallelism are not combined; set one of them to 1",
        )
        _require(m.n_heads % sp == 0, f"parallel.sequence_parallel={sp} does not divide model.n_heads={m.n_heads}")
        _require(
            m.kv_heads % sp == 0 or sp % m.kv_heads == 0,
            f"parallel.sequence_parallel={sp} and model.n_kv_heads={m.kv_heads}: one must divide the other",
        )
        _require(
            self.data.seq_len % sp == 0,
            f"parallel.sequence_parallel={sp} does not divide data.seq_len={self.data.seq_len}",
        )


# ------------------------------------------------------------------------------------------ loading


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested dict; values are read by :func:`override_value`."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        value = override_value(text)
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return raw


def override_value(text: str) -> Any:
    """An override's value: a YAML scalar, or a ``[...]`` / ``{...}`` collection; any other text is the string as
    written (``ROMEO:``, ``- a``, ``# x`` and text YAML cannot parse), as a shell user means it."""
    if not text:
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, (dict, list)) and not text.lstrip().startswith(("[", "{")):
        return text
    if value is None and text.strip() not in ("null", "Null", "NULL", "~"):
        return text
    return value


def shipped_configs() -> dict[str, Path]:
    """The configs that ship with megatransformer, by name (``quickstart``, ``llama-style``, ...).

    The repository's top-level ``configs/`` directory is installed as the package ``megatransformer.configs``
    (pyproject.toml maps it), so an installed copy finds them with importlib.resources; a source checkout
    (plain or editable) reads the same directory beside the package.
    """
    from importlib.resources import files

    package = Path(str(files("megatransformer")))
    directory = package / "configs"
    if not directory.is_dir():
        directory = package.parent / "configs"
    return {p.stem: p for p in sorted(directory.glob("*.yaml"))}


def resolve_config(path: str | Path) -> Path:
    """A config file: an existing path as given, else a shipped config named ``path`` (``llama-style`` or
    ``llama-style.yaml``)."""
    given = Path(path)
    if given.exists() and not given.is_dir():
        return given
    shipped = shipped_configs()
    name = given.name[: -len(".yaml")] if given.name.endswith(".yaml") else given.name
    if given.parent == Path(".") and name in shipped:
        return shipped[name]
    if name in shipped:  # (a path into a clone's configs/, given outside one)
        raise ConfigError(f"config file {path} does not exist here; the shipped config of that name is --config {name}")
    raise ConfigError(
        f"config file {path} does not exist; give a YAML path or the name of a shipped config ({', '.join(shipped)})"
    )


def load_config(path: str | Path | None, overrides: list[str] = (), schema: type[Section] = RunConfig):
    """Read a YAML run description (a path or a shipped config's name), apply overrides and validate it
    into ``schema``."""
    raw: dict[str, Any] = {}
    if path is not None:
        path = resolve_config(path)
        try:
            raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {str(err).splitlines()[0]}") from None
        if raw is None and path.is_file():  # (a file cut short or the wrong one; /dev/null is no file: no settings)
            raise ConfigError(
                f"config file {path} is empty: every setting would be its default; write the settings to change "
                "in it, or `{}` to mean the defaults"
            )
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(raw).__name__}")
    raw = apply_overrides(raw, list(overrides))
    try:
        return schema.model_validate(raw)
    except ValidationError as err:
        if not _keep_typed_text(raw, list(overrides), err):
            raise ConfigError(_describe(err, schema)) from None
    return validate(raw, schema)


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping: plain YAML keeps the last one, so a
    repeated ``train:`` section would silently replace the first. (Keys merged in with ``<<`` may still be
    overridden, as YAML intends.)"""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} on line {line} (first on line {first_line[key]})"
                )
            first_line[key] = line
        return super().construct_mapping(node, deep)


def _keep_typed_text(raw: dict[str, Any], overrides: list[str], err: ValidationError) -> bool:
    """An override of a field that holds text keeps the text as typed (``train.sample_prompt=123`` or ``=yes``),
    not the number or boolean YAML read in it: put back in ``raw``; whether any was."""
    typed = {tuple(key.split(".")): text for key, _, text in (item.partition("=") for item in overrides)}
    kept = False
    for error in err.errors():
        loc = tuple(str(part) for part in error["loc"])
        if error["type"] == "string_type" and loc in typed:
            node = raw
            for part in loc[:-1]:
                node = node[part]
            node[loc[-1]] = typed[loc]
            kept = True
    return kept


def validate(raw: dict[str, Any], schema: type[Section] = RunConfig):
    try:
        return schema.model_validate(raw)
    except ConfigError:
        raise
    except ValidationError as err:
        raise ConfigError(_describe(err, schema)) from None


def _describe(err: ValidationError, schema: type[Section]) -> str:
    """Turn pydantic's most useful error into one line; for unknown keys suggest the closest valid key."""
    errors = err.errors()
    # an unknown key first; then a value out of range (in a union, rather than "not a string" for the other member)
    first = next((e for e in errors if e["type"] in _UNKNOWN_KEY), None) or next(
        (e for e in errors if e["type"] in _BOUNDS or e["type"] == "finite_number"), errors[0]
    )
    parts = [p for p in first["loc"] if not _is_union_tag(p)]
    loc = [str(p) for p in parts]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")
    if first["type"] in _UNKNOWN_KEY:
        section = _section_at(schema, [p for p in loc[:-1] if not p.isdigit()])
        valid = list(_fields(section)) if section else []
        close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
        hint = f"did you mean {'.'.join(loc[:-1] + close)!r}?" if close else f"valid keys: {', '.join(valid)}"
        return f"unknown config key {where!r}; {hint}"
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ConfigError):
        return str(cause)
    if isinstance(cause, DataError):  # (a data_pipeline settings check, its message led by its own field)
        return f"{where}.{cause}" if where else str(cause)
    if first["type"] in _BOUNDS:
        (bound,) = first["ctx"].values()
        return f"{where}={first['input']} must be {_BOUNDS[first['type']]} {_number(bound)}"
    if first["type"] == "finite_number":
        return f"{where}={first['input']} must be a finite number"
    if first["type"] == BOOLEAN_NUMBER:
        return f"{where}={str(first['input']).lower()} must be a number, not a boolean"
    if first["type"] == "string_too_short":
        return f"{where} must not be empty"
    return f"config key {where!r}: {first['msg']} (got {first.get('input')!r})"


_UNKNOWN_KEY = ("extra_forbidden", "unexpected_keyword_argument")
"""pydantic's errors for a key a section does not have (a model's, a dataclass's)."""
BOOLEAN_NUMBER = "boolean_number"
"""The error of a boolean given where a number is meant (:class:`Section`)."""
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
"""pydantic's range errors, as the comparison the value failed."""


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member it tried in the error location (``str``, ``list[X]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


def _section_at(schema: type[Section], loc: list[str]) -> type | None:
    node: type | None = schema
    for part in loc:
        field = _fields(node).get(part) if node else None
        node = _model_in(field.annotation) if field else None
    return node


def _fields(section: type) -> dict[str, Any]:
    """The fields of a config section: a pydantic model, or a pydantic dataclass of data_pipeline's."""
    return section.model_fields if issubclass(section, BaseModel) else section.__pydantic_fields__


def _model_in(annotation: Any) -> type | None:
    """The section class inside an annotation such as ``X``, ``list[X]`` or ``str | list[X] | None``."""
    if isinstance(annotation, type) and (issubclass(annotation, BaseModel) or is_pydantic_dataclass(annotation)):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found:
            return found
    return None


def dump_config(cfg: Section) -> str:
    """The resolved config as YAML, in field order (what run directories store)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype of a run's ``precision`` (fp32 | bf16 | fp16)."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
