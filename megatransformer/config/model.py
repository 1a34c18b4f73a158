"""The ``model`` section: the architecture, its sizes and its positions."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from megatransformer.config.core import MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB, MAX_WIDTH, Fraction, Section, require


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
            require(
                getattr(self, name) is None or self.type in types,
                f"model.rope_scaling.{name} is for type {' or '.join(types)}, not type={self.type}",
            )
        require(
            self.original_max_seq_len is not None or self.type == "linear",
            f"model.rope_scaling.type={self.type} needs original_max_seq_len (the trained context length)",
        )
        require(
            self.type != "yarn" or self.beta_fast > self.beta_slow,
            f"model.rope_scaling.beta_fast={self.beta_fast} must exceed beta_slow={self.beta_slow} (beta_fast "
            "bounds the frequencies kept, beta_slow those interpolated)",
        )
        require(
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
            require(
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
        require(
            self.d_model % self.n_heads == 0,
            f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}",
        )
        require(
            self.n_heads % self.kv_heads == 0,
            f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.kv_heads}",
        )
        require(
            self.position != "rope" or self.attention == "mla" or self.head_dim % 2 == 0,
            f"model.position=rope needs an even head dim, got d_model/n_heads={self.head_dim}",
        )
        require(
            self.rope_scaling is None or self.position == "rope",
            f"model.rope_scaling needs model.position=rope, got model.position={self.position}",
        )
        original = self.rope_scaling and self.rope_scaling.original_max_seq_len
        require(
            original is None or original <= self.max_seq_len,
            f"model.rope_scaling.original_max_seq_len={original} exceeds model.max_seq_len={self.max_seq_len}: "
            "the extended context must be the longer one (raise max_seq_len to the length you want to reach)",
        )
        require(
            self.attention_window is None or self.attention_window <= self.max_seq_len or self.position == "alibi",
            f"model.attention_window={self.attention_window} exceeds model.max_seq_len={self.max_seq_len}, so it "
            "never narrows attention; lower it, or unset it for full attention",
        )
        require(
            self.mlp_tiles == 1 or self.dropout == 0,
            f"model.mlp_tiles={self.mlp_tiles} recomputes the MLP in the backward pass, which would draw other "
            f"dropout masks than the forward; set model.dropout=0 (got {self.dropout}) or model.mlp_tiles=1",
        )
        require(
            self.n_decoder_layers is None or self.arch == "encoder_decoder",
            f"model.n_decoder_layers is only for arch=encoder_decoder, not arch={self.arch}",
        )
        return self

    def _latent_consistent(self) -> None:
        latent = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        if self.attention != "mla":
            for name in latent:
                require(getattr(self, name) is None, f"model.{name} is for model.attention=mla, not {self.attention}")
            return
        require(
            not self.qk_norm,
            "model.qk_norm=true with model.attention=mla: DeepSeek's MLA normalises its latents (q_a_norm, "
            "kv_a_norm) and has no per-head query/key norm; set model.qk_norm=false",
        )
        require(
            self.kv_lora_rank is not None,
            "model.attention=mla needs model.kv_lora_rank, the width of each token's key/value latent "
            "(DeepSeek-V3: 512)",
        )
        require(
            self.qk_rope_head_dim % 2 == 0,
            f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs of values)",
        )
        require(
            self.position == "rope",
            f"model.attention=mla needs model.position=rope (its decoupled RoPE key is its position scheme), "
            f"got model.position={self.position}",
        )
        require(
            self.n_kv_heads in (None, self.n_heads),
            f"model.n_kv_heads={self.n_kv_heads} with model.attention=mla: its keys and values are up-projected "
            "for every head from one shared latent; leave model.n_kv_heads unset",
        )
