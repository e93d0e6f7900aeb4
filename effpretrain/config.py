"""The run configuration: dataclasses are the one schema, YAML recipes only fill them.

Each field is one YAML key (``section.key``); the docstring right under it says what the key
means, and its type says which values it takes: ``Literal[...]`` for a fixed set of choices,
``Annotated[..., Check]`` for a range, ``Annotated[str, OneOf]`` for a name in a registry
(`optimizers.METHODS`, `effpretrain.models.FACTOR_KINDS`, `effpretrain.models.PRESETS`), read when
validating, so a method registered at run time is a valid choice. README's config table is
generated from the same source (`config_table`).

Loading is strict: an unknown key, a value of the wrong type or out of range, a recipe that is
not a readable UTF-8 YAML mapping raise `ConfigError` naming the key and the file it came from.
Overrides use dotted keys, ``--set optim.lr=3e-4``, with values parsed as YAML.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml

import optimizers
from effpretrain.errors import ConfigError
from effpretrain.models import FACTOR_KINDS, PRESETS, factor_spec
from optimizers import projection

__all__ = [
    "ATTN_MLP_TARGETS",
    "PRECISIONS",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "FactorConfig",
    "ModelConfig",
    "OptimConfig",
    "RestartsConfig",
    "RunConfig",
    "TrainConfig",
    "apply_overrides",
    "config_hash",
    "config_table",
    "dump_yaml",
    "field_docs",
    "from_dict",
    "load_config",
    "to_dict",
    "validate",
]

ATTN_MLP_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ----------------------------------------------------------------------------------------------
# Constraints declared on field types, read generically by `validate` and `config_table`.


@dataclass(frozen=True)
class Check:
    """A range a numeric field must lie in: ``test(value)`` holds, else "must be {text}"."""

    text: str
    test: Callable[[Any], bool]


@dataclass(frozen=True)
class OneOf:
    """A name from a registry, read at validation time (registries may grow at run time).

    Attributes:
        names: returns the valid names now.
        where: the registry, as the config table states it.
        listed: the table also lists today's names (for presets; not for methods, whose list
            grows with every registered method and lives in the README's Methods table).
    """

    names: Callable[[], Sequence[str]]
    where: str
    listed: bool = False


#: Marks an int field that also takes YAML ``true``/``false`` as 1/0 (a switch with a count).
BOOL_AS_INT = "bool-as-int"

POSITIVE = Check("> 0", lambda v: v > 0)
NON_NEGATIVE = Check(">= 0", lambda v: v >= 0)
CHECKPOINTING = Check("(an int >= 0, or `auto`)", lambda v: v == "auto" or (isinstance(v, int) and v >= 0))
FRACTION = Check("in [0, 1]", lambda v: 0 <= v <= 1)
BETA = Check("in [0, 1)", lambda v: 0 <= v < 1)
# numpy's seed range: accelerate's set_seed seeds numpy too.
SEED = Check("in [0, 2**32)", lambda v: 0 <= v < 2**32)

PositiveInt = Annotated[int, POSITIVE]
PositiveFloat = Annotated[float, POSITIVE]
NonNegativeInt = Annotated[int, NON_NEGATIVE]
NonNegativeFloat = Annotated[float, NON_NEGATIVE]
Fraction = Annotated[float, FRACTION]
Beta = Annotated[float, BETA]
Seed = Annotated[int, SEED]
Precision = Literal["fp32", "bf16-mixed", "bf16-pure"]
#: The canonical precision names, shared by `train.precision` and the memory estimator.
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)


def _method_names() -> list[str]:
    return sorted(optimizers.METHODS)


def _factor_kinds() -> list[str]:

    return ["none", *FACTOR_KINDS]


def _presets() -> list[str]:

    return list(PRESETS)


def _proj_types() -> list[str]:
    return list(projection.PROJ_TYPES)


def _bases() -> list[str]:
    return ["default", *projection.METHODS]


ProjType = Annotated[str, OneOf(_proj_types, "a side of `optimizers.projection.PROJ_TYPES`", listed=True)]
Basis = Annotated[str, OneOf(_bases, "a basis of `optimizers.projection.METHODS`, or `default`", listed=True)]
MethodName = Annotated[str, OneOf(_method_names, "a name in `optimizers.METHODS` (see Methods)")]
FactorKind = Annotated[str, OneOf(_factor_kinds, "`none` or a name in `effpretrain.models.FACTOR_KINDS`")]
Preset = Annotated[str, OneOf(_presets, "a name in `effpretrain.models.PRESETS`", listed=True)]


# ----------------------------------------------------------------------------------------------
# The schema.


@dataclass
class ModelConfig:
    """Which LLaMA to build (see effpretrain.models.PRESETS)."""

    preset: Preset = "tiny"
    """The model's shape (layers, width, heads)."""
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
    tokenizer: str = "builtin-bpe"
    """`builtin-bpe` (trained on the corpus) or any HF tokenizer name or path, e.g. `t5-base`."""
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
    precision: Precision = "fp32"
    """`fp32`; `bf16-mixed` (fp32 weights and states, bf16 autocast); `bf16-pure` (bf16 weights,
    gradients and states: the paper's)."""
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
    """The device's peak dense bf16 TFLOP/s for the MFU figure (summary.json `mfu`); `null`: looked
    up by the CUDA device's name (`effpretrain.flops.DEVICE_PEAKS`), none on CPU or an unknown
    device (MFU is then null)."""
    memory_budget_gb: PositiveFloat | None = None
    """Per-rank memory budget (GB = 1e9 bytes) that `activation_checkpointing: auto` fits the
    estimated peak into."""
    memory_steps: list[PositiveInt] | None = None
    """Steps whose memory is measured by category (`effpretrain.memory.measure`; metrics.jsonl
    and summary.json `memory_measured`); `null`: steps 1 and 2 (the first with the optimizer
    state alive throughout), the first basis refresh after them (projected methods) and the first
    restart; `[]`: none. Other steps run without hooks."""
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


# ----------------------------------------------------------------------------------------------
# Validation: every leaf's declared constraints, then the rules that join several keys.


def _show(value: Any) -> str:
    """`repr` for an error message, shortened: a bad value may be a whole file's worth."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's str conversion limit
        return "<a number too large to print>"
    return text if len(text) <= 80 else text[:77] + "..."


def _not_one_of(source: str, key: str, value: Any, choices: Sequence[Any]) -> ConfigError:
    return ConfigError(f"{source}: {key}={_show(value)} is not one of {', '.join(map(str, choices))}")


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, Any, type, str]]:
    """(dotted key, value, type hint, owning dataclass, field name) of every non-section field,
    in declaration order."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value, hints[f.name], type(obj), f.name


def _check(key: str, value: Any, tp: Any, source: str) -> None:
    """Raises ConfigError if `value` breaks a constraint declared in `tp` (choices, ranges)."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        _check(key, value, base, source)
        for m in meta:
            if isinstance(m, OneOf) and value not in m.names():
                raise _not_one_of(source, key, value, m.names())
            if isinstance(m, Check):
                try:
                    ok = bool(m.test(value))
                except TypeError:  # a wrong type set in code, not through the loader
                    ok = False
                if not ok:
                    raise ConfigError(f"{source}: {key}={_show(value)} must be {m.text}")
    elif origin is Literal:
        if value not in typing.get_args(tp):
            raise _not_one_of(source, key, value, typing.get_args(tp))
    elif origin in (Union, types.UnionType):
        if value is not None:  # an optional field: its other member's constraints apply
            for arg in typing.get_args(tp):
                if arg is not type(None):
                    _check(key, value, arg, source)
    elif origin is list:
        (inner,) = typing.get_args(tp)
        for i, v in enumerate(value):
            _check(f"{key}[{i}]", v, inner, source)
    elif tp is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: {key}={_show(value)} must be a finite number")


#: Constructor keywords that a typed `optim` key sets: in `optim.extra` they would silently win
#: over that key (the recipe would say one value and the run use another).
_EXTRA_SHADOWS = {
    "lr": "optim.lr",
    "betas": "optim.beta1 and optim.beta2",
    "eps": "optim.eps",
    "weight_decay": "optim.weight_decay",
    "rank": "optim.rank",
    "update_proj_gap": "optim.update_proj_gap",
    "scale": "optim.scale",
    "proj_type": "optim.proj_type",
    "basis": "optim.basis",
}


def validate(cfg: RunConfig, source: str = "config") -> RunConfig:
    """Checks choices and ranges; raises ConfigError naming the key and `source`."""
    for key, value, tp, *_ in _leaves(cfg):
        _check(key, value, tp, source)
    shadowed = sorted(set(cfg.optim.extra) & set(_EXTRA_SHADOWS))
    if shadowed:
        k = shadowed[0]
        raise ConfigError(
            f"{source}: optim.extra.{k} would override {_EXTRA_SHADOWS[k]}; set that key instead"
        )
    if cfg.data.source == "files" and not cfg.data.path:
        raise ConfigError(f"{source}: data.path is required when data.source=files")
    for key, spec in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        pattern = any(c in spec for c in "*?[")  # a glob is matched when the data is opened
        if cfg.data.source == "files" and spec and not pattern and not Path(spec).expanduser().exists():
            raise ConfigError(f"{source}: {key} not found: {spec}")
    if cfg.data.source == "hub" and not cfg.data.name:
        raise ConfigError(f"{source}: data.name is required when data.source=hub")
    if cfg.train.activation_checkpointing == "auto" and cfg.train.memory_budget_gb is None:
        raise ConfigError(f"{source}: train.activation_checkpointing=auto needs train.memory_budget_gb")
    _check_method_needs(cfg, source)
    if cfg.restarts.every and cfg.restarts.refactorize and cfg.factor.kind != "none":
        spec = factor_spec(cfg.factor.kind)
        if not (spec.refactorizable or spec.merges_at_restart):
            raise ConfigError(
                f"{source}: restarts.refactorize=true but factor.kind={cfg.factor.kind} cannot be refactorized "
                "(B A is not its weight); set restarts.refactorize=false"
            )
    return cfg


def _check_method_needs(cfg: RunConfig, source: str) -> None:
    """What a method's registry row asks of the rest of the config: (B, A) pairs of a factorized
    model (`MethodSpec.steps_factor_pairs`), a restart period (`MethodSpec.restart_period_arg`)."""

    spec, kind = optimizers.method_spec(cfg.optim.name), cfg.factor.kind
    if spec.steps_factor_pairs and (kind == "none" or not FACTOR_KINDS[kind].refactorizable):
        able = ", ".join(k for k, f in FACTOR_KINDS.items() if f.refactorizable)
        raise ConfigError(
            f"{source}: optim.name={cfg.optim.name} steps the (B, A) factor pairs of a factorized model: "
            f"set factor.kind to one of {able} (got {kind})"
        )
    if spec.restart_period_arg in cfg.optim.extra:
        raise ConfigError(
            f"{source}: optim.extra.{spec.restart_period_arg} would disagree with restarts.every, which "
            f"{cfg.optim.name} takes it from; set restarts.every instead"
        )
    if spec.restart_period_arg and cfg.restarts.every < 1:
        raise ConfigError(
            f"{source}: optim.name={cfg.optim.name} takes its {spec.restart_period_arg} from restarts.every: "
            "set restarts.every >= 1"
        )


# ----------------------------------------------------------------------------------------------
# Strict typed filling of dataclasses from plain dicts.

#: Ints are 64-bit everywhere they end up (torch, numpy, checkpoints' JSON readers).
_INT_LIMIT = 2**63


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _plain(value: Any, key: str, source: str) -> Any:
    """A free-form value (`optim.extra`): plain YAML data only, since it is hashed as JSON and saved
    in checkpoints (no dates, sets or binary)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_plain(v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {
            _coerce(k, str, f"{key} key", source): _plain(v, f"{key}.{k}", source) for k, v in value.items()
        }
    raise ConfigError(
        f"{source}: {key}={_show(value)} has the wrong type (expected numbers, strings, lists or mappings)"
    )


def _scalar(value: Any, tp: Any, key: str, source: str) -> Any:
    if tp is bool and isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    # bool is an int subclass in Python; YAML's true/false is never a number here.
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        if not -_INT_LIMIT <= value < _INT_LIMIT:
            raise ConfigError(f"{source}: {key}={_show(value)} is out of range (a 64-bit integer)")
        return value
    if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:  # YAML 1.1 reads 1e-3 (no dot) as a string
            number = float(value)
        except ValueError:
            number = None
        except OverflowError:  # an int too large for a float
            number = math.inf
        if number is not None:
            if not math.isfinite(number):
                raise ConfigError(f"{source}: {key}={_show(value)} must be a finite number")
            return number
    raise ConfigError(f"{source}: {key}={_show(value)} has the wrong type (expected {_type_name(tp)})")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """`value` as type `tp` (the field's hint), or ConfigError; Literal choices checked here too."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        if isinstance(value, bool) and BOOL_AS_INT in meta:
            return int(value)
        return _coerce(value, base, key, source)
    if tp is Any:
        return _plain(value, key, source)
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{source}: {key}={_show(value)} has the wrong type (expected null)")
    if origin is Literal:
        choices = typing.get_args(tp)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        raise _not_one_of(source, key, value, choices)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, source)
            except ConfigError:
                continue
        raise ConfigError(f"{source}: {key}={_show(value)} has the wrong type (expected {tp})")
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key}={_show(value)} has the wrong type (expected a list)")
        return [_coerce(v, inner, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}={_show(value)} has the wrong type (expected a mapping)")
        return {
            _coerce(k, key_tp, f"{key} key", source): _coerce(v, value_tp, f"{key}.{k}", source)
            for k, v in value.items()
        }
    return _scalar(value, tp, key, source)


#: Keys that were removed, and what replaces them: a recipe still carrying one gets this one line
#: instead of a bare "unknown key" (never a silent translation: the meaning changed).
REPLACED_KEYS = {
    "train.eval_batches": "train.eval_tokens (validation target tokens, the same set for any number "
    "of processes; e.g. eval_tokens: 16384 for a tiny run, 10000000 as the benchmark)",
}


def _fill(obj: Any, data: Any, prefix: str, source: str) -> None:
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(f"{source}: {where} must be a mapping, got {_show(data)}")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in REPLACED_KEYS:
            raise ConfigError(f"{source}: {dotted} was replaced by {REPLACED_KEYS[dotted]}")
        if key not in fields:
            raise ConfigError(f"{source}: unknown key {dotted!r} (known: {', '.join(fields)})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _fill(current, value, f"{dotted}.", source)
        else:
            setattr(obj, key, _coerce(value, hints[key], dotted, source))


def from_dict(data: dict[str, Any], source: str = "config") -> RunConfig:
    cfg = RunConfig()
    _fill(cfg, data or {}, "", source)
    return cfg


# ----------------------------------------------------------------------------------------------
# YAML: recipes and override values.


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML
    keeps the last value silently, so a recipe would not say what runs)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may override its keys
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # unhashable: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key!r}",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str, source: str, what: str) -> Any:
    """`text` as YAML data, or ConfigError ("{source}: {what} (line L, column C: problem)")."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{source}: {what} ({where}{e.problem or e.context})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: {what} ({str(e).splitlines()[0]})") from None
    # Values YAML matches but Python refuses: a date 2024-13-45, an int of 5000 digits.
    except (ValueError, OverflowError) as e:
        raise ConfigError(f"{source}: {what} ({e})") from None
    except RecursionError:
        raise ConfigError(f"{source}: {what} (nested too deeply)") from None


def _read_recipe(path: str | Path) -> dict[str, Any]:
    """The recipe's top-level mapping; ConfigError if it is missing, unreadable, not UTF-8 text,
    not YAML, empty, or not a mapping."""
    p, source = Path(path), str(path)
    try:
        if p.is_dir():
            raise ConfigError(f"recipe {source} is a directory, not a file")
        if not p.exists():
            raise ConfigError(f"recipe not found: {source}")
        if not p.is_file():  # a FIFO or device would block or never end
            raise ConfigError(f"recipe {source} is not a regular file")
        raw = p.read_bytes()
    except (OSError, ValueError) as e:  # permissions, a name too long or with a NUL byte
        raise ConfigError(f"cannot read recipe {source}: {getattr(e, 'strerror', None) or e}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{source}: not UTF-8 text (byte {e.start}: {raw[e.start : e.start + 1]!r})"
        ) from None
    data = _parse_yaml(text, source, "not valid YAML")
    if data is None:
        raise ConfigError(f"{source}: recipe is empty (write {{}} for all defaults)")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a recipe must be a mapping of sections, got {_show(data)}")
    return data


def apply_overrides(cfg: RunConfig, overrides: list[str], source: str = "--set") -> RunConfig:
    """Applies ``section.key=value`` strings; values are parsed as YAML."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{source}: {_show(item)} is not of the form section.key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        value = _parse_yaml(raw, source, f"cannot parse value of {key!r}") if raw != "" else ""
        nested: dict[str, Any] = {}
        cur = nested
        parts = key.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = value
        _fill(cfg, nested, "", f"{source} {key}")
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Loads a recipe (or the defaults when `path` is None), applies overrides, validates."""
    if path is None:
        cfg, source = RunConfig(), "defaults"
    else:
        source = str(path)
        cfg = from_dict(_read_recipe(path), source)
        if not cfg.method:
            cfg.method = Path(path).stem
    apply_overrides(cfg, overrides or [])
    if not cfg.method:
        cfg.method = cfg.optim.name if cfg.factor.kind == "none" else cfg.factor.kind
    return validate(cfg, source if not overrides else f"{source} (+ --set)")


def to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def config_hash(cfg: RunConfig) -> str:
    """Short stable hash of the resolved config (for results tables and resume checks)."""
    blob = json.dumps(to_dict(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


# ----------------------------------------------------------------------------------------------
# The README's config table, generated from the field docstrings and types.


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a config dataclass (the string right under each field), each
    joined into one line."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _allowed(tp: Any) -> str:
    """The values a field takes, in words, from its type."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return ", ".join(f"`{c}`" for c in typing.get_args(tp))
    if origin is list:
        inner = _allowed(typing.get_args(tp)[0])
        return f"a list of {inner}" if inner else "a list"
    if origin is dict:
        return "a mapping"
    if origin in (Union, types.UnionType):
        return " or ".join("`null`" if a is type(None) else _allowed(a) for a in typing.get_args(tp))
    if origin is Annotated:
        base, *meta = typing.get_args(tp)
        for m in meta:
            if isinstance(m, Check):
                return f"{_type_name(base)} {m.text}"
            if isinstance(m, OneOf):
                return m.where + (": " + ", ".join(f"`{n}`" for n in m.names()) if m.listed else "")
        return _type_name(base)
    return _type_name(tp)


def _yaml_text(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).removesuffix("\n...\n").strip()


def config_table() -> str:
    """Markdown table of every YAML key: default, allowed values and meaning (README.md holds a
    copy that tests/test_config.py compares with this)."""
    rows = ["| key | default | values | meaning |", "|---|---|---|---|"]
    for key, value, tp, owner, name in _leaves(RunConfig()):
        cells = [f"`{key}`", f"`{_yaml_text(value)}`", _allowed(tp), field_docs(owner).get(name, "")]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
