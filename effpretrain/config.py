"""The run configuration: dataclasses are the one schema, YAML recipes only fill them.

Loading is strict: an unknown key, a value of the wrong type or out of range raises
`ConfigError` naming the key and the file it came from. Overrides use dotted keys,
``--set optim.lr=3e-4``, with values parsed as YAML scalars.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml


class ConfigError(ValueError):
    """Bad input: the CLI reports it in one line and exits with code 2."""


ATTN_MLP_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class ModelConfig:
    """Which LLaMA to build (see effpretrain.models.PRESETS)."""

    preset: str = "tiny"
    # Positions the model supports; 0 means data.seq_len.
    max_position_embeddings: int = 0


@dataclass
class FactorConfig:
    """Model surgery: replace attention/MLP linears by factorized layers (PAPER.md 2.6-2.8)."""

    kind: str = "none"  # none | lowrank | lora | relora | sltrain
    rank: int = 128
    alpha: float = 32.0
    targets: list[str] = field(default_factory=lambda: list(ATTN_MLP_TARGETS))
    density: float = 0.03  # SLTrain sparse support fraction delta
    seed: int = 0


@dataclass
class OptimConfig:
    """The optimizer and its hyper-parameters; projection keys apply to projected methods only."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    # Projection methods (galore, fira, apollo, apollo_mini, galore_8bit).
    rank: int = 128
    update_proj_gap: int = 200
    scale: float = 0.25
    proj_type: str = "std"
    basis: str = "default"  # default | svd | randomized_svd | random
    targets: list[str] = field(default_factory=lambda: list(ATTN_MLP_TARGETS))
    # Method-specific extras passed to the optimizer constructor, e.g. {gamma1: 0.85}.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    """Where tokens come from (builtin | files | hub) and how they become batches."""

    source: str = "builtin"
    path: str = ""  # files: a .txt/.jsonl/.parquet file or a folder of them
    name: str = ""  # hub: dataset name, e.g. allenai/c4
    config: str = ""  # hub: dataset config, e.g. en
    split: str = "train"
    val_split: str = ""  # hub: held-out split (e.g. validation); empty = carve from split
    text_field: str = "text"
    tokenizer: str = "builtin-bpe"  # builtin-bpe | any HF tokenizer name or path (e.g. t5-base)
    vocab_size: int = 8192  # builtin-bpe only
    seq_len: int = 128
    mode: str = "pack"  # pack | truncate
    val_every: int = 50  # every Nth document is held out for validation (builtin/files)
    shuffle_seed: int = 0


@dataclass
class TrainConfig:
    """The loop: budget, batch, schedule, evaluation, checkpoints, precision."""

    max_steps: int = 300
    batch_size: int = 16  # sequences per process per micro-step
    grad_accum: int = 1
    schedule: str = "cosine"  # cosine | linear | constant
    warmup_ratio: float = 0.1
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # global-norm clipping; 0 disables
    eval_every: int = 50
    eval_batches: int = 8
    save_every: int = 0  # 0: only the final checkpoint
    keep_checkpoints: int = 2
    log_every: int = 10
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16-mixed | bf16-pure
    activation_checkpointing: int = 0  # 0 off; k: checkpoint every k-th layer (1 = all)
    max_consecutive_skips: int = 5  # non-finite steps in a row before the run stops
    trackers: list[str] = field(default_factory=list)  # tensorboard | wandb
    plot: bool = True


@dataclass
class RestartsConfig:
    """Weight refactorization and momentum reset every `every` steps (PAPER.md 2.9)."""

    every: int = 0  # 0 disables
    refactorize: bool = True
    reset_momentum: bool = True
    recovery_steps: int = 10


@dataclass
class DistConfig:
    """Data parallelism across processes (launch with accelerate launch or torchrun)."""

    sharding: str = "ddp"  # ddp | fsdp2 (used only when several processes run)


@dataclass
class RunConfig:
    """Everything a run needs; `method` is a display name (defaults to the recipe's stem)."""

    method: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    factor: FactorConfig = field(default_factory=FactorConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    restarts: RestartsConfig = field(default_factory=RestartsConfig)
    dist: DistConfig = field(default_factory=DistConfig)


# ----------------------------------------------------------------------------------------------
# Validation of values: (key, predicate, message). Checked after every load and override.
_CHOICES = {
    "optim.proj_type": ("std", "reverse_std", "right", "left", "full"),
    "optim.basis": ("default", "svd", "randomized_svd", "random"),
    "data.source": ("builtin", "files", "hub"),
    "data.mode": ("pack", "truncate"),
    "train.schedule": ("cosine", "linear", "constant"),
    "train.precision": ("fp32", "bf16-mixed", "bf16-pure"),
    "dist.sharding": ("ddp", "fsdp2"),
}
_POSITIVE = [
    "factor.rank",
    "factor.alpha",
    "optim.lr",
    "optim.eps",
    "optim.rank",
    "optim.update_proj_gap",
    "optim.scale",
    "data.seq_len",
    "data.vocab_size",
    "data.val_every",
    "train.max_steps",
    "train.batch_size",
    "train.grad_accum",
    "train.eval_batches",
    "train.log_every",
    "train.keep_checkpoints",
    "train.max_consecutive_skips",
]
_NON_NEGATIVE = [
    "model.max_position_embeddings",
    "optim.weight_decay",
    "train.grad_clip",
    "train.eval_every",
    "train.save_every",
    "train.activation_checkpointing",
    "restarts.every",
    "restarts.recovery_steps",
    "train.seed",
    "factor.seed",
    "data.shuffle_seed",
]
_UNIT = ["optim.beta1", "optim.beta2", "train.warmup_ratio", "train.min_lr_ratio", "factor.density"]


def _get(cfg: RunConfig, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: RunConfig, source: str = "config") -> RunConfig:
    """Checks ranges and choices; raises ConfigError naming the key and `source`."""
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"{source}: {key}={_get(cfg, key)!r} is not one of {', '.join(choices)}")
    for key in _POSITIVE:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"{source}: {key}={_get(cfg, key)!r} must be > 0")
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"{source}: {key}={_get(cfg, key)!r} must be >= 0")
    for key in _UNIT:
        v = _get(cfg, key)
        if not 0.0 <= v <= 1.0 or (key.startswith("optim.beta") and v >= 1.0):
            raise ConfigError(f"{source}: {key}={v!r} must be in [0, 1)")
    for key in ("trackers",):
        for t in cfg.train.trackers:
            if t not in ("tensorboard", "wandb"):
                raise ConfigError(f"{source}: train.{key} entry {t!r} is not one of tensorboard, wandb")
    if cfg.data.source == "files" and not cfg.data.path:
        raise ConfigError(f"{source}: data.path is required when data.source=files")
    if cfg.data.source == "files" and not Path(cfg.data.path).expanduser().exists():
        raise ConfigError(f"{source}: data.path not found: {cfg.data.path}")
    if cfg.data.source == "hub" and not cfg.data.name:
        raise ConfigError(f"{source}: data.name is required when data.source=hub")
    from optimizers import METHODS

    if cfg.optim.name not in METHODS:
        raise ConfigError(
            f"{source}: optim.name={cfg.optim.name!r} is not one of {', '.join(sorted(METHODS))}"
        )
    from effpretrain.models import FACTOR_KINDS

    if cfg.factor.kind != "none" and cfg.factor.kind not in FACTOR_KINDS:
        raise ConfigError(
            f"{source}: factor.kind={cfg.factor.kind!r} is not one of none, {', '.join(FACTOR_KINDS)}"
        )
    from effpretrain.models import PRESETS

    if cfg.model.preset not in PRESETS:
        raise ConfigError(f"{source}: model.preset={cfg.model.preset!r} is not one of {', '.join(PRESETS)}")
    return cfg


# ----------------------------------------------------------------------------------------------
# Strict typed filling of dataclasses from plain dicts.


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, source)
            except ConfigError:
                continue
        raise ConfigError(f"{source}: {key}={value!r} has the wrong type (expected {tp})")
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key}={value!r} has the wrong type (expected a list)")
        return [_coerce(v, inner, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}={value!r} has the wrong type (expected a mapping)")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        # YAML `true` is a bool, which Python calls an int: accept it only for on/off ints.
        if isinstance(value, bool):
            if key.endswith("activation_checkpointing"):
                return int(value)
        elif isinstance(value, int):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads 1e-3 (no dot) as a string
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{source}: {key}={value!r} has the wrong type (expected {_type_name(tp)})")


def _fill(obj: Any, data: dict[str, Any], prefix: str, source: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'top level'} must be a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    for key, value in data.items():
        dotted = f"{prefix}{key}"
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


def apply_overrides(cfg: RunConfig, overrides: list[str], source: str = "--set") -> RunConfig:
    """Applies ``section.key=value`` strings; values are parsed as YAML scalars."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"{source}: {item!r} is not of the form section.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: cannot parse value of {key!r}: {e}".splitlines()[0]) from None
        nested: dict[str, Any] = {}
        cur = nested
        parts = key.strip().split(".")
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
        p = Path(path)
        source = str(path)
        if not p.is_file():
            raise ConfigError(f"recipe not found: {path}")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{source}: not valid YAML ({str(e).splitlines()[0]})") from None
        if data is not None and not isinstance(data, dict):
            raise ConfigError(f"{source}: a recipe must be a mapping of sections")
        cfg = from_dict(data or {}, source)
        if not cfg.method:
            cfg.method = p.stem
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
