"""Per-rank memory and step time of a training layout, and the layouts to choose from (``megatransformer plan``).

Model arithmetic from the config: every term is derived in docs/planner.md, and checked against the measured
peak of live tensor bytes of real steps on CPU (``bench/plan_memory.py``, BENCHMARKS.md). Nothing here
imports DeepSpeed: what its engine keeps per ZeRO stage is written down below as arithmetic.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from megatransformer.config import ModelConfig, RunConfig

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 1 << 30

PARTS = (
    "weights",
    "master_weights",
    "gradients",
    "optimizer_states",
    "activations",
    "loss_chunk",
    "attention_transients",
    "communication_buffers",
    "checkpoint_staging",
    "overheads",
)

# DeepSpeed's ZeRO defaults (runtime/zero/config.py), in elements: the gradient reduction bucket; ZeRO-3's
# prefetch bucket, most parameters gathered at once, reuse distance, persistence threshold and sub-group size
REDUCE_BUCKET = 500_000_000
ZERO3_PREFETCH = 50_000_000
ZERO3_MAX_LIVE = 1_000_000_000
ZERO3_MAX_REUSE = 1_000_000_000
ZERO3_PERSISTENCE = 100_000
ZERO3_SUB_GROUP = 1_000_000_000
CORE_CHUNK = 64  # query positions per chunk of the CPU's attention core (model/chunked_attention.py's CHUNK)


@dataclass(frozen=True)
class Device:
    """An accelerator as the planner sees it: memory, dense peak in bf16, link bandwidths per device."""

    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16 / fp16 (fp32 runs at half of it on tensor cores via TF32: see step_seconds)
    intra_node_gbps: float  # GB/s one way per device (NVLink / NVSwitch)
    inter_node_gbps: float  # GB/s per device across nodes (InfiniBand / RoCE)
    kind: str = "cuda"
    reserved_gib: float = 2.0  # CUDA context, cuBLAS workspaces, the caching allocator's fragmentation
    host_gib: float = 240.0  # host memory per rank: a 2 TB node over its 8 GPUs, less the system's (--host-memory)


# matched by substring in order (the first match wins: NVL / PCIe before their SXM names); peaks are the
# vendors' dense bf16 figures, links NVLink 4 (450 GB/s one way) and 400 Gb/s InfiniBand per GPU (50 GB/s)
GPUS: tuple[Device, ...] = (
    Device("GH200", 96, 989.0, 450, 50),
    Device("H100 NVL", 94, 835.0, 300, 50),
    Device("H100 PCIe", 80, 756.0, 64, 50),
    Device("H100", 80, 989.0, 450, 50),
    Device("H200 NVL", 141, 835.0, 450, 50),
    Device("H200", 141, 989.0, 450, 50),
    Device("B200", 180, 2250.0, 900, 50),
    Device("A100-40", 40, 312.0, 300, 25),
    Device("A100", 80, 312.0, 300, 25),
)

MFU = 0.40  # the fraction of the peak a step's arithmetic reaches (Megatron-LM 41-47%, torchtitan 33-39% on H100)
CPU_STEP_EFFICIENCY = 0.55  # a CPU training step against its GEMM speed (stated; BENCHMARKS.md 5v compares)
HOST_ADAM_GBPS = 2.0  # states an offloaded optimizer step streams per second through DeepSpeed's CPU Adam
# what a micro batch costs per layer besides its arithmetic (kernel launches, the engine's bookkeeping): a few
# hundred microseconds on a GPU, so that fewer, larger micro batches win where they fit
MICRO_STEP_SECONDS = {"cuda": 3e-4, "cpu": 1e-3}


def find_gpu(name: str) -> Device | None:
    """The table's entry for a GPU name (``h100``, ``NVIDIA H100 80GB HBM3``), or None."""
    key = name.lower().replace(" ", "").replace("_", "-")
    for gpu in GPUS:
        if gpu.name.lower().replace(" ", "") in key:
            return gpu
    return None


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    sp: int
    zero: int
    activation_checkpointing: bool | str  # False, True (every block's input only) or "selective" (its products)
    mlp_tiles: int
    offload: bool
    micro_batch: int
    accum: int

    def describe(self) -> str:
        degrees = " x ".join([f"dp{self.dp}"] + [f"{n}{d}" for n, d in (("tp", self.tp), ("sp", self.sp)) if d > 1])
        extras = [f"ZeRO-{self.zero}", f"mb {self.micro_batch} x {self.accum}"]
        if self.activation_checkpointing:
            extras.append("sel-ckpt" if self.activation_checkpointing == "selective" else "ckpt")
        if self.mlp_tiles > 1:
            extras.append(f"tiles {self.mlp_tiles}")
        if self.offload:
            extras.append("offload")
        return f"{degrees}, {', '.join(extras)}"


# --------------------------------------------------------------------------------------------- memory


_SIZES: dict[str, list[tuple[int, bool, int]]] = {}


def parameter_sizes(m: ModelConfig) -> list[tuple[int, bool, int]]:
    """(elements, whether tensor parallelism splits it, copies) of each parameter (tied ones once), sorted by the
    tensor-parallel plan; a block's counted once per layer of its stack (flops.one_block_per_stack)."""
    key = m.model_dump_json()
    if key not in _SIZES:
        from megatransformer.flops import one_block_per_stack
        from megatransformer.model.tp_plan import partition_dim

        model, copies = one_block_per_stack(m)
        _SIZES[key] = [
            (p.numel(), partition_dim(name) is not None, copies(name)) for name, p in model.named_parameters()
        ]
    return _SIZES[key]


def muon_elements(m: ModelConfig, tp: int) -> int:
    """Elements of the matrices a tensor-parallel rank updates with Muon (the model's hidden matrices, read from
    one block per stack as :func:`parameter_sizes` does): one momentum buffer each, where Adam keeps two moments."""
    from megatransformer.flops import one_block_per_stack
    from megatransformer.model.matrices import hidden_matrix_names
    from megatransformer.model.tp_plan import partition_dim

    model, copies = one_block_per_stack(m)
    named = dict(model.named_parameters())
    chosen = hidden_matrix_names(model)
    return sum(named[n].numel() // (tp if partition_dim(n) is not None else 1) * copies(n) for n in chosen)


_OWNERS: dict[tuple[str, int], tuple[int, int, int]] = {}


def muon_owner_work(m: ModelConfig, ranks: int) -> tuple[int, int, int]:
    """Newton-Schulz FLOPs of one iteration at the busiest of ``ranks`` ranks (each matrix to one owner, or split
    across a team, assigned as training assigns them: ``flops.balance_teams``), the elements of the largest block a
    rank orthogonalises (a whole matrix, or a member's columns of one) and the side of its matrix's A = X Xᵀ."""
    key = (m.model_dump_json(), ranks)
    if key not in _OWNERS:
        from megatransformer.flops import balance_teams, newton_schulz_flops, one_block_per_stack, team_loads
        from megatransformer.model.matrices import hidden_matrix_names

        model, copies = one_block_per_stack(m)
        named = dict(model.named_parameters())
        shapes = [tuple(named[n].shape) for n in hidden_matrix_names(model) for _ in range(copies(n))]
        costs = [newton_schulz_flops(shape) for shape in shapes]
        teams = balance_teams(costs, ranks, [min(shape) for shape in shapes])
        block, side = max((-(-a * b // len(team)), min(a, b)) for (a, b), team in zip(shapes, teams))
        _OWNERS[key] = max(team_loads(costs, teams, ranks)), block, side
    return _OWNERS[key]


def muon_step_bytes(cfg: RunConfig, layout: Layout, kind: str) -> int:
    """What Muon's step adds at an owner: its share of the updates sent to their owners and the results coming
    back (fp32, both ways), and Newton-Schulz's working set on the largest block (:func:`newton_schulz_bytes`)."""
    ranks = layout.dp * layout.tp * layout.sp
    elements = muon_elements(cfg.model, layout.tp)
    shards = layout.dp * layout.sp if layout.zero else 1
    _, block, m = muon_owner_work(cfg.model, ranks)
    dtype = cfg.optim.muon_ns_dtype
    upcast = fp32_gemms(cfg, kind, dtype, compiled=False)
    return 2 * 4 * -(-elements // shards) + newton_schulz_bytes(block, m, BYTES[dtype], upcast)


def newton_schulz_bytes(block: int, side: int, width: int, upcast: bool) -> int:
    """Newton-Schulz's working set on a block of ``block`` elements whose A = X Xᵀ is ``side`` x ``side``, in
    ``width``-byte elements: the block in fp32, then X and the next X; A and the polynomial, whole at every member
    of a team, plus two A in fp32 as they are summed and sent, counted for every block. ``upcast``: bf16 products
    as fp32 GEMMs (:func:`fp32_gemms`), which add at their largest moment X and Xᵀ in fp32 for A = X Xᵀ and A in
    fp32 before it is rounded (``aX + BX`` adds less: X once, B, and the product's other half)."""
    extra = 8 * block + 2 * side * side if upcast else 0
    return 4 * block + width * (2 * block + 2 * side * side) + 2 * 4 * side * side + extra


def parameter_counts(m: ModelConfig) -> tuple[int, int]:
    """(parameters tensor parallelism splits, parameters every rank keeps whole)."""
    sizes = parameter_sizes(m)
    return sum(n * k for n, split, k in sizes if split), sum(n * k for n, split, k in sizes if not split)


def largest_parameter(m: ModelConfig, tp: int) -> int:
    """Elements of the largest parameter a tensor-parallel rank holds."""
    return max(-(-n // tp) if split else n for n, split, _ in parameter_sizes(m))


def reduce_bucket_elements(m: ModelConfig, tp: int) -> int:
    """Elements of ZeRO-1/2's gradient reduction bucket (DeepSpeed's ``reduce_bucket_size``; ZeRO-3's:
    :func:`zero3_sizes`): its default, or the gradients of every parameter a rank holds where they are fewer.
    DeepSpeed allocates the whole bucket whatever the model's size; one that holds every gradient reduces them all
    at once either way."""
    split, whole = parameter_counts(m)
    return min(REDUCE_BUCKET, -(-split // tp) + whole)


@dataclass(frozen=True)
class Zero3Sizes:
    """ZeRO-3's sizes in elements, derived from the model (:func:`zero3_sizes`); what each bounds in DeepSpeed
    0.19.8 (``runtime/zero/stage3.py``, ``partitioned_param_coordinator.py``):

    - ``reduce_bucket``: the fp32 gradient bucket, allocated once; gradients are reduce-scattered whenever the next
      would not fit (a larger parameter's is reduce-scattered from its own tensor, the bucket bypassed);
    - ``prefetch_bucket``: the parameters gathered ahead of their use, at a time;
    - ``max_live``: prefetching stops while this many elements are gathered (the module about to run is gathered
      whatever the count);
    - ``max_reuse_distance``: a module's parameters stay gathered after it ran if they are used again within this
      many elements of the trace (the default, 1e9, keeps a smaller model's every weight from its forward to its
      backward pass);
    - ``persistence_threshold``: parameters of at most this many elements stay whole on every rank;
    - ``sub_group``: elements of a rank's partition per optimizer sub-group, stepped one at a time (its gradients
      flattened into one fp32 tensor at the step; at the engine's start a zero fp32 gradient as long as the
      sub-group's parameters whole, not their partition: the default, 1e9, makes that the whole model below 1e9
      elements a rank).
    """

    reduce_bucket: int
    prefetch_bucket: int
    max_live: int
    max_reuse_distance: int
    persistence_threshold: int
    sub_group: int

    def deepspeed(self) -> dict[str, int]:
        """The sizes as DeepSpeed's ``zero_optimization`` names them."""
        return {
            "reduce_bucket_size": self.reduce_bucket,
            "stage3_prefetch_bucket_size": self.prefetch_bucket,
            "stage3_max_live_parameters": self.max_live,
            "stage3_max_reuse_distance": self.max_reuse_distance,
            "stage3_param_persistence_threshold": self.persistence_threshold,
            "sub_group_size": self.sub_group,
        }


def zero3_sizes(m: ModelConfig, tp: int, shards: int = 1) -> Zero3Sizes:
    """ZeRO-3's sizes for model ``m`` on a tensor-parallel rank whose parameters are partitioned over ``shards``
    ranks: one layer (the largest block or table, :func:`largest_layer`) per bucket, gathered ahead, kept for reuse
    and per optimizer sub-group (its share of the partition), two layers gathered at most; vectors (norms, biases:
    at most 10 d_model elements) whole on every rank; never above DeepSpeed's defaults."""
    layer = largest_layer(m, tp)
    return Zero3Sizes(
        reduce_bucket=min(REDUCE_BUCKET, layer),
        prefetch_bucket=min(ZERO3_PREFETCH, layer),
        max_live=min(ZERO3_MAX_LIVE, 2 * layer),
        max_reuse_distance=min(ZERO3_MAX_REUSE, layer),
        persistence_threshold=min(ZERO3_PERSISTENCE, 10 * m.d_model),
        sub_group=min(ZERO3_SUB_GROUP, -(-layer // shards)),
    )


def persistent_elements(m: ModelConfig, tp: int, threshold: int) -> int:
    """Elements of the parameters ZeRO-3 keeps whole on every rank: those of at most ``threshold`` elements."""
    sizes = ((-(-n // tp) if split else n, k) for n, split, k in parameter_sizes(m))
    return sum(n * k for n, k in sizes if n <= threshold)


def gathered_elements(m: ModelConfig, tp: int) -> int:
    """ZeRO-3's gathered parameters at most, besides the persistent ones: prefetching stops at ``max_live``, and the
    module about to run (at most the largest parameter's) is gathered whatever the count."""
    return zero3_sizes(m, tp).max_live + largest_parameter(m, tp)


def checkpoint_staging_bytes(cfg: RunConfig, layout: Layout) -> int:
    """The checkpointer's host copies of the pieces a rank writes (fp32 masters and optimizer states; ranks holding
    the same elements split them), kept from a run's first save on for the next."""
    split, whole = parameter_counts(cfg.model)
    writers = layout.dp * layout.sp
    written = -(-(split // layout.tp + whole) // writers)
    states = 2 * written  # Adam's two moments; Muon's matrices one momentum buffer
    if cfg.optim.name == "muon":
        states -= -(-muon_elements(cfg.model, layout.tp) // writers)
    return 4 * (written + states)


def core_values(m: ModelConfig, latent: bool) -> int:
    """q, k, v and the core's output per position; under multi-head latent attention (``latent``) every head's,
    up-projected."""
    if not latent:
        return 2 * m.d_model + 2 * m.kv_heads * m.head_dim
    return m.n_heads * (2 * (m.qk_nope_head_dim + m.qk_rope_head_dim) + 2 * m.v_head_dim)


def latent_values(m: ModelConfig) -> tuple[int, int]:
    """Values per position multi-head latent attention keeps besides its core's: (split by tensor parallelism,
    whole on every rank). Split: the keys' part of kv_b_proj's output, which the values are a view of; whole:
    the query and key/value latents before their norms (the latter with the RoPE key beside it) and after."""
    return m.n_heads * m.qk_nope_head_dim, 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + m.qk_rope_head_dim


def ffn_kept(m: ModelConfig) -> int:
    """Values per position an untiled MLP keeps for its backward: swiglu its gate, silu(gate), up and their
    product; gelu the input and output of the activation; relu its output."""
    return {"swiglu": 4, "gelu": 2, "relu": 1}[m.ffn] * m.d_ff


def block_kept(m: ModelConfig, layout: Layout, cross: bool) -> int:
    """Values one block keeps per position this rank holds (docs/planner.md counts them from the code):
    each sub-layer's norm input and output (whole under tensor parallelism), the rotated q, k, v the core
    keeps and the core's output as o_proj's input (split by tp); under Ulysses the whole-sequence q, k, v and
    output of this rank's heads again (kv heads replicated up to the degree); the MLP's hidden values
    unless it runs in tiles (then its input only, which its recomputation needs)."""
    d, hd, tp, sp = m.d_model, m.head_dim, layout.tp, layout.sp
    latent = m.attention == "mla"
    attention = 2 * d + core_values(m, latent) // tp
    if latent:
        split, whole = latent_values(m)
        attention += split // tp + whole
    if m.qk_norm:  # the queries and keys before their norms
        attention += (d + m.kv_heads * hd) // tp
    if sp > 1:
        attention += core_values(m, latent) - 2 * m.kv_heads * hd + 2 * max(m.kv_heads, sp) * hd
    if cross:  # cross-attention is standard attention
        attention += 2 * d + core_values(m, False) // tp
        if sp > 1:
            attention += 2 * d + 2 * max(m.kv_heads, sp) * hd
    mlp = 2 * d + (ffn_kept(m) // tp if layout.mlp_tiles == 1 else 0)
    return attention + mlp


def selective_kept(m: ModelConfig, layout: Layout, cross: bool, kind: str) -> int:
    """Values one block keeps per position under selective activation checkpointing (the model's
    ``KEPT_BY_SELECTIVE_CHECKPOINTING``): its input, and the outputs of its matrix products (q, k and v, o_proj,
    the MLP's up and gate and down) and of a fused attention kernel (the core's output; the CPU's chunked core
    keeps nothing and runs again). Multi-head latent attention is counted as without checkpointing."""
    if m.attention == "mla":
        return block_kept(m, layout, cross)
    d, tp = m.d_model, layout.tp
    kv = m.kv_heads * m.head_dim
    fused_core = kind != "cpu" or m.attention_backend == "sdpa"
    attention = (d + 2 * kv) // tp + (d // tp if fused_core else 0) + d
    mlp = (2 if m.ffn == "swiglu" else 1) * m.d_ff // tp + d
    return d + attention * (2 if cross else 1) + mlp


def activation_parts(cfg: RunConfig, layout: Layout, kind: str) -> dict[str, int]:
    """Bytes of the activations kept through a micro batch's forward (``activations``), of the block that
    activation checkpointing recomputes in the backward (``recomputed``), and the largest transients on top of
    them: the fused loss's chunk of logits (``loss_chunk``, in the forward) and the backward's buffers of one
    block (``attention_transients``: the attention core's and the MLP's gradients)."""
    m, w = cfg.model, BYTES[cfg.precision]
    tp, sp = layout.tp, layout.sp
    source, target = row_lengths(cfg)
    local, local_target = layout.micro_batch * source // sp, layout.micro_batch * target // sp
    stacks = [(m.n_layers, False, local)] + (
        [(m.decoder_layers, True, local_target)] if m.arch == "encoder_decoder" else []
    )
    per_block = [block_kept(m, layout, cross) for _, cross, _ in stacks]
    recomputed = 0
    if layout.activation_checkpointing == "selective":  # its products; in the backward one block's rest again
        selective = [selective_kept(m, layout, cross, kind) for _, cross, _ in stacks]
        blocks = sum(n * positions * v for (n, _, positions), v in zip(stacks, selective))
        recomputed = max(p * (v - s) for (_, _, p), v, s in zip(stacks, per_block, selective)) * w
    elif layout.activation_checkpointing:  # each block's input; in the backward, one block recomputed at a time
        blocks = sum(n * positions for n, _, positions in stacks) * m.d_model
        recomputed = max(positions * v for (_, _, positions), v in zip(stacks, per_block)) * w
    else:
        blocks = sum(n * positions * v for (n, _, positions), v in zip(stacks, per_block))
    # cos and sin, shared by the layers of a stack
    rope = 2 * (m.qk_rope_head_dim if m.attention == "mla" else m.head_dim) if m.position == "rope" else 0
    final_norm = m.d_model if m.norm_position == "pre" and m.final_norm else 0
    model_level = sum(positions for _, _, positions in stacks) * (final_norm + rope)
    model_level += local_target * m.d_model  # the loss's gradient of the hidden states
    if m.arch == "encoder_decoder":
        model_level += local * m.d_model  # the encoder's output, which every cross-attention projects
    kept = (blocks + model_level) * w + rendered_masks(cfg, layout, kind)
    # the fused loss: a chunk's fp32 logits and logsumexp's same-sized temporary; from the second chunk on, the
    # previous chunk's logits (and their gradient in the compute dtype) live until the new ones exist
    rows = max(1, chunk_logits(kind) // m.vocab_size)
    per_logit = 8 if rows >= local_target else 12 + (w if w != 4 else 0)
    loss_chunk = min(rows, local_target) * m.vocab_size * per_logit
    # the backward of the last block's attention: the gradient arriving at the core and the residual stream's,
    # the gradients of q, k, v (k and v summed in fp32 by the chunked core, with contiguous copies of the keys
    # and values a query chunk sees) and that chunk's scores, probabilities and their gradients; flash / SDPA
    # keep an fp32 accumulator of dq instead. Under Ulysses the core sees the whole sequence of its heads.
    heads = max(1, m.n_heads // (tp * sp)) * layout.micro_batch
    kv_local = max(m.kv_heads, sp) * m.head_dim // (tp * sp) if sp > 1 else m.kv_heads * m.head_dim // tp
    q_local = m.d_model // (tp * sp)
    whole = layout.micro_batch * cfg.data.seq_len if sp > 1 else local
    arriving = local * 2 * m.d_model * w
    if kind == "cpu":
        scores = heads * CORE_CHUNK * cfg.data.seq_len * 4 * 4
        attention = arriving + whole * ((q_local + 2 * kv_local) * (w + 4) + 2 * kv_local * w) + scores
    else:
        attention = arriving + whole * ((q_local + 2 * kv_local) * w + q_local * 4)
    hidden = m.d_ff // tp
    if layout.mlp_tiles > 1:
        tile = -(-local // layout.mlp_tiles)
        mlp = tile * (ffn_kept(m) // tp + 3 * hidden) * w  # one tile recomputed, and its gradients
    else:
        mlp = local * 3 * hidden * w
    # the MLP's backward comes first, with every value of the block alive; by the attention's backward, the
    # MLP's kept values are gone
    last_mlp = local * (2 * m.d_model + (ffn_kept(m) // tp if layout.mlp_tiles == 1 else 0)) * w
    # a CPU without bf16 GEMM kernels runs bf16 GEMMs as fp32 GEMMs of upcast operands (training/runtime/cpu_bf16):
    # the largest, an MLP projection's, holds its input, weight and output in fp32 for a moment
    upcast = 4 * (local * m.d_model + m.d_model * hidden + local * hidden) if fp32_gemms(cfg, kind) else 0
    return {
        "activations": kept,
        "recomputed": recomputed,
        "loss_chunk": loss_chunk,
        "attention_transients": max(mlp, attention - last_mlp, 0) + upcast,
    }


def fp32_gemms(cfg: RunConfig, kind: str, precision: str | None = None, compiled: bool | None = None) -> bool:
    """Whether bf16 GEMMs go through fp32 upcasts on this machine's CPU (``train.cpu_bf16_matmul``): the model's
    (by default: in the run's precision, compiled as the run is), or others' (Muon's Newton-Schulz: in its own
    dtype, never compiled)."""
    if kind != "cpu" or (precision or cfg.precision) != "bf16":
        return False
    import torch

    from megatransformer.training.runtime.cpu_bf16 import gemms_as_fp32

    compiled = bool(cfg.train.compile) if compiled is None else compiled
    return gemms_as_fp32(cfg.train.cpu_bf16_matmul, "cpu", torch.bfloat16, compiled=compiled)


def row_lengths(cfg: RunConfig) -> tuple[int, int]:
    """Positions of a row in the first stack and in the last (the one the loss reads): span corruption's decoder
    sees the targets of the examples whose inputs fill the row (data_pipeline's span_corruption_window), any
    other row is data.seq_len long in each stack."""
    if cfg.model.arch == "encoder_decoder" and cfg.objective == "span_corruption":
        from data_pipeline.objectives import span_corruption_window

        return cfg.data.seq_len, span_corruption_window(cfg.data.seq_len, cfg.objective_args)[1]
    return cfg.data.seq_len, cfg.data.seq_len


def rendered_masks(cfg: RunConfig, layout: Layout, kind: str) -> int:
    """Bytes of the boolean mask chunks the CPU's attention core renders once per batch and keeps for every
    layer (``AttentionMask.blocked``, at most ``RENDERED_LIMIT`` a mask): for each mask of the model that is not
    plain causal or full, i.e. rows of packed documents (the loader packs), prefixes, windows, and
    cross-attention; each query chunk against the keys it may see, over the whole sequence (Ulysses' core sees
    all of it)."""
    from megatransformer.model.masks import RENDERED_LIMIT

    if kind != "cpu":
        return 0
    m, (length, target) = cfg.model, row_lengths(cfg)
    window = m.attention_window

    def chunks(causal: bool, windowed: bool, queries: int = length, keys_of: int = length) -> int:
        if windowed and window:
            keys = min(keys_of, (window + CORE_CHUNK) * (1 if causal else 2))
        else:
            keys = (keys_of + CORE_CHUNK) // 2 if causal else keys_of
        return min(RENDERED_LIMIT, layout.micro_batch * queries * min(keys, keys_of))

    masks = {
        "decoder": [chunks(True, True)],
        "encoder": [chunks(False, True)],
        "encoder_decoder": [chunks(False, True), chunks(True, True, target, target), chunks(False, False, target)],
    }[m.arch]
    return sum(masks)


def chunk_logits(kind: str) -> int:
    from megatransformer.model.head import CHUNK_LOGITS

    return CHUNK_LOGITS.get(kind, CHUNK_LOGITS["cpu"])


def state_parts(
    cfg: RunConfig, layout: Layout, engine: bool, host: bool = False
) -> tuple[dict[str, int], dict[str, int], int]:
    """What a rank holds besides activations: between steps (weights, master weights, optimizer states and
    the gradients and buffers DeepSpeed keeps), from the backward's start to the step's end (ZeRO-1/2's
    reduction bucket, allocated in every backward), and the gradients' bytes that come and go at the end of
    the backward. ``engine``: DeepSpeed's engine at ``layout.zero`` (docs/planner.md: which optimizer wrapper
    keeps what); else a plain loop (the model, torch's AdamW; bf16 with fp32 masters and their fp32 grads).
    ``host``: the device's memory is the host's (a CPU), where an offloaded optimizer keeps its part."""
    split, whole = parameter_counts(cfg.model)
    params = split // layout.tp + whole
    w, lp = BYTES[cfg.precision], cfg.precision != "fp32"
    shards = layout.dp * layout.sp if layout.zero > 0 else 1  # ZeRO partitions over sequence peers too
    part = -(-params // shards)
    held = {name: 0 for name in PARTS}
    in_backward = {name: 0 for name in PARTS}
    held["optimizer_states"] = 8 * part
    if cfg.optim.name == "muon":  # (partitioned as Adam's moments)
        held["optimizer_states"] -= 4 * -(-muon_elements(cfg.model, layout.tp) // shards)
    held["weights"] = w * params
    if not engine:
        held["master_weights"] = 8 * params if lp else 0
        return held, in_backward, w * params
    if layout.zero == 0:  # torch's AdamW (fp32), or DeepSpeed's FP16_UnfusedOptimizer: fp32 copies and grads
        held["master_weights"] = 4 * params if lp else 0
        if layout.dp * layout.sp > 1:  # the flat copy of the gradients it all-reduces (kept between steps)
            held["communication_buffers"] = 4 * params
        return held, in_backward, w * params + (4 * params if lp else 0)
    held["master_weights"] = 4 * part
    held["gradients"] = 4 * part  # fp32 gradient partitions
    bucket = reduce_bucket_elements(cfg.model, layout.tp)
    step_grads = 0
    if layout.zero == 3:
        # the partition and the persistent parameters whole; the fp32 reduction bucket (allocated once) and the
        # gathered weights. The reduce-scatter copies the bucket (gloo, on a CPU, once more)
        sizes = zero3_sizes(cfg.model, layout.tp)
        persistent = persistent_elements(cfg.model, layout.tp, sizes.persistence_threshold)
        held["weights"] = w * (part + persistent)
        gathered = min(params - persistent, gathered_elements(cfg.model, layout.tp))
        held["communication_buffers"] = 4 * sizes.reduce_bucket + w * gathered
        in_backward["communication_buffers"] = 4 * sizes.reduce_bucket * (2 if host else 1)
        if layout.offload:  # the fp32 partitions' own gradients, besides the reduced ones
            held["gradients"] += 4 * part
    elif layout.zero == 1 and lp and not layout.offload:  # BF16_Optimizer: fp32 gradients of every parameter
        held["gradients"] = 4 * params
        step_grads = w * params
    else:
        # DeepSpeedZeroOptimizer: a reduction bucket in every backward (fp32 for ZeRO-1's accumulation, the
        # model's dtype for ZeRO-2's staging); ZeRO-1 keeps the model's full gradients until they are reduced
        in_backward["communication_buffers"] = (4 if layout.zero == 1 else w) * bucket
        step_grads = w * params if layout.zero == 1 else 0
        if layout.offload:  # staging for the gradients' copy to the host, on the device and on the host
            largest = largest_parameter(cfg.model, layout.tp)
            held["communication_buffers"] = w * largest + (w * part + w * largest if host else 0)
    if layout.offload and not host:  # the fp32 masters, their gradients and Adam's moments live on the host
        held["master_weights"] = held["optimizer_states"] = held["gradients"] = 0
    return held, in_backward, step_grads


def zero3_step_bytes(cfg: RunConfig, layout: Layout) -> int:
    """ZeRO-3's optimizer step: each sub-group's reduced gradients flattened into one fp32 tensor (a sub-group
    holds up to DeepSpeed's ``sub_group_size`` elements of the partition; offloaded, the gradients are flat
    already)."""
    if layout.zero != 3 or layout.offload:
        return 0
    split, whole = parameter_counts(cfg.model)
    shards = layout.dp * layout.sp
    part = -(-(split // layout.tp + whole) // shards)
    # (a sub-group closes with the parameter that fills it: at most one parameter's share more)
    sub_group = zero3_sizes(cfg.model, layout.tp, shards).sub_group + -(
        -largest_parameter(cfg.model, layout.tp) // shards
    )
    return 4 * min(part, sub_group)


def memory_parts(cfg: RunConfig, layout: Layout, device: Device, engine: bool = True) -> dict[str, int]:
    """Each rank's memory at its peak, by part, and ``total``: the largest of four moments, the last micro
    batch's loss (every activation kept, the loss's chunk of logits), the last block's backward (its
    transients, and the buffers the backward allocates), the backward's end (every gradient) and ZeRO-3's
    optimizer step (its flat fp32 gradients). On a CPU the checkpointer's host copies count too (on a GPU they
    are the host's: :func:`peaks`)."""
    held, in_backward, step_grads = state_parts(cfg, layout, engine, host=device.kind == "cpu")
    acts = activation_parts(cfg, layout, device.kind)
    # the head's fp32 weight gradient, which the fused loss computes in the forward
    head_grad = cfg.model.vocab_size * cfg.model.d_model * 4
    buffers = sum(in_backward.values())
    if cfg.optim.name == "muon" and engine:  # (the optimizer's step, right after the backward's end)
        buffers += muon_step_bytes(cfg, layout, device.kind)
    loss = acts["activations"] + acts["loss_chunk"] + head_grad
    backward = buffers + acts["activations"] + acts["recomputed"] + acts["attention_transients"] + head_grad
    step = zero3_step_bytes(cfg, layout) if engine else 0
    parts = dict(held)
    parts["checkpoint_staging"] = checkpoint_staging_bytes(cfg, layout) if engine and device.kind == "cpu" else 0
    if step > max(loss, backward, buffers + step_grads):  # the peak: the optimizer's step
        parts["gradients"] += step
    elif buffers + step_grads > max(loss, backward):  # the peak: the backward's end
        parts["gradients"] += step_grads
        parts["communication_buffers"] += buffers
    elif loss >= backward:  # the peak: the loss
        parts |= {"activations": acts["activations"], "loss_chunk": acts["loss_chunk"]}
        parts["gradients"] += head_grad
    else:  # the peak: the last block's backward
        parts["activations"] = acts["activations"] + acts["recomputed"]
        parts["attention_transients"] = acts["attention_transients"]
        parts["gradients"] += head_grad
        parts["communication_buffers"] += buffers
    parts["overheads"] = int(device.reserved_gib * GIB)
    parts["total"] = sum(parts.values())
    return parts


# ------------------------------------------------------------------------------------------------ start

START_PHASES = ("construction", "engine_start", "loading")


@dataclass(frozen=True)
class Peak:
    """Bytes a rank holds at a moment, on its device and in its host's memory (one pool on a CPU)."""

    device: int
    host: int

    def on(self, device: Device) -> int:
        """What the moment needs of the memory the planner compares with ``device.memory_gib``."""
        return self.device + self.host if device.kind == "cpu" else self.device


def largest_layer(m: ModelConfig, tp: int) -> int:
    """Elements of the largest module sharded construction holds whole while it initialises it: a block (its
    parameters after tensor parallelism) or a parameter outside the blocks (the embedding table, the head)."""
    from megatransformer.flops import one_block_per_stack
    from megatransformer.model.tp_plan import partition_dim

    model, _ = one_block_per_stack(m)
    blocks: dict[str, int] = {}
    outside = 0
    for name, p in model.named_parameters():
        size = -(-p.numel() // tp) if partition_dim(name) is not None else p.numel()
        if ".layers.0." in name:
            stack = name.split(".layers.0.")[0]
            blocks[stack] = blocks.get(stack, 0) + size
        else:
            outside = max(outside, size)
    return max([outside, *blocks.values()])


def offloaded_bytes(cfg: RunConfig, layout: Layout, device: Device) -> int:
    """Bytes an offloaded optimizer keeps in a GPU rank's host memory (fp32 masters, their gradients, Adam's
    moments, the staging copies): what the device's figure leaves out. On a CPU they are in the device's."""
    if not layout.offload or device.kind == "cpu":
        return 0
    on_host, _, _ = state_parts(cfg, layout, engine=True, host=True)
    on_device, _, _ = state_parts(cfg, layout, engine=True, host=False)
    return sum(on_host.values()) - sum(on_device.values())


def start_peaks(cfg: RunConfig, layout: Layout, device: Device) -> dict[str, Peak]:
    """Each rank's peak, device and host, at each moment before its steady steps (docs/planner.md): building the
    model (sharded: its partition, or the whole model in the run's dtype below ZeRO-3, plus the largest module
    whole in fp32 while it is initialised), DeepSpeed's engine start (the states exist; ZeRO-1/2 flatten the
    weights into a copy beside them; ZeRO-3 steps a zero gradient of its largest sub-group) and loading a
    checkpoint (one tensor at a time through the host)."""
    m, w = cfg.model, BYTES[cfg.precision]
    split, whole = parameter_counts(m)
    params = split // layout.tp + whole
    shards = layout.dp * layout.sp if layout.zero > 0 else 1
    weights = w * (-(-params // shards) if layout.zero == 3 else params)
    held, _, _ = state_parts(cfg, layout, engine=True, host=device.kind == "cpu")
    states = sum(held.values())
    reserved = int(device.reserved_gib * GIB)
    host = offloaded_bytes(cfg, layout, device)
    # ZeRO-1/2 and the bf16 optimizer copy the weights into one flat buffer per group: the bf16 optimizer on the
    # device, beside them; ZeRO-1/2 there only where it has the room, else the weights go through the host
    engine_start, flattening = Peak(reserved + states, host), 0
    if layout.zero == 1 and cfg.precision != "fp32" and not layout.offload:
        engine_start = Peak(max(engine_start.device, reserved + 2 * w * params), host)
    elif layout.zero in (1, 2) and device.kind != "cpu" and engine_start.device + w * params > device.memory_gib * GIB:
        flattening = 2 * w * params
    elif layout.zero == 3 and not layout.offload:
        # ZeRO-3's optimizer starts by stepping a zero fp32 gradient as long as its largest sub-group's parameters
        # whole, not their partition (``initialize_optimizer_states`` sizes it by ``ds_numel``)
        sub_group = shards * zero3_sizes(m, layout.tp, shards).sub_group + largest_parameter(m, layout.tp)
        engine_start = Peak(engine_start.device + 4 * min(params, sub_group), host)
    largest = 4 * largest_parameter(m, layout.tp)
    return {
        "construction": Peak(reserved + weights + 4 * largest_layer(m, layout.tp), 0),
        "engine_start": Peak(engine_start.device, engine_start.host + flattening),
        "loading": Peak(reserved + states + (w * largest // 4 if device.kind != "cpu" else 0), host + largest),
    }


# ------------------------------------------------------------------------------------------------ time


def cpu_device(ranks: int = 1) -> Device:
    """This machine's CPU as the device of ``ranks`` ranks: its memory shared among them."""
    import os

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return Device("CPU", memory / ranks, 0.0, 10.0, 10.0, kind="cpu", reserved_gib=0.0, host_gib=memory / ranks)


# ------------------------------------------------------------------------------------------------ time

PCIE_GBPS = 25.0  # host <-> device per GPU (PCIe 4 x16 in practice), for an offloaded optimizer's traffic
ZERO3_GATHER_EXPOSED = 0.5  # the share of ZeRO-3's parameter gathers its prefetching does not hide


def step_seconds(cfg: RunConfig, layout: Layout, device: Device, gpus_per_node: int, flops_per_token: float) -> float:
    """One optimizer step: the rank's FLOPs over the device's peak at a stated efficiency (``MFU``, on a CPU
    ``CPU_STEP_EFFICIENCY`` of its measured GEMM speed), plus the collectives that do not overlap (all of the
    gradient reduction, ZeRO-3's unhidden gathers, tensor parallelism's all-reduces and Ulysses' all-to-alls)
    at the link bandwidths, plus an offloaded optimizer's host work."""
    m, w = cfg.model, BYTES[cfg.precision]
    tokens = layout.micro_batch * layout.accum * cfg.data.seq_len
    flops = flops_per_token * tokens / (layout.tp * layout.sp)
    mlp_share = ffn_params(m) * 6 / max(flops_per_token, 1.0)  # the MLPs' part of the FLOPs per token
    full_checkpointing = layout.activation_checkpointing is True
    if full_checkpointing:
        flops *= 4 / 3  # one more forward (selective: the products are kept, what runs again is memory-bound)
    if layout.mlp_tiles > 1:
        flops *= 1 + mlp_share / 3 * (2 if full_checkpointing else 1)  # one more MLP forward each
    if device.kind == "cpu":
        rate = device.peak_tflops * 1e12 * CPU_STEP_EFFICIENCY
    else:
        rate = device.peak_tflops * 1e12 * MFU * (0.5 if cfg.precision == "fp32" else 1.0)  # fp32: TF32
    seconds = flops / rate + layout.accum * MICRO_STEP_SECONDS[device.kind] * len_layers(m)
    world = layout.dp * layout.tp * layout.sp
    if cfg.optim.name == "muon":  # the busiest rank's Newton-Schulz iterations (whole matrices or team members' parts)
        work, _, _ = muon_owner_work(m, world)
        ns_rate = rate * (0.5 if cfg.optim.muon_ns_dtype == "fp32" and device.kind != "cpu" else 1.0)
        seconds += cfg.optim.muon_ns_steps * work / ns_rate
    nodes = -(-world // gpus_per_node)
    inner = device.intra_node_gbps * 1e9
    outer = (device.inter_node_gbps if nodes > 1 else device.intra_node_gbps) * 1e9
    split, whole = parameter_counts(m)
    params = split // layout.tp + whole
    shards = layout.dp * layout.sp
    if shards > 1:  # gradients reduced in fp32 (communication_data_type), params gathered in the model's dtype
        ring = (shards - 1) / shards
        volume = 2 * ring * 4 * params if layout.zero < 3 else ring * 4 * params
        if layout.zero in (1, 2):
            volume = ring * 4 * params + ring * w * params  # reduce-scatter, then all-gather of updated weights
        if cfg.optim.name == "muon":  # each matrix's update to its owner and back, in fp32 (optimizers/muon.py)
            spread = (world - 1) / world
            held = muon_elements(m, layout.tp) / (shards if layout.zero else 1)
            volume += 4 * held * spread * (2 if layout.zero else 1)
        seconds += volume / (outer if layout.dp > 1 else inner)
        if layout.zero == 3:
            seconds += ZERO3_GATHER_EXPOSED * 2 * ring * w * params * layout.accum / outer
    local = layout.micro_batch * cfg.data.seq_len // layout.sp
    sublayers = m.n_layers * 2 + (m.decoder_layers * 3 if m.arch == "encoder_decoder" else 0)
    attentions = m.n_layers + (m.decoder_layers * 2 if m.arch == "encoder_decoder" else 0)
    if layout.tp > 1:  # forward and backward all-reduce of each sub-layer's output
        ring = 2 * (layout.tp - 1) / layout.tp
        seconds += layout.accum * sublayers * 2 * ring * local * m.d_model * w / inner
    if layout.sp > 1:  # q, k, v and the output there and back, forward and backward
        ring = (layout.sp - 1) / layout.sp
        values = 2 * m.d_model + 2 * max(m.kv_heads, layout.sp) * m.head_dim
        seconds += layout.accum * attentions * 2 * ring * local * values * w / inner
    if layout.offload:
        part = params / shards
        seconds += part * (4 + w) / (PCIE_GBPS * 1e9) + part * 16 / (HOST_ADAM_GBPS * 1e9)
    return seconds


def len_layers(m: ModelConfig) -> int:
    return m.n_layers + (m.decoder_layers if m.arch == "encoder_decoder" else 0)


def ffn_params(m: ModelConfig) -> int:
    layers = m.n_layers + (m.decoder_layers if m.arch == "encoder_decoder" else 0)
    return layers * (3 if m.ffn == "swiglu" else 2) * m.d_model * m.d_ff


# ------------------------------------------------------------------------------------------- choosing


def peaks(cfg: RunConfig, layout: Layout, device: Device, memory: dict[str, int]) -> dict[str, Peak]:
    """The start's peaks (:func:`start_peaks`) and the steady step's (``memory``; in a GPU's host, an offloaded
    optimizer's states and the checkpointer's copies), by moment."""
    host = offloaded_bytes(cfg, layout, device)
    if device.kind != "cpu":
        host += checkpoint_staging_bytes(cfg, layout)
    return start_peaks(cfg, layout, device) | {"step": Peak(memory["total"], host)}


# How far a CPU rank's resident memory outgrows the step's planned peak at ZeRO-3 under ``train.host_memory=keep``:
# glibc's heap keeps the holes that gathers and reductions of every size leave, and they grew over the measured
# steps (1.30-1.55x after 2-16 steps on 4 ranks, 1.3-1.7x after 2 on 8; BENCHMARKS.md 5ak, 5ai). Under ``release``
# the peak holds to the plan (0.88x). A measured bound, not a model: it is said, never used to refuse.
KEEP_HEAP_GROWTH_ZERO3 = 1.6


def keep_heap_growth(cfg: RunConfig, layout: Layout, device: Device) -> float:
    """The factor :data:`KEEP_HEAP_GROWTH_ZERO3` where it applies (a CPU's ZeRO-3 step under ``keep``), else 1."""
    applies = device.kind == "cpu" and layout.zero == 3 and cfg.train.host_memory == "keep"
    return KEEP_HEAP_GROWTH_ZERO3 if applies else 1.0


def overflow(moments: dict[str, Peak], device: Device) -> tuple[str, str, int, float] | None:
    """The first moment that does not fit ``device``: (moment, "device" or "host", bytes needed, GiB there), or
    None. On a CPU the device's memory is the host's, and both count against it."""
    for moment, peak in moments.items():
        if peak.on(device) > device.memory_gib * GIB:
            return moment, "host" if device.kind == "cpu" else "device", peak.on(device), device.memory_gib
        if device.kind != "cpu" and peak.host > device.host_gib * GIB:
            return moment, "host", peak.host, device.host_gib
    return None


@dataclass(frozen=True)
class Planned:
    layout: Layout
    memory: dict[str, int]  # the steady step's peak, by part
    peaks: dict[str, Peak]  # each moment's, the start's and the step's
    need: int  # the largest of them on the device (on a CPU: device and host)
    step_seconds: float
    fits: bool

    @property
    def start_bytes(self) -> int:
        """The largest device peak of the start (construction, engine start, loading)."""
        return max(self.peaks[moment].device for moment in START_PHASES)

    @property
    def host_bytes(self) -> int:
        return max(peak.host for peak in self.peaks.values())

    def as_dict(self) -> dict:
        return {
            **asdict(self.layout),
            "memory_bytes": self.memory,
            "peak_bytes": {moment: asdict(peak) for moment, peak in self.peaks.items()},
            "need_bytes": self.need,
            "step_seconds": self.step_seconds,
            "fits": self.fits,
            "describe": self.layout.describe(),
        }


@dataclass
class Plan:
    device: Device
    world: int
    layouts: list[Planned]  # ranked: what fits, fastest first, then the rest, smallest first
    skipped: list[tuple[str, str]]  # (layout, why it cannot exist)
    current: int | None
    global_batch: int

    def why(self) -> str:
        """One line on the first choice: why it wins, or what would fit when nothing does."""
        memory = f"{self.device.memory_gib:.1f} GiB"
        if self.device.kind != "cpu":
            memory += f" per device and {self.device.host_gib:,.0f} GiB of host memory per rank"
        fitting = [p for p in self.layouts if p.fits]
        if not fitting:
            smallest = min(self.layouts, key=lambda p: p.need)
            return (
                f"nothing fits in {memory}: the smallest need is {smallest.need / GIB:.1f} "
                f"GiB ({smallest.layout.describe()})"
            )
        best = fitting[0]
        line = f"{best.layout.describe()} wins: the fastest of {len(fitting)} layouts that fit in {memory}"
        if len(fitting) > 1:
            line += (
                f" (next: {fitting[1].layout.describe()}, {fitting[1].step_seconds / best.step_seconds - 1:.0%} slower)"
            )
        faster = [p for p in self.layouts if not p.fits and p.step_seconds < best.step_seconds]
        if faster:
            quickest = min(faster, key=lambda p: p.step_seconds)
            line += (
                f"; {len(faster)} faster ones do not fit (the fastest, {quickest.layout.describe()}, needs "
                f"{quickest.need / GIB:.1f} GiB)"
            )
        return line

    def as_dict(self, top: int | None = None) -> dict:
        shown = self.shown(top)
        return {
            "device": asdict(self.device),
            "world_size": self.world,
            "global_batch": self.global_batch,
            "layouts": [self.layouts[i].as_dict() for i in shown],
            "current": shown.index(self.current) if self.current is not None else None,
            "why": self.why(),
            "skipped": [{"layout": name, "reason": reason} for name, reason in self.skipped],
        }

    def shown(self, top: int | None) -> list[int]:
        """Indices of the first ``top`` layouts (all: None), and the config's own after them if it is not
        among them."""
        shown = list(range(len(self.layouts) if top is None else min(top, len(self.layouts))))
        if self.current is not None and self.current not in shown:
            shown.append(self.current)
        return shown


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def plan(
    cfg: RunConfig, device: Device, world: int, gpus_per_node: int, current: Layout | None, global_batch: int
) -> Plan:
    """Every layout of ``world`` ranks for the config's model and data shape that can exist (the others in
    ``skipped``, with the reason), with its memory and step time, ranked; ``current``: the config's own."""
    from megatransformer.config import ConfigError, validate
    from megatransformer.flops import model_size

    flops_per_token = model_size(cfg.model, cfg.data.seq_len).flops_per_token
    skipped: list[tuple[str, str]] = []
    layouts: list[Layout] = []
    tiles = sorted({1, 4, cfg.model.mlp_tiles})
    for tp, sp in itertools.product(divisors(world), divisors(world)):
        if world % (tp * sp):
            continue
        name = " x ".join([f"dp{world // (tp * sp)}"] + [f"{k}{d}" for k, d in (("tp", tp), ("sp", sp)) if d > 1])
        if tp * sp > gpus_per_node:
            skipped.append((name, f"tp x sp = {tp * sp} spans more than the {gpus_per_node} devices of a node"))
            continue
        dp = world // (tp * sp)
        if global_batch % dp:
            skipped.append((name, f"the global batch of {global_batch} rows does not divide over dp={dp}"))
            continue
        for tile in tiles:
            try:
                validate(
                    cfg.model_dump()
                    | {
                        "model": cfg.model.model_dump() | {"mlp_tiles": tile},
                        "parallel": cfg.parallel.model_dump() | {"tensor_parallel": tp, "sequence_parallel": sp},
                    }
                )
            except ConfigError as err:
                skipped.append((f"{name}, tiles {tile}", str(err)))
                continue
            per_rank = global_batch // dp
            for zero, ckpt, offload, micro in itertools.product(
                range(4), (False, "selective", True), (False, True), divisors(per_rank)
            ):
                if zero and dp * sp == 1 and not offload and cfg.precision == "fp32":
                    continue  # ZeRO over one rank partitions nothing: the engine runs stage 0
                if offload and zero == 0:
                    continue
                if offload and cfg.optim.name == "muon":
                    continue  # (training/engine/train_module.py check_muon_layout)
                layouts.append(Layout(dp, tp, sp, zero, ckpt, tile, offload, micro, per_rank // micro))
    if current is not None and current not in layouts:
        layouts.append(current)
    planned = []
    for layout in layouts:
        memory = memory_parts(cfg, layout, device)
        moments = peaks(cfg, layout, device, memory)
        seconds = step_seconds(cfg, layout, device, gpus_per_node, flops_per_token)
        need = max(peak.on(device) for peak in moments.values())
        planned.append(Planned(layout, memory, moments, need, seconds, overflow(moments, device) is None))
    planned.sort(key=lambda p: (not p.fits, p.step_seconds if p.fits else p.need, p.need))
    index = next((i for i, p in enumerate(planned) if p.layout == current), None)
    return Plan(device, world, planned, skipped, index, global_batch)
