"""The schema: one dataclass per recipe section; each field is one YAML key, the docstring under it its meaning."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from effpretrain.config.types import (
    ATTN_MLP_TARGETS,
    AUTO_OR_BOOL,
    BOOL_AS_INT,
    CHECKPOINTING,
    Basis,
    Beta,
    FactorKind,
    Fraction,
    MethodName,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Precision,
    Preset,
    ProjType,
    Seed,
)

# The schema.


@dataclass
class ModelConfig:
    """Which model to build: a preset (effpretrain.models.PRESETS) or an HF config of the LLaMA
    family (docs/models.md)."""

    preset: Preset = "tiny"
    """The model's shape (layers, width, heads); not read when `model.config` is set."""
    config: str = ""
    """A HuggingFace config of a LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or
    Qwen3ForCausalLM: a config.json file, its folder, or a hub id (where the network is
    reachable); the model is built from it as it is, freshly initialised. Its vocab_size must equal
    the tokenizer's. Empty: `model.preset`."""
    init: str = ""
    """Continued pretraining: a model folder (config.json and safetensors weights, one file or
    sharded with an index) or a hub id; the run trains that model from its weights
    (docs/continue.md). Implies its config (leave `model.config` empty). Empty: a fresh model."""
    max_position_embeddings: NonNegativeInt = 0
    """Positions the model supports; 0: `data.seq_len`."""


@dataclass
class FactorConfig:
    """Model surgery: replace attention/MLP linears by factorized layers (docs/methods.md)."""

    kind: FactorKind = "none"
    """Factorization of the target linears; `none` trains the dense model."""
    rank: PositiveInt = 128
    """Rank r of the factor pairs B A."""
    alpha: PositiveFloat = 32.0
    """Scale numerator: the factor product is multiplied by alpha / r."""
    targets: list[str] = field(default_factory=lambda: list(ATTN_MLP_TARGETS))
    """Names of the linear modules to factorize."""
    density: Fraction = 0.03
    """SLTrain: fraction delta of each weight's entries in the fixed random sparse support."""
    seed: Seed = 0
    """Seed of the factor initialisation and of SLTrain's sparse support."""
    warm_start_steps: NonNegativeInt = 0
    """Full-rank warm start of N steps before the factors train, for kinds whose registry row
    warm-starts (`relora`); 0: off. Steps 1..N train every W0 (a plain group, the run's optimizer
    settings) with B = 0 and A frozen; after step N, W0 is frozen (its optimizer state freed), B and
    A train from fresh state, the LR re-ramps over `restarts.recovery_steps` as after a merge, and
    merges follow steps N + k `restarts.every`. The LR schedule is the run's, over all steps."""


@dataclass
class OptimConfig:
    """The optimizer and its hyper-parameters; projection keys apply to projected methods only."""

    name: MethodName = "adamw"
    """The optimizer."""
    lr: PositiveFloat = 1e-3
    """Peak learning rate."""
    weight_decay: NonNegativeFloat = 0.0
    """Decoupled (AdamW) weight decay; never applied to vectors (norms, biases)."""
    beta1: Beta = 0.9
    """Adam's first-moment decay."""
    beta2: Beta = 0.999
    """Adam's second-moment decay."""
    eps: PositiveFloat | None = None
    """Adam's denominator epsilon; `null`: the method's reference value (the class default: 1e-8
    for AdamW, Stable-SPAM and 8-bit GaLore, 1e-6 for GaLore, Fira, APOLLO and SPAM)."""
    rank: PositiveInt = 128
    """Projected methods: rank r of the projection."""
    update_proj_gap: PositiveInt = 200
    """Projected methods: steps T between basis refreshes."""
    scale: PositiveFloat = 0.25
    """Projected methods: scale alpha of the projected update (Fira's alpha)."""
    proj_type: ProjType = "std"
    """Projected methods: which side of each matrix is projected (GaLore's proj_type)."""
    basis: Basis = "default"
    """Projected methods: how the basis is computed; `default`: the method's own choice."""
    targets: list[str] = field(default_factory=lambda: list(ATTN_MLP_TARGETS))
    """Projected methods: names of the linear modules whose weights are projected."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Method-specific constructor keywords (e.g. `{gamma1: 0.85}`) and basis options
    (`oversample`, `power_iters`, `seed`); a keyword that an `optim` key sets (lr, eps, rank, ...)
    is refused here."""


@dataclass
class DataConfig:
    """Where tokens come from (builtin | files | hub | tokens) and how they become batches."""

    source: Literal["builtin", "files", "hub", "tokens"] = "builtin"
    """`builtin`: standard-library sources, no download; `files`: local shards `data.path`,
    streamed; `hub`: a streamed HF dataset `data.name`; `tokens`: shards written by
    `effpretrain prepare` in `data.path`. Streamed sources read per rank: their batches depend on
    the number of processes (README: Data)."""
    path: str = ""
    """`files`: a .txt / .jsonl / .jsonl.gz (.json.gz) / .parquet file, a folder of them, or a glob
    pattern (e.g. `c4/en/c4-train.*.json.gz`); `tokens`: the folder `effpretrain prepare` wrote
    (its `--out`)."""
    val_path: str = ""
    """`files`: the held-out shards (file, folder or glob, e.g. C4's `c4-validation.*.json.gz`);
    empty: one in `data.val_every` documents of `data.path` is held out."""
    name: str = ""
    """`hub`: dataset name, e.g. `allenai/c4`."""
    config: str = ""
    """`hub`: dataset config, e.g. `en`."""
    split: str = "train"
    """`hub`: the training split."""
    val_split: str = ""
    """`hub`: the held-out split (e.g. `validation`); empty: held out from `data.split`."""
    text_field: str = "text"
    """`files` (.jsonl, .parquet) and `hub`: the field holding each document's text."""
    tokenizer: str = "auto"
    """`builtin-bpe` (trained on the corpus) or any HF tokenizer name or path, e.g. `t5-base`.
    `auto`: `model.init`'s own tokenizer (its folder's, or its hub id's) when `model.init` is set,
    else `builtin-bpe`; a run's resolved config names the one it used."""
    vocab_size: PositiveInt = 8192
    """`builtin-bpe` only: the vocabulary size."""
    seq_len: PositiveInt = 128
    """Tokens per sequence."""
    mode: Literal["pack", "truncate"] = "pack"
    """`pack`: documents concatenated with EOS; `truncate`: one document per row, padded (the
    paper's)."""
    val_every: PositiveInt = 50
    """One in N documents is held out: `builtin` every Nth; `files` without `data.val_path` and
    `hub` without `data.val_split` those whose text hash is 0 mod N (the same for any shard order,
    seed or number of processes)."""
    shuffle_seed: Seed = 0
    """Seed of the document order (`builtin`'s permutation; the shard order and document buffer
    of `files` and `hub`) and of the row draws from the shuffle buffer. Paper recipes: 42, the
    benchmark's."""
    doc_buffer: NonNegativeInt = 1000
    """`files`, `hub`: documents in the seeded shuffle buffer each rank reads through (1000:
    `datasets`' `shuffle` default, which the benchmark uses); 0: shard order."""
    prefetch: NonNegativeInt = 8
    """`files`, `hub`: chunks of 32 documents read and tokenised ahead on a background thread,
    off the training thread (the batches are bitwise the same); 0: on the training thread."""
    bpe_sample_mb: PositiveInt = 64
    """`files` with `data.tokenizer=builtin-bpe`: the BPE trains on the first this many MB of
    training text (sorted shard order), not on the whole corpus."""
    shuffle_buffer: NonNegativeInt = 4096
    """Rows in the shuffle buffer that training rows are drawn from at random, so that a batch
    mixes documents (README: Training); 0: rows in document order, consecutive rows of one document."""


@dataclass
class TrainConfig:
    """The loop: budget, batch, schedule, evaluation, checkpoints, precision."""

    max_steps: PositiveInt = 300
    """Optimizer steps of the run."""
    batch_size: PositiveInt = 16
    """Sequences per process per micro-step."""
    grad_accum: PositiveInt = 1
    """Micro-steps per optimizer step."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Learning-rate decay after the warmup."""
    warmup_ratio: Fraction = 0.1
    """Fraction of `train.max_steps` spent in the linear warmup."""
    min_lr_ratio: Fraction = 0.1
    """Final learning rate as a fraction of `optim.lr`."""
    grad_clip: NonNegativeFloat = 1.0
    """Global gradient-norm clipping threshold; 0 disables. With `train.update_in_backward` the
    coefficient comes from the previous step's global norm (the first step is not clipped)."""
    update_in_backward: bool = False
    """Update each parameter inside backward as soon as its gradient is final, and free the
    gradient at once (`effpretrain.in_backward`): gradient memory falls from every gradient to the
    accumulators (low rank for GaLore's matrices between refreshes, with `train.grad_clip` 0)
    plus the gradients in flight. Clipping then uses the previous step's norm (README: Updates in
    backward)."""
    in_backward_refresh: Literal["accumulated", "first_micro"] = "accumulated"
    """With `train.update_in_backward` and `train.grad_accum` > 1, where a projected matrix's basis
    refresh takes its gradient: `accumulated` (GaLore's rule: the step's summed gradient, so every
    refreshing matrix holds a full accumulator during that step) or `first_micro` (the first
    micro-batch's gradient, refreshed in its hook: the accumulators stay low rank at a refresh
    step too, the basis is that of one micro-batch's gradient). `first_micro` needs
    `train.grad_clip` 0 and one process or DDP (docs/memory.md)."""
    loss: Literal["standard", "chunked", "chunked_recompute"] = "chunked"
    """How the cross-entropy over the LM head is computed (same value and gradients):
    `standard` forms the (tokens x vocabulary) logits; `chunked` and `chunked_recompute`
    (`effpretrain.loss`) take the final hidden states `train.loss_chunk_tokens` rows at a time and
    never hold them. `chunked` computes each chunk's gradients in the forward and holds dH
    (tokens x hidden, fp32) and dW (vocabulary x hidden, fp32) until the backward: three head
    products, as `standard`. `chunked_recompute` holds one fp32 logsumexp per token instead and
    recomputes each chunk's logits in the backward (a fourth head product). At 8,192 tokens x
    32,000 x hidden 256 in fp32 the loss's own peak falls from 3.15 GB to 0.17 GB with either
    (94.5%); between forward and backward `chunked` holds 41 MB, `chunked_recompute` 33 kB. A
    llama_20m fp32 run measured 1.03x (`chunked`) and 0.84x (`chunked_recompute`) the standard
    loss's tokens/s on this project's CPU (benchmarks/results/chunked_loss.json), so `chunked` is
    the default."""
    loss_chunk_tokens: PositiveInt = 1024
    """Rows per chunk of the chunked losses (their transient is about 4 x this x vocabulary bytes)."""
    eval_every: NonNegativeInt = 50
    """Steps between evaluations (exact token-weighted validation loss and perplexity); 0: only at
    the end."""
    eval_tokens: PositiveInt = 16384
    """Validation set size in target tokens: the held-out sequences in their fixed order, up to and
    including the one at which the count reaches this number; the same set for any number of
    processes (README: Evaluation). Paper recipes: 10000000, the benchmark's."""
    save_every: NonNegativeInt = 0
    """Steps between checkpoints; 0: only the final checkpoint."""
    keep_checkpoints: PositiveInt = 2
    """Newest complete checkpoints kept."""
    log_every: PositiveInt = 10
    """Steps between `metrics.jsonl` records."""
    seed: Seed = 0
    """Seed of the model initialisation and the run's random state."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the run trains: `auto` (CUDA where it starts, else the CPU, with a one-line warning
    when an NVIDIA driver is loaded but CUDA does not start), `cuda` (an error, exit 2, where CUDA
    does not start) or `cpu`. The device is printed at start (`effpretrain.devices`)."""
    deterministic: bool = False
    """Deterministic kernels for the run (`effpretrain.determinism`): `torch.use_deterministic_algorithms`,
    `CUBLAS_WORKSPACE_CONFIG=:4096:8` (set before CUDA starts), cuDNN's deterministic algorithms
    without autotuning; restored when the run ends. Needed on CUDA for the bitwise claims (exact
    resume, DDP = one process, compiled split = straight), which hold on CPU without it. Costs
    speed on CUDA, and an op without a deterministic kernel raises (docs/gpu.md)."""
    precision: Precision = "fp32"
    """`fp32`; `bf16-mixed` (fp32 weights and states, bf16 autocast); `bf16-pure` (bf16 weights,
    gradients and states: the paper's)."""
    weight_quant: Literal["none", "int8"] = "none"
    """`int8`: the target linear weights (`optim.targets` that stay plain linear layers: attention
    and MLP projections) are stored as int8 codes with one fp32 scale per `weight_quant_group`
    columns of a row, dequantized for each matmul (in fp32, or bf16 with `bf16-pure`), every update
    rounded into them once through the one writer (`optimizers.writer`), stochastically unless
    `stochastic_rounding: false`. Embedding, head and norms stay in `precision`. Bytes per m x n
    weight: m n + 4 m ceil(n / group) (`effpretrain.models.quantize`)."""
    weight_quant_group: PositiveInt = 128
    """Columns per INT8 scale group (`weight_quant: int8`)."""
    weight_quant_embeddings: bool = False
    """With `weight_quant: int8`, the input embedding and the head too (a lookup dequantizes only
    the rows it reads); by default they stay in `precision`."""
    stochastic_rounding: Annotated[bool | str, AUTO_OR_BOOL] = "auto"
    """How an update is rounded into a weight stored in fewer bits than fp32 (INT8 codes, or bf16
    weights with `bf16-pure`): `true`, unbiased stochastic rounding with counter-based noise (keyed
    by seed, parameter, step and element: the same in every launch mode and on every device);
    `false`, to nearest (once per step); `auto`: on for `weight_quant: int8`, off otherwise."""
    tf32: bool = False
    """Let the model's float32 matrix products (and cuDNN's) run in TF32 on a GPU that has it (set
    for the run, restored after; `false` runs them at full fp32 even where the process enabled
    TF32). Only fp32 products change: it matters for `train.precision` fp32 (and bf16-mixed's fp32
    parts). The optimizers' projection, orthogonalisation, whitening and refactorization math
    runs at full fp32 either way (`optimizers.precision.full_fp32`). MFU then divides by the TF32
    peak (summary.json `peak_flops_dtype`)."""
    activation_checkpointing: Annotated[int | str, CHECKPOINTING, BOOL_AS_INT] = 0
    """0 (or false): off; k: checkpoint every k-th decoder layer (1 or true: all); `auto`: the
    fewest layers whose checkpointing brings the estimated peak within `train.memory_budget_gb`
    (README: Memory estimate)."""
    compile: bool = False
    """Compile each decoder block with `torch.compile` (regional: one compiled block serves every
    layer, so compile time stays one block's at any depth; `effpretrain.compile`). Composes with
    activation checkpointing, factorized layers, restarts, updates in backward, DDP and FSDP2;
    checkpoints are interchangeable with eager runs'. Compile time is reported apart
    (summary.json `compile_s`)."""
    peak_tflops: PositiveFloat | None = None
    """The device's peak dense TFLOP/s for the MFU figure (summary.json `mfu`), at the dtype the
    model's products run in (summary.json `peak_flops_dtype`: `bf16` for a bf16 run, `tf32` for
    fp32 with `train.tf32`, `fp32` for fp32 without); `null`: looked up by the CUDA device's name
    and that dtype (`effpretrain.flops.DEVICE_PEAKS`), none on CPU, an unknown device or a MIG
    slice (MFU is then null)."""
    memory_budget_gb: PositiveFloat | None = None
    """Per-rank memory budget (GB = 1e9 bytes) that `activation_checkpointing: auto` fits the
    estimated peak into."""
    memory_steps: list[PositiveInt] | None = None
    """Steps whose memory is measured by category (`effpretrain.memory.measure`; metrics.jsonl
    and summary.json `memory_measured`); `null`: steps 1 and 2 (the first with the optimizer
    state alive throughout), the first basis refresh after them (projected methods) and the first
    restart, with `train.compile` none before step 2 (steps 2 and 3: step 1 compiles, and on CUDA
    its peak holds the compiler's autotuning buffers); `[]`: none. Other steps run without hooks."""
    max_consecutive_skips: PositiveInt = 5
    """Non-finite steps in a row (skipped) before the run stops."""
    trackers: list[Literal["tensorboard", "wandb"]] = field(default_factory=list)
    """Experiment trackers (`pip install 'effpretrain[track]'`)."""
    plot: bool = True
    """Write `curves.png` at the end."""


@dataclass
class RestartsConfig:
    """Weight refactorization and momentum reset every `every` steps (the benchmark, Glentis et al. 2025)."""

    every: NonNegativeInt = 0
    """Steps between restarts (ReLoRA: merges); 0 disables."""
    refactorize: bool = True
    """Rebalance each low-rank factor pair at a restart (low-rank factorizations only)."""
    reset_momentum: bool = True
    """Zero the optimizer's moments at a restart."""
    recovery_steps: NonNegativeInt = 10
    """Steps over which the learning rate ramps back up after a restart."""


@dataclass
class DistConfig:
    """Data parallelism across processes (launch with accelerate launch or torchrun)."""

    sharding: Literal["ddp", "fsdp2"] = "ddp"
    """How several processes split the model: `ddp` (replicas) or `fsdp2` (sharded weights,
    gradients and states); unused in a single process."""
    whole_matrix: Literal["owner", "gather"] = "owner"
    """Under `fsdp2`, where a method's whole-matrix step (projection bases, 8-bit blocks) runs:
    `owner` (once per matrix, on one owner rank that alone holds its state: per-rank state ~1/N)
    or `gather` (every rank gathers every matrix, repeats the step and holds all of that state;
    the earlier behaviour, kept for comparison). Same numbers either way."""


@dataclass
class RunConfig:
    """Everything a run needs; `method` is a display name (defaults to the recipe's stem)."""

    method: str = ""
    """Display name for tables and run folders; empty: the recipe's file name (without a recipe:
    `optim.name`, or `factor.kind` when it factorizes)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The `model:` section."""
    factor: FactorConfig = field(default_factory=FactorConfig)
    """The `factor:` section."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The `optim:` section."""
    data: DataConfig = field(default_factory=DataConfig)
    """The `data:` section."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The `train:` section."""
    restarts: RestartsConfig = field(default_factory=RestartsConfig)
    """The `restarts:` section."""
    dist: DistConfig = field(default_factory=DistConfig)
    """The `dist:` section."""
