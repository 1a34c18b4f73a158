"""Multi-head attention (MHA / GQA / MQA) with interchangeable attention cores.

The projections are plain ``nn.Linear`` layers and the number of heads is read from their output width
(``view(B, T, -1, head_dim)``): a tensor-parallel shard holding a slice of the heads runs this code unchanged.
The core (softmax(QK^T)V under a mask) is a function picked by name from ``BACKENDS``; ``auto`` (the
default) picks the fastest exact core for each call (see :func:`auto_backend` and ``gpu_cores.SPEED_TABLE``).
With ALiBi every core adds the same bias, ``-slope * |q_pos - k_pos|`` (:class:`positions.Alibi`), to the
scores of the allowed entries.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from megatransformer.model import gpu_cores
from megatransformer.model.chunked_attention import chunked_core
from megatransformer.model.compile_marks import constant_result
from megatransformer.model.masks import AttentionMask, VarlenProblem
from megatransformer.model.norms import RMSNorm
from megatransformer.model.positions import Alibi, apply_rope
from megatransformer.model.varlen import torch_varlen_available, torch_varlen_core, varlen_attention, window_size

FLASH_ATTN_INSTALL = "pip install flash-attn --no-build-isolation"  # as flash-attn's README prescribes

# core(q, k, v, mask, dropout, alibi=None); q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D] -> [B, H, Tq, D]
Core = Callable[..., torch.Tensor]


def sdpa_core(q, k, v, mask: AttentionMask, dropout: float, alibi: Alibi | None = None) -> torch.Tensor:
    gqa = q.shape[1] != k.shape[1]
    if alibi is not None:  # an additive float mask: the bias, -inf where the mask forbids (in q's dtype)
        allowed = mask.dense(q.shape[2], k.shape[2], q.device)
        attn_mask = alibi.bias(kv_len=k.shape[2]).masked_fill(~allowed, float("-inf")).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout, enable_gqa=gqa)
    if mask.is_simple and mask.window is None:
        causal = mask.causal and not (mask.q_offset and q.shape[2] == 1)
        if causal and q.shape[2] != k.shape[2]:  # chunked prefill onto a cache: bottom-right aligned
            attn_mask = mask.dense(q.shape[2], k.shape[2], q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, None, dropout, is_causal=causal, enable_gqa=gqa)
    attn_mask = mask.dense(q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout, enable_gqa=gqa)


def eager_core(q, k, v, mask: AttentionMask, dropout: float, alibi: Alibi | None = None) -> torch.Tensor:
    """The textbook formula, for reference and tests (an ALiBi bias is added in fp32)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if alibi is not None:
        scores = scores.float() + alibi.bias(kv_len=k.shape[2])
    allowed = mask.dense(q.shape[2], k.shape[2], q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = F.dropout(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), dropout)
    return probs @ v


_compiled_flex = None


def flex_core(q, k, v, mask: AttentionMask, dropout: float, alibi: Alibi | None = None) -> torch.Tensor:
    """FlexAttention with a block mask: any mask, no dense L x L tensor (compiled on first use); ALiBi as a
    ``score_mod``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    if dropout:
        raise ValueError("attention_backend=flex does not support attention_dropout; set it to 0 or use sdpa")
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise ValueError(
            "FlexAttention has no backward pass on CPU in this PyTorch; train on CPU with "
            "model.attention_backend=sdpa (flex serves CPU inference and GPU training)"
        )
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention)  # (a second shape, an evaluation's, makes it dynamic)
    batch = q.shape[0] if (mask.q_segments is not None or mask.prefix_len is not None) else None
    block_mask = create_block_mask(mask.mask_mod(), batch, None, q.shape[2], k.shape[2], device=q.device)
    score_mod = None if alibi is None else alibi.score_mod()
    gqa = q.shape[1] != k.shape[1]
    with contextlib.nullcontext() if torch.compiler.is_compiling() else compiling_stance():
        return _compiled_flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)


def compiling_stance() -> contextlib.AbstractContextManager:
    """torch.compile's default stance, which compiles what it has not, for FlexAttention called from eager code:
    under another stance (a compiled run's evaluations run ``eager_on_recompile``) it would run its unfused
    reference, which holds every score of every head."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # (torch 2.6)
    return contextlib.nullcontext() if set_stance is None else set_stance("default")


def flash_core(q, k, v, mask: AttentionMask, dropout: float, alibi: Alibi | None = None) -> torch.Tensor:
    """flash-attn (CUDA) for every mask: dense calls for plain causal / bidirectional attention (and a KV
    cache, bottom-right aligned), varlen calls for packed documents, prefix-LM and packed cross-attention,
    from the problems the mask carries (see :func:`masks.varlen_problems`).

    ALiBi goes in as flash-attn's ``alibi_slopes``: a bias ``-slope * |i + len_k - len_q - j|`` for query i
    and key j of each (varlen) sequence, with the absolute value for causal and non-causal calls alike (the
    kernel's ``alibi.h``; causal calls add ``slope * j``, the same after softmax). Those are indices within
    each sequence, bottom-right aligned: for a document, a prefix-LM suffix problem (queries [p, e) over keys
    [s, e)) or a KV cache they are the positions within the document, so this equals :class:`Alibi` on
    ``position_ids`` wherever positions advance by one within a document, as the loader and generation make
    them.

    A sliding window goes in as ``window_size=(window - 1, 0)`` (causal) or ``(window - 1, window - 1)``,
    bottom-right aligned as the causal mask is, per document in varlen calls.
    """
    flash = flash_attn_module()
    if flash is None:
        raise RuntimeError(
            "model.attention_backend=flash needs a working flash-attn package on a CUDA machine "
            f"({FLASH_ATTN_INSTALL}); use auto, sdpa or flex otherwise"
        )
    extra = {} if alibi is None else {"alibi_slopes": alibi.slopes.contiguous()}
    if mask.window is not None:
        extra["window_size"] = window_size(mask.window, mask.causal)
    if mask.is_simple:
        causal = mask.causal and not (mask.q_offset and q.shape[2] == 1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # flash layout: [B, T, H, D]
        return flash.flash_attn_func(q, k, v, dropout_p=dropout, causal=causal, **extra).transpose(1, 2)

    def kernel(q, k, v, problem: VarlenProblem) -> torch.Tensor:
        return flash.flash_attn_varlen_func(
            q,
            k,
            v,
            problem.cu_q,
            problem.cu_k,
            problem.max_q,
            problem.max_k,
            dropout_p=dropout,
            causal=problem.causal,
            **extra,
        )

    return varlen_attention(q, k, v, mask, kernel)


@functools.cache
def flash_attn_module():
    """The flash-attn package when it imports and has the varlen kernel, else None.

    Importing it, not only finding it, is the test: a build against another torch or CUDA fails at import
    (undefined symbols), and such a build must not be chosen by ``auto``.
    """
    try:
        import flash_attn

        flash_attn.flash_attn_func, flash_attn.flash_attn_varlen_func  # noqa: B018 (present in >= 2.0)
    except Exception:  # ImportError, OSError, undefined symbols: not usable here
        return None
    return flash_attn


@constant_result  # (a constant of the process: see gpu_cores)
def flash_attn_installed() -> bool:
    return flash_attn_module() is not None


def registry_flash_core(core: str) -> Core:
    """flash-attn 4 or 3 (``core``: "fa4", "fa3") as PyTorch runs it once activated in its flash registry: SDPA's
    flash backend for plain causal / bidirectional attention, ``varlen_attn`` for packed documents, prefix-LM,
    packed cross-attention and sliding windows (rows of equal length as one varlen problem). A KV cache with a
    prefill chunk goes to SDPA's own kernels (bottom-right causal alignment needs a dense mask there)."""

    def registry_core(q, k, v, mask: AttentionMask, dropout: float, alibi: Alibi | None = None) -> torch.Tensor:
        if dropout or alibi is not None:
            raise ValueError(f"attention_backend={core} has no attention dropout or ALiBi; use flash or sdpa")
        gpu_cores.activate(core)
        if not mask.is_simple:
            return torch_varlen_core(q, k, v, mask, dropout)
        causal = mask.causal and not (mask.q_offset and q.shape[2] == 1)
        if causal and q.shape[2] != k.shape[2]:
            return sdpa_core(q, k, v, mask, dropout)
        if mask.window is None:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                gqa = q.shape[1] != k.shape[1]
                return F.scaled_dot_product_attention(q, k, v, None, 0.0, is_causal=causal, enable_gqa=gqa)
        if mask.q_offset or q.shape[2] != k.shape[2]:  # decoding one token under a window
            return sdpa_core(q, k, v, mask, dropout)
        batch, length = q.shape[0], q.shape[2]
        cu = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * length
        rows = VarlenProblem(cu, cu, length, length, mask.causal)
        return torch_varlen_core(q, k, v, replace(mask, varlen=(rows,)), dropout)

    registry_core.__name__ = f"{core}_core"
    return registry_core


def auto_backend(
    device: str,
    dtype: torch.dtype,
    mask: AttentionMask | None = None,
    dropout: float = 0.0,
    head_dim: int = 64,
    alibi: bool = False,
) -> str:
    """The core ``attention_backend=auto`` runs for one call.

    CUDA, in bf16/fp16: the first core of ``gpu_cores.SPEED_TABLE`` for this GPU's generation and the call's mask
    kind that is installed and can honour the call: flash-attn 3 / 4 through PyTorch's registry (no dropout, no
    ALiBi), flash-attn 2 (``flash``), PyTorch's ``varlen_attn`` (``varlen``: masks with segments or a prefix, no
    dropout, no ALiBi), else SDPA (whose own dispatcher picks its flash / memory-efficient kernels). A GPU the
    table does not know is ranked as Ampere. CPU: the chunked core (1.7-1.9x SDPA in bf16, linear memory for
    every mask), or SDPA when attention dropout is on (chunked has none).
    """
    if device != "cuda":
        return "sdpa" if dropout else "chunked"
    flash_mask = mask is None or mask.is_simple or not mask.q_offset
    flash_shape = head_dim <= 256 and head_dim % 8 == 0
    if dtype not in (torch.bfloat16, torch.float16) or not (flash_mask and flash_shape):
        return "sdpa"
    generation = gpu_cores.gpu_generation() or "ampere"
    registry = gpu_cores.registry_core(generation)
    varlen_mask = mask is not None and not mask.is_simple
    for core in gpu_cores.SPEED_TABLE[(generation, gpu_cores.mask_kind(mask, alibi))]:
        if core in gpu_cores.REGISTRY_IMPLS:
            usable = core == registry and not dropout and head_dim <= gpu_cores.REGISTRY_IMPLS[core].max_head_dim
        elif core == "flash":
            usable = flash_attn_installed()
        elif core == "varlen":
            usable = varlen_mask and not dropout and not alibi and torch_varlen_available()
        else:
            usable = True
        if usable:
            return core
    return "sdpa"


def describe_backend(
    backend: str, device: str, dtype: torch.dtype, dropout: float, head_dim: int = 64, alibi: bool = False
) -> str:
    """One line for the run log: the core a run's attention uses for each kind of mask, and why."""
    if backend != "auto":
        return f"attention: {backend}{registry_note(backend)}"
    kinds = {
        "causal/bidirectional": AttentionMask(True),
        "packed documents, prefix-LM, cross-attention": AttentionMask(True, prefix_len=torch.zeros(1)),
    }
    chosen = {name: auto_backend(device, dtype, mask, dropout, head_dim, alibi) for name, mask in kinds.items()}
    where = f"on {device} in {str(dtype).removeprefix('torch.')}"
    if len(set(chosen.values())) == 1:
        line = f"attention: auto -> {next(iter(chosen.values()))} for every mask {where}"
    else:
        line = "attention: auto -> " + ", ".join(f"{core} for {name}" for name, core in chosen.items()) + f" {where}"
    if device == "cuda" and dtype != torch.float32:
        line += auto_reason(set(chosen.values()), dropout, alibi)
    return line


def registry_note(core: str) -> str:
    """What a registry core runs as, for the run log ("" for other cores)."""
    if core not in gpu_cores.REGISTRY_IMPLS:
        return ""
    active = gpu_cores.active_impl()
    return f" (flash-attn {core[-1]} through PyTorch's flash registry; active: {active or 'none yet'})"


def auto_reason(chosen: set[str], dropout: float, alibi: bool) -> str:
    """Why ``auto`` runs ``chosen`` on this GPU: its generation, and what the faster cores lack."""
    generation = gpu_cores.gpu_generation()
    reasons = [] if generation is None else [f"{generation} GPU"]
    registry = [core for core in chosen if core in gpu_cores.REGISTRY_IMPLS]
    if registry:
        reasons.append(registry_note(registry[0]).strip(" ()"))
    elif generation is not None:
        faster = [
            core
            for core in gpu_cores.SPEED_TABLE[(generation, "causal")]
            if core in gpu_cores.REGISTRY_IMPLS and generation in gpu_cores.REGISTRY_IMPLS[core].generations
        ]
        if alibi or dropout:
            reasons.append(f"{', '.join(faster)} have no {'ALiBi' if alibi else 'attention dropout'}")
        else:
            installed = [core for core in faster if gpu_cores.registry_impl_installed(core)]
            reasons += [f"{core} not taken: {gpu_cores.registry_skip(core, generation)}" for core in installed]
            missing = [core for core in faster if core not in installed]
            if missing:
                installs = "; ".join(f"{core}: {gpu_cores.REGISTRY_IMPLS[core].install}" for core in missing)
                reasons.append(f"not installed: {installs}")
    if not flash_attn_installed():
        reasons.append(f"flash-attn is not installed: {FLASH_ATTN_INSTALL}")
    return f" ({'; '.join(reasons)})" if reasons else ""


def auto_core(q, k, v, mask: AttentionMask, dropout: float, alibi: Alibi | None = None) -> torch.Tensor:
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    name = auto_backend(device, dtype, mask, dropout, q.shape[-1], alibi is not None)
    return BACKENDS[name](q, k, v, mask, dropout, alibi)


BACKENDS: dict[str, Core] = {
    "auto": auto_core,
    "sdpa": sdpa_core,
    "eager": eager_core,
    "flex": flex_core,
    "flash": flash_core,
    "chunked": chunked_core,
    "varlen": torch_varlen_core,
    "fa4": registry_flash_core("fa4"),
    "fa3": registry_flash_core("fa3"),
}


class KVCache:
    """Pre-allocated keys/values of one self-attention layer for incremental decoding, and the keys'
    positions (which ALiBi's bias needs).

    With a sliding ``window`` (``model.attention_window``) it holds only the last ``window - 1`` keys, those the
    next query can still see, however long the generation: ``length`` counts the keys held, ``seen`` the
    positions decoded so far. Masks index the keys a call attends to from the first one held (``q_offset`` =
    ``length``), positions count from the start (``seen``). ``value_dim``: the values' width where it is not
    the keys' (multi-head latent attention holds its latent as the keys and its RoPE key as the values).

    The keys and values are allocated by the first :meth:`append`, in its tensors' heads, widths, dtype and device:
    those a tensor-parallel shard computes (a slice of the heads), autocast's dtype where it is on."""

    def __init__(self, batch: int, max_len: int, device, window: int | None = None) -> None:
        self.window = window if window is not None and window - 1 < max_len else None  # (else everything fits)
        self.size = max_len if self.window is None else self.window - 1
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.positions = torch.zeros(batch, self.size, dtype=torch.long, device=device)
        self.length = 0  # keys held
        self.dropped = 0  # keys before them, out of the window

    @property
    def seen(self) -> int:
        """Positions decoded so far: the position of the next token."""
        return self.dropped + self.length

    def append(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This call's keys and values after the ones held, which its queries attend to, and their positions
        (None unless ``positions`` are tracked)."""
        if self.k is None:
            batch = self.positions.shape[0]
            self.k = k.new_empty(batch, k.shape[1], self.size, k.shape[3])
            self.v = v.new_empty(batch, v.shape[1], self.size, v.shape[3])
        if self.window is not None:
            return self._slide(k, v, positions)
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions, decoding needs {end}")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        if positions is not None:
            self.positions[:, self.length : end] = positions
        self.length = end
        held = None if positions is None else self.positions[:, :end]
        return self.k[:, :, :end], self.v[:, :, :end], held

    def _slide(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        k = torch.cat([self.k[:, :, : self.length], k], 2)
        v = torch.cat([self.v[:, :, : self.length], v], 2)
        if positions is not None:
            positions = torch.cat([self.positions[:, : self.length], positions], 1)
        keep = min(k.shape[2], self.k.shape[2])
        self.k[:, :, :keep] = k[:, :, k.shape[2] - keep :]
        self.v[:, :, :keep] = v[:, :, v.shape[2] - keep :]
        if positions is not None:
            self.positions[:, :keep] = positions[:, positions.shape[1] - keep :]
        self.dropped += k.shape[2] - keep
        self.length = keep
        return k, v, positions


class Attention(nn.Module):
    """``qk_norm_eps``: with a value, QK-norm: an RMSNorm over each head's queries (``q_norm``) and keys
    (``k_norm``), weights of size head_dim shared by all heads, before RoPE (as Qwen3)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        bias: bool,
        dropout: float,
        backend: str,
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = d_model // n_heads
        self.total_heads = n_heads  # all heads, of which a tensor-parallel shard holds a slice (not "n_heads":
        # DeepSpeed's AutoTP divides attributes of that name by the tensor-parallel size)
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(self.head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, qk_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.dropout = dropout
        self.core = BACKENDS[backend]
        # the first of all heads that q_proj holds: 0, or a tensor-parallel shard's first head (set by
        # tp_plan.assign_head_offsets); picks this module's ALiBi slopes
        self.head_offset = 0

    def _heads(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        x = x.view(x.shape[0], x.shape[1], -1, self.head_dim)
        return (x if norm is None else norm(x)).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        memory: torch.Tensor | None = None,
        cache: KVCache | None = None,
        memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        alibi: Alibi | None = None,
    ) -> torch.Tensor:
        """Self-attention over ``x``, or cross-attention to ``memory`` (the encoder output).

        ``cache`` appends this call's keys/values (self-attention decoding); ``memory_kv`` reuses
        precomputed cross-attention keys/values (see :meth:`project_memory`). ``alibi``: the bias of all
        heads, of which this module takes its own.
        """
        q = self._heads(self.q_proj(x), self.q_norm)
        if memory_kv is not None:
            k, v = memory_kv
        else:
            source = x if memory is None else memory
            k, v = self._heads(self.k_proj(source), self.k_norm), self._heads(self.v_proj(source))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v, key_positions = cache.append(k, v, None if alibi is None else alibi.q_positions)
            if alibi is not None:
                alibi = alibi.with_keys(key_positions)
        if alibi is not None:
            alibi = alibi.heads(self.head_offset, q.shape[1])
        out = self.core(q, k, v, mask, self.dropout if self.training else 0.0, alibi)
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))

    def project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys/values of the encoder output, computed once per generation."""
        return self._heads(self.k_proj(memory), self.k_norm), self._heads(self.v_proj(memory))
