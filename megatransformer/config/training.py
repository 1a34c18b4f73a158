"""The sections of training: ``train`` (with its spikes, watchdog and evals), ``optim``, ``schedule``,
``checkpoint``, ``parallel``, ``wandb``."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from megatransformer.config.core import MAX_LR, MAX_STEPS, MIN_LR, Fraction, Section, UnitInterval, require


class SpikesConfig(Section):
    """Loss spikes (training/observability/spikes.py): a step whose loss or gradient norm is non-finite or far above the
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
        require(
            self.warmup <= self.window,
            f"train.spikes.warmup={self.warmup} exceeds train.spikes.window="
            f"{self.window}: the window never holds that many steps; lower warmup",
        )
        require(
            self.rollback_after <= self.within,
            f"train.spikes.rollback_after={self.rollback_after} spikes "
            f"cannot fall within train.spikes.within={self.within} steps; raise within or lower rollback_after",
        )
        return self


class WatchdogConfig(Section):
    """Hang diagnosis (training/observability/watchdog.py): a step that takes far longer than usual makes every
    rank write the Python stacks of all its threads to RUN_DIR/hangs/rank_NNNNN.txt, before
    parallel.timeout_minutes ends the run."""

    enabled: bool = True
    """Arm the watchdog around every step."""
    factor: Annotated[float, Field(gt=1)] = 20.0
    """A step longer than this many times the median of recent steps is taken for a hang..."""
    min_seconds: PositiveFloat = 60.0
    """...and longer than this (first steps, a loaded machine); at most 0.8 x parallel.timeout_minutes."""
    limit_seconds: PositiveFloat | None = None
    """A fixed limit per step instead of factor and min_seconds (also capped by the collective timeout)."""


class ProfileConfig(Section):
    """torch.profiler over a window of steps (training/observability/profiling.py): when the window closes each rank
    writes its operators by the time they took, per step, to RUN_DIR/profile/rank_NNNNN.txt (torch's table) and
    .json (the top rows, the step's wall time and, on a GPU, its kernels' time)."""

    start: NonNegativeInt = 0
    """The window's first step (0: no profile). Past the first steps: the first ones compile and warm up."""
    steps: Annotated[int, Field(ge=1, le=100)] = 3
    """Steps in the window (the profiler's own cost grows with them)."""


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
    """Micro batches per validation pass, in all, counted in the micro batch of one data-parallel rank
    (``micro_batch_size``, or ``global_batch_size / grad_accum``): the first ``eval_batches x`` that many rows of
    the validation split, dealt out to the data-parallel ranks, the same rows on any number of ranks
    (``eval_rows`` sets the rows directly)."""
    eval_rows: PositiveInt | None = None
    """Rows of the validation split per validation pass (unset: from ``eval_batches``). A resume on another
    layout sets it to the checkpoint's, so that the validation set stays the same (docs/checkpoints.md)."""
    compile: bool | None = None
    """torch.compile each Transformer block (training/engine/compiled.py); unset: on for CUDA runs, off on CPUs (where
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
    holds its peak host memory, and at ZeRO-3 on a CPU a step's gathers of many sizes leave it fragmented (up to
    1.55x the planned peak, and ``train`` says when that would not fit; BENCHMARKS.md 5ak). release: every block of
    128 KiB or more is mapped alone and goes back to the system when freed (ZeRO-3's CPU step 1.4-1.8x slower on an
    AVX2 machine, a ZeRO-0 step about 2x slower: BENCHMARKS.md 5as). Either applies from the first step on; the
    start (construction, engine start, loading) runs as release does."""
    cpu_bf16_matmul: Literal["auto", "fp32", "native"] = "auto"
    """How a bf16 run's matrix products run on a CPU. auto: PyTorch's bf16 kernels where it has them for this
    CPU (oneDNN: AVX-512, AMX, Arm BF16), else fp32 GEMMs of the bf16 operands, which give the same products
    and sums (a bf16 step on an AVX2-only CPU took 25x as long without them, BENCHMARKS.md 5g); fp32: always
    the latter; native: always PyTorch's bf16 kernels. Nothing changes on GPUs, in fp32 or with compile."""
    max_bad_steps: Annotated[int, Field(ge=1)] = 5
    """Consecutive non-finite losses after which the run checkpoints and stops."""
    max_dead_steps: NonNegativeInt = 20
    """Consecutive steps of a dead model after which the run checkpoints and stops (exit 3, as a diverged run):
    a gradient norm of 0, or, after schedule.warmup_steps, a loss within 1e-4 of ln(model.vocab_size) (the
    output is uniform: the model predicts nothing). 0: never stop for it."""
    spikes: SpikesConfig = Field(default_factory=SpikesConfig)
    """Loss spikes: skip the update, roll back and skip the data, stop (SpikesConfig)."""
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    """Hang diagnosis: every rank's stacks on file when a step overruns (WatchdogConfig)."""
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    """Where a step's time goes: torch.profiler over a window of steps (ProfileConfig)."""
    peak_tflops: PositiveFloat | None = None
    """Per-device peak TFLOP/s for the MFU estimate (default: the GPU's dense peak from
    training.metrics.GPU_PEAK_TFLOPS, e.g. 989 for H100 SXM bf16; another GPU's measured matmul peak; on a CPU
    none: MFU is logged only when this is set, a CPU's measured speed being too unsteady to divide by)."""
    sample_prompt: str | None = None
    """Text to continue with a short generated sample at the end of training (decoder models)."""
    plot: bool = True
    """Draw the run's curves into metrics.png at its end (what ``megatransformer plot RUN_DIR`` draws at any time
    from metrics.jsonl); false: metrics.jsonl only, without matplotlib's second or so at every end."""
    evals: EvalsConfig = Field(default_factory=EvalsConfig)
    """lm-evaluation-harness tasks during training (EvalsConfig)."""
    check_memory: bool = True
    """Before the first step, stop with one line when the planner's estimate of a rank's memory exceeds the
    device's (what overflows, by how much, the best layout that fits: ``megatransformer plan``)."""

    @model_validator(mode="after")
    def _profile_within_the_run(self) -> TrainConfig:
        start, steps = self.profile.start, self.profile.steps
        require(
            start == 0 or start + steps - 1 <= self.max_steps,
            f"train.profile.start={start} with train.profile.steps={steps} ends past train.max_steps="
            f"{self.max_steps}: start it at step {max(1, self.max_steps - steps + 1)} or earlier",
        )
        return self


class OptimConfig(Section):
    name: Literal["adamw", "adam", "muon"] = "adamw"
    """adamw: decoupled weight decay; adam: the 2017 paper's Adam (use weight_decay=0); muon: Muon (torch.optim.Muon's
    update) on the linear layers' weights, AdamW with the settings below on the rest (docs/optimizers.md)."""
    lr: Annotated[float, Field(ge=MIN_LR, le=MAX_LR)] = 3e-4
    """Peak learning rate (the multiplier of the inverse_sqrt schedule); with muon, AdamW's part."""
    betas: tuple[Fraction, Fraction] = (0.9, 0.95)
    """Adam beta1, beta2 (the 2017 paper: 0.9, 0.98)."""
    eps: PositiveFloat = 1e-8
    """Adam epsilon (the 2017 paper: 1e-9)."""
    weight_decay: NonNegativeFloat = 0.1
    """Weight decay coefficient."""
    decay_norms_and_embeddings: bool = False
    """Also decay norm weights, biases and embeddings (off: they are excluded, the common practice)."""
    muon_lr: Annotated[float, Field(ge=MIN_LR, le=MAX_LR)] = 0.02
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
    """wsd: the decay's shape, from the peak to min_lr_ratio (1-sqrt: 1 - sqrt(progress), Hägele et al. 2024's
    cooldown; OLMo-core 3.0.0's WSD decays linearly)."""
    decay_from: str | None = None
    """wsd: a checkpoint of a run's stable phase to branch a decay from: this run continues it (weights, optimizer,
    data) in its own run_dir and decays from the checkpoint's step to train.max_steps."""


class CheckpointConfig(Section):
    every: PositiveInt = 1000
    """Steps between checkpoints (a final one is written too, unless final=false)."""
    final: bool = True
    """Write a checkpoint when the run reaches train.max_steps; false: none then (benchmarks: bench/gpu_suite.py;
    a stop, a preemption or a divergence still saves one)."""
    every_minutes: Annotated[float, Field(gt=0)] | None = None
    """Also checkpoint once this many minutes of wall time have passed since the last checkpoint (or the start),
    whichever of the two comes first. The interval that wastes least is about sqrt(2 x save time x mean time
    between failures) (Young/Daly); the run log says each save's stall and write time."""
    keep: PositiveInt = 3
    """Most recent checkpoints kept (older ones are deleted)."""
    timeout_minutes: Annotated[float, Field(gt=0, le=7 * 24 * 60)] = 30.0
    """Longest wait of the background checkpoint writers for each other (their own gloo group, apart from
    parallel.timeout_minutes): the slowest rank's write of its shard, rank 0's manifest and removal of old
    checkpoints (slow on a network file system). Past it the save fails on every rank; a run ending with an
    error waits this long at most for the save in flight."""


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
