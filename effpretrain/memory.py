"""Memory: the analytic estimate (no model is built) and the measured numbers.

Estimate, per rank, in bytes:

- weights: every parameter (and persistent buffer such as SLTrain's sparse index) at its dtype;
- grads: trainable parameters at the gradient dtype (= parameter dtype);
- optimizer_state: the method's exact formula per parameter (`optimizers.state_bytes`), which
  for each class is the same formula its docstring states and its tests check;
- activations: saved-for-backward tensors of a LLaMA block with SDPA attention, per token,
  ``(8 h + 4 i)`` elements (norm inputs/outputs, q/k/v, attention output, the four MLP
  intermediates); a checkpointed block keeps only its input ``h`` and one block is recomputed at a
  time; plus the logits (``V`` at the activation dtype and in fp32 for the loss). An approximation,
  stated as such.

``dtype`` names the storage precision: ``fp32``; ``bf16`` (pure bf16: weights, grads and states in
bf16, the paper's setting); ``bf16-mixed`` (fp32 weights/grads/states, bf16 activations).
Under FSDP2 weights, grads and full-rank states are sharded over ranks, while a projected matrix's
low-rank moments and basis are computed from the gathered gradient and held whole on every rank
(optimizers/projected_adam.py), and the 8-bit methods (adamw_8bit, galore_8bit) step gathered tensors and
hold all their state whole on every rank (`MethodSpec.fsdp2_whole_state`); under DDP every rank
holds all. Per-rank figures are rank 0's, the largest share: torch.chunk gives it ceil(rows / N)
rows of every tensor.

Measured: exact optimizer-state bytes from the state tensors, and peak memory (CUDA max allocated,
or the process's peak RSS on CPU).
"""

from __future__ import annotations

import math
import resource
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

import optimizers
from effpretrain.config import ATTN_MLP_TARGETS
from effpretrain.models.llama import PRESETS

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "bf16-mixed": torch.float32,
    "bf16-pure": torch.bfloat16,
}


@dataclass
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "target" (attention/MLP linear) | "matrix" (embeddings, head) | "vector" (norms)
    trainable: bool = True


def llama_param_specs(preset: str, vocab_size: int | None = None) -> list[ParamSpec]:
    """The parameters of a preset's LlamaForCausalLM, in its named_parameters order."""
    p = PRESETS[preset]
    V, h, i = vocab_size or p.vocab, p.hidden, p.intermediate
    specs = [ParamSpec("model.embed_tokens.weight", (V, h), "matrix")]
    for layer in range(p.layers):
        pre = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            specs.append(ParamSpec(f"{pre}.self_attn.{proj}.weight", (h, h), "target"))
        specs.append(ParamSpec(f"{pre}.mlp.gate_proj.weight", (i, h), "target"))
        specs.append(ParamSpec(f"{pre}.mlp.up_proj.weight", (i, h), "target"))
        specs.append(ParamSpec(f"{pre}.mlp.down_proj.weight", (h, i), "target"))
        specs.append(ParamSpec(f"{pre}.input_layernorm.weight", (h,), "vector"))
        specs.append(ParamSpec(f"{pre}.post_attention_layernorm.weight", (h,), "vector"))
    specs.append(ParamSpec("model.norm.weight", (h,), "vector"))
    specs.append(ParamSpec("lm_head.weight", (V, h), "matrix"))
    return specs


def _is_target(name: str, targets: list[str]) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in targets


@dataclass
class Estimate:
    """The analytic breakdown, all in bytes per rank."""

    weights: int
    grads: int
    optimizer_state: int
    activations: int
    params: int
    trainable_params: int
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer_state + self.activations

    @property
    def weights_plus_optimizer(self) -> int:
        return self.weights + self.optimizer_state

    def as_dict(self) -> dict[str, Any]:
        return {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer_state": self.optimizer_state,
            "activations": self.activations,
            "weights_plus_optimizer": self.weights_plus_optimizer,
            "total": self.total,
            "params": self.params,
            "trainable_params": self.trainable_params,
            **self.detail,
        }


def projection_group(optim_cfg: Any) -> dict[str, Any]:
    """The group options a projected param gets from an OptimConfig (also used by the trainer):
    the registry row's `projection_group`."""
    o = optim_cfg
    return optimizers.method_spec(o.name).projection_group(
        rank=o.rank,
        update_proj_gap=o.update_proj_gap,
        scale=o.scale,
        proj_type=o.proj_type,
        basis=o.basis,
        extra=o.extra,
    )


def estimate(
    preset: str,
    method: str = "adamw",
    *,
    dtype: str = "bf16",
    vocab_size: int | None = None,
    optim_cfg: Any = None,
    factor_kind: str = "none",
    factor_rank: int = 128,
    density: float = 0.03,
    factor_targets: list[str] | None = None,
    batch_size: int = 1,
    seq_len: int = 256,
    activation_checkpointing: int = 0,
    world_size: int = 1,
    sharding: str = "none",
) -> Estimate:
    """Analytic memory of training `preset` with optimizer `method` (see module docstring)."""
    from effpretrain.config import OptimConfig

    optim_cfg = optim_cfg or OptimConfig(name=method)
    targets = list(optim_cfg.targets)
    factor_targets = list(factor_targets or ATTN_MLP_TARGETS)
    pdtype = DTYPES[dtype]
    itemsize = torch.empty((), dtype=pdtype).element_size()
    act_itemsize = 4 if dtype == "fp32" else 2
    mspec = optimizers.method_spec(method)
    projected = mspec.projects
    proj_group = projection_group(optim_cfg) if projected else {}

    # Under FSDP2 each parameter is split on dim 0 into N chunks with torch.chunk's sizes, so
    # rank 0 holds the largest share: ceil(rows / N) rows of every tensor. Per-rank figures are
    # rank 0's. Element-wise optimizer state is split like its parameter (scalar terms, such as
    # torch AdamW's step tensor, stay whole); see `replicated_state` for what is not split.
    shard = world_size if sharding == "fsdp2" else 1
    whole_state = shard > 1 and mspec.fsdp2_whole_state

    def mine(shape: tuple[int, ...]) -> tuple[int, ...]:
        return (-(-shape[0] // shard), *shape[1:]) if shard > 1 else tuple(shape)

    def dense_state(shape: tuple[int, ...]) -> tuple[int, int]:
        """(sharded, replicated) state bytes of one non-projected parameter on rank 0."""
        if whole_state:
            return 0, mspec.state_bytes(shape, {}, pdtype)
        return mspec.state_bytes(mine(shape), {}, pdtype), 0

    weights = grads = state = params = trainable = index_bytes = 0
    replicated_state = 0  # projected params' low-rank state and basis: whole on every FSDP2 rank
    for spec in llama_param_specs(preset, vocab_size):
        if factor_kind != "none" and spec.kind == "target" and _is_target(spec.name, factor_targets):
            from effpretrain.models.factorized import factor_spec

            m, n = spec.shape
            counts = factor_spec(factor_kind).param_counts(m, n, factor_rank, density)
            for shape in _factor_param_shapes(m, n, factor_rank, counts):
                numel = math.prod(mine(shape))
                sharded, whole = dense_state(shape)
                state, replicated_state = state + sharded, replicated_state + whole
                weights += numel * itemsize
                grads += numel * itemsize
            frozen = counts.get("frozen", 0)
            if frozen:  # LoRA's W0 (m x n), sharded like any parameter
                weights += math.prod(mine((m, n))) * itemsize
            params += counts["trainable"] + frozen
            trainable += counts["trainable"]
            index_bytes += counts.get("index_elements", 0) * 8  # a buffer: not sharded
            continue
        numel = math.prod(mine(spec.shape))
        weights += numel * itemsize
        grads += numel * itemsize
        params += math.prod(spec.shape)
        trainable += math.prod(spec.shape)
        is_proj = projected and spec.kind == "target" and _is_target(spec.name, targets)
        if is_proj:
            replicated_state += mspec.state_bytes(spec.shape, proj_group, pdtype)
        else:
            sharded, whole = dense_state(spec.shape)
            state, replicated_state = state + sharded, replicated_state + whole
    weights += index_bytes

    p = PRESETS[preset]
    V = vocab_size or p.vocab
    tokens = batch_size * seq_len
    per_layer = (8 * p.hidden + 4 * p.intermediate) * tokens * act_itemsize
    k = activation_checkpointing
    n_ckpt = 0 if k <= 0 else len(range(0, p.layers, k))
    acts = (p.layers - n_ckpt) * per_layer + n_ckpt * p.hidden * tokens * act_itemsize
    if n_ckpt:
        acts += per_layer  # one checkpointed block is recomputed at a time
    acts += tokens * (2 * p.hidden * act_itemsize + V * (act_itemsize + 4))

    detail = {
        "preset": preset,
        "method": method,
        "dtype": dtype,
        "factor": factor_kind,
        "world_size": world_size,
        "sharding": sharding,
        "sparse_index_bytes": index_bytes,
    }
    return Estimate(
        weights=weights,
        grads=grads,
        optimizer_state=state + replicated_state,
        activations=acts,
        params=params,
        trainable_params=trainable,
        detail=detail,
    )


def _factor_param_shapes(m: int, n: int, rank: int, counts: dict[str, int]) -> list[tuple[int, ...]]:
    """Shapes of the separate trainable tensors a factorized m x n target holds: B (m x r),
    A (r x n) and, for SLTrain, the 1-D sparse values."""
    shapes: list[tuple[int, ...]] = [(m, rank), (rank, n)]
    extra = counts["trainable"] - m * rank - rank * n
    if extra:
        shapes.append((extra,))
    return shapes


def estimate_from_config(cfg: Any, vocab_size: int, world_size: int = 1, sharding: str = "none") -> Estimate:
    """The estimate for a resolved RunConfig (what the trainer stores in summary.json)."""
    dtype = {"fp32": "fp32", "bf16-mixed": "bf16-mixed", "bf16-pure": "bf16"}[cfg.train.precision]
    return estimate(
        cfg.model.preset,
        cfg.optim.name,
        dtype=dtype,
        vocab_size=vocab_size,
        optim_cfg=cfg.optim,
        factor_kind=cfg.factor.kind,
        factor_rank=cfg.factor.rank,
        density=cfg.factor.density,
        factor_targets=cfg.factor.targets,
        batch_size=cfg.train.batch_size,
        seq_len=cfg.data.seq_len,
        activation_checkpointing=cfg.train.activation_checkpointing,
        world_size=world_size,
        sharding=sharding,
    )


# ----------------------------------------------------------------------------------------------
# Measured


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated on GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def current_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    import psutil

    return int(psutil.Process().memory_info().rss)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def format_table(est: Estimate) -> str:
    """A human-readable breakdown in GB (1e9 bytes)."""
    rows = [
        ("weights", est.weights),
        ("gradients", est.grads),
        ("optimizer state", est.optimizer_state),
        ("activations (approx.)", est.activations),
        ("weights + optimizer", est.weights_plus_optimizer),
        ("total", est.total),
    ]
    d = est.detail
    head = (
        f"{d['preset']} / {d['method']}"
        + (f" + {d['factor']}" if d["factor"] != "none" else "")
        + f" / {d['dtype']} / world {d['world_size']} ({d['sharding']}), per rank"
    )
    lines = [head, f"  params {est.params:,}  trainable {est.trainable_params:,}"]
    lines += [f"  {name:<24}{b / 1e9:>10.3f} GB  ({b:,} B)" for name, b in rows]
    return "\n".join(lines)
