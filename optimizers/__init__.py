"""Optimizers for memory-efficient pretraining: pure PyTorch, usable in any training loop.

`METHODS` is the method registry, the one place that holds every fact the toolkit needs about an
optimizer name: its class (imported on first use, so ``import optimizers`` stays cheap and an
optional backend such as bitsandbytes is only needed by the methods that use it), whether it
projects some groups, how its state shards under FSDP2, whether it needs the run length, and its
exact state-bytes formula. What a class declares about itself (APOLLO-Mini's fixed rank, Fira's
``alpha`` from ``scale``, APOLLO's random basis, 8-bit moments that are not element-wise) stays
on the class and is read from there, not repeated here. The config's choices, the memory
estimator, the trainer's param-group rules, the HF factory, the leaderboard and the tests all read
it. Adding a method is one file with its class, one `MethodSpec` row here, its recipes and its own
test file tests/optimizers/test_<name>.py, whose module-level ``CONTRACT`` says how the shared
optimizer contract runs it (how it reduces to AdamW, or why it does not); no shared file changes.

Every registered class is also importable by its own name, lazily: ``from optimizers import
GaLoreAdamW`` (as with the reference packages).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from optimizers._owners import assign_owners, shard_rows, whole_cost
from optimizers._sharded import local
from optimizers.momentum_reset import reset_
from optimizers.refactorization import refactorize_
from optimizers.restarts import Restarts, recovery_factor

#: The group key that marks (B, A) factor pairs, ``[B_1, A_1, B_2, A_2, ...]`` (`MethodSpec.steps_factor_pairs`).
FACTOR_PAIRS_KEY = "factor_pairs"
#: Keys of `optim.extra` that belong to projected groups (basis options), not to the constructor.
PROJECTION_GROUP_EXTRAS: tuple[str, ...] = ("oversample", "power_iters", "seed")


def _torch_adamw_state_bytes(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """torch.optim.AdamW: exp_avg and exp_avg_sq in the parameter dtype, ``step`` an fp32 scalar
    tensor: ``2 * numel * itemsize + 4``."""
    return 2 * math.prod(shape) * dtype.itemsize + 4


# Step transients: bytes of the temporaries a method holds while it steps one parameter (the
# estimator's optimizer-step moment adds them to weights + gradients + state). s = itemsize, k =
# min(m, n) for an m x n matrix. Derived from each class's step and checked against measured peaks
# where the step is a run's largest moment; an upper bound where the class's path varies (bases).


def _foreach_adam_transient(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """torch's foreach AdamW: ``sqrt(v)`` (then divided in place) for every tensor at once:
    ``numel s`` per tensor, summed over tensors (`MethodSpec.foreach`)."""
    return math.prod(shape) * dtype.itemsize


def _dense_update_transient(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """A per-tensor Adam-style step: the denominator and the update, ``2 numel s``."""
    return 2 * math.prod(shape) * dtype.itemsize


def _projected_transient(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """`ProjectedAdam` (GaLore, Fira, APOLLO): an unprojected tensor's step holds one full-size
    temporary (``numel s``, measured); a projected m x n matrix at a basis refresh (its largest
    step) the fp32 copy of the gradient (``4 m n``), a thin SVD's workspace (``4 (m k + k + k n)``,
    an upper bound for the randomized and random bases) and the full-size update projected back
    (``m n s``)."""
    if "rank" not in group or len(shape) != 2:
        return math.prod(shape) * dtype.itemsize
    m, n = shape
    k = min(m, n)
    return 4 * m * n + 4 * (m * k + k + k * n) + m * n * dtype.itemsize


def _random_projected_transient(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """APOLLO and APOLLO-Mini with their random bases (the default): a projected m x n matrix's
    step holds its update, the gradient scaled channel- or tensor-wise (``m n s``), the projected
    gradient and Adam's direction on it (``4 r max(m, n)`` each) and the drawn basis
    (``4 r min(m, n)``), measured; no SVD. Another basis: `_projected_transient`."""
    if "rank" not in group or len(shape) != 2 or group.get("basis", "random") != "random":
        return _projected_transient(shape, group, dtype)
    m, n = shape
    r = min(int(group["rank"]), m, n)
    return m * n * dtype.itemsize + 8 * r * max(m, n) + 4 * r * min(m, n)


def _dequantised_transient(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """`ProjectedAdam` with 8-bit moments (GaLore 8-bit): the moments dequantised to fp32
    (``2 * 4`` per moment element), the update (``s`` per element) and the re-quantised codes
    (``2`` per element), per moment element: ``numel`` for an unprojected tensor (measured),
    ``k max(m, n)`` for a projected matrix, whose refresh adds `_projected_transient`."""
    if "rank" in group and len(shape) == 2:
        elements = min(group["rank"], *shape) * max(shape)
        return (10 + dtype.itemsize) * elements + _projected_transient(shape, group, dtype)
    return (10 + dtype.itemsize) * math.prod(shape)


def _quantised_4bit_transient(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """The 4-bit methods (`Moments4bit`, optimizers/moments_4bit.py): the moments' update on L
    entries (`Moments4bit.step_transient_bytes`: dequantised M, V and N in fp32, 12 L, plus x's
    fp32 copy or one chunk's int32 codes), L = ``numel`` for an unprojected tensor; for a projected
    matrix, L = ``k max(m, n)`` with R itself (``s L``), whose refresh adds `_projected_transient`."""
    from optimizers.moments_4bit import Moments4bit

    if "rank" in group and len(shape) == 2:
        elements = min(group["rank"], *shape) * max(shape)
        return (
            dtype.itemsize * elements
            + Moments4bit.step_transient_bytes(elements, dtype, group)
            + _projected_transient(shape, group, dtype)
        )
    return Moments4bit.step_transient_bytes(math.prod(shape), dtype, group)


def _clipped_update_transient(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """Stable-SPAM: its adaptive clipping and norm scaling each make a full-size copy of the
    gradient before the Adam update's own temporary: ``3 numel s`` (measured)."""
    return 3 * math.prod(shape) * dtype.itemsize


def _one_temporary_transient(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """One full-size temporary at a time, ``numel s`` (measured): Adam-mini's G^2 for the block means,
    then its update (its per-block vectors are negligible); LORO's Adam direction N of one tensor
    (written over sqrt(V) + eps, or the fused kernel's output; a pair's exact step adds
    `pair_step_transient_bytes`)."""
    return math.prod(shape) * dtype.itemsize


def _matrix_rule_transient(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """`MatrixOptimizer` (Muon, SWAN, SinkGD, SCALE): an AdamW parameter holds ``sqrt(V)`` and the
    denominator (``2 numel s``); a matrix weight's rule at most four fp32 working copies of the
    m x n matrix, the update cast to the parameter dtype and four fp32 k x k Gram-sized products
    (SWAN's whitening, the largest; k = min(m, n)): ``16 m n + s m n + 16 k^2``, an upper bound."""
    if not group.get("matrix") or len(shape) != 2:
        return 2 * math.prod(shape) * dtype.itemsize
    m, n = shape
    return (16 + dtype.itemsize) * m * n + 16 * min(m, n) ** 2


def _fused_transient(shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """bitsandbytes' fused 8-bit AdamW kernel dequantises block by block: no full-size temporary.
    A weight stored in fewer bits than fp32 steps as its fp32 value (the writer's term) with an
    fp32 copy of its gradient: 4 L (optimizers/adamw_8bit.py)."""
    return 0 if dtype == torch.float32 else 4 * math.prod(shape)


@dataclass(frozen=True)
class MethodSpec:
    """Every per-method fact, for one optimizer name.

    Attributes:
        name: the registry name (recipes' ``optim.name``).
        target: ``"module:Class"``, imported on first use (`cls`).
        projects: projected groups (attention/MLP weights) carry ``rank`` and the basis keys; the
            toolkit builds such a group only for these methods.
        needs_total_steps: the constructor takes ``total_steps`` (the run length) unless given.
        defaults: constructor keywords the toolkit passes unless the caller gives them.
        state_bytes_fn: the state formula for a class that has no ``state_bytes`` classmethod of
            its own (torch's AdamW); our classes document and test theirs.
        shared_state_fn: bytes of state a parameter refers to that the optimizer holds once for all
            its parameters (bitsandbytes' quantile maps), for a class whose ``shared_state_bytes``
            classmethod does not say it; none: 0 (`shared_state_bytes`).
        step_transient_fn: bytes of the temporaries the step holds for one parameter
            (`step_transient_bytes`); default `_dense_update_transient`.
        foreach: the class steps every tensor at once (torch's foreach path), so the transients of
            all tensors are live together; otherwise one tensor at a time (the largest counts).
        head_blocks: the attention query and key weights go in their own group with
            ``block_rows`` = the model's head size (`head_block_group`; Adam-mini's one second
            moment per head), built by the trainer and the estimator from the model config.
        steps_factor_pairs: its rule steps a factorized model's (B, A) pairs jointly (LORO): the
            toolkit puts every factorized layer's B and A, in that order, in one group marked
            ``factor_pairs`` (`FACTOR_PAIRS_KEY`), and refuses the method without a factor kind
            that has refactorizable pairs; the class's ``exact_step_transient_bytes(m, n, r,
            dtype)`` is one pair's largest step (`pair_step_transient_bytes`).
        restart_period_arg: the constructor keyword that receives ``restarts.every``: a schedule
            the method keeps in step with the restarts that refresh its state (LORO's exact steps);
            such a method needs ``restarts.every > 0``.
        matrix_params: which weights get a whole-matrix group (``matrix=True``, `matrix_group`):
            None (none), ``"hidden"`` (the attention/MLP linear weights the run targets: Muon, SWAN,
            SinkGD) or ``"all"`` (every trainable matrix: the targets as role "hidden", embeddings
            as "embedding", any other matrix, the LM head, as "head": SCALE). The trainer's param
            groups and the estimator both read it (`matrix_role`).
    """

    name: str
    target: str
    projects: bool = False
    needs_total_steps: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    state_bytes_fn: Callable[[tuple[int, ...], dict[str, Any], torch.dtype], int] | None = None
    shared_state_fn: Callable[[tuple[int, ...], dict[str, Any], torch.dtype], int] | None = None
    step_transient_fn: Callable[[tuple[int, ...], dict[str, Any], torch.dtype], int] | None = None
    foreach: bool = False
    head_blocks: bool = False
    steps_factor_pairs: bool = False
    restart_period_arg: str | None = None
    matrix_params: str | None = None

    def head_block_group(self, head_dim: int) -> dict[str, Any]:
        """The group options of the query and key weights (empty unless `head_blocks`)."""
        return {"block_rows": int(head_dim)} if self.head_blocks else {}

    def bias_group(self) -> dict[str, Any]:
        """The group options of a linear layer's bias (Qwen2's q/k/v): under head blocks one block
        per entry, plain Adam, as Adam-mini's reference steps every bias; empty otherwise."""
        return {"block_rows": 1} if self.head_blocks else {}

    @property
    def class_name(self) -> str:
        return self.target.split(":")[1]

    @property
    def cls(self) -> type[torch.optim.Optimizer]:
        """The optimizer class (imports its module on first use)."""
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)

    @property
    def fsdp2_whole_state(self) -> bool:
        """Its dense moments are not element-wise (8-bit blocks, Adam-mini's per-block second
        moments): under FSDP2 a weight steps whole, once, on its owner rank (optimizers/_owners.py),
        which alone holds that weight's state, except where `steps_shards` allows its row shards.
        Read from the class: the ``ELEMENTWISE`` attribute of a projected class's moment storage
        (``MOMENTS``) or of the class itself; a class without one is element-wise (its full-size
        state shards with the parameter; a projected matrix's low-rank state lives on its owner)."""
        owner = getattr(self.cls, "MOMENTS", self.cls)
        return not getattr(owner, "ELEMENTWISE", True)

    def steps_shards(self, shape: tuple[int, ...], group: Mapping[str, Any]) -> bool:
        """Under FSDP2, whether a weight of `shape` in `group` steps its row shards on every rank,
        its state sharded like it (the same numbers as the whole step), rather than whole on an
        owner rank: an element-wise rule, or moments whose blocks the rows do not split (the
        moment storage's ``steps_shards``: 8-bit rows of whole 256-entry blocks)."""
        if self.steps_whole(group):
            return False
        owner = getattr(self.cls, "MOMENTS", None)
        if owner is not None and hasattr(owner, "steps_shards"):
            return bool(owner.steps_shards(tuple(shape)))
        return not self.fsdp2_whole_state

    @property
    def whole_matrix_steps(self) -> bool:
        """Some of its steps need a parameter's whole matrix (a projection basis, 8-bit blocks):
        under FSDP2 those run once on an owner rank (optimizers/_owners.py), and the class takes
        ``whole_matrix`` ("owner" | "gather") and ``bucket_bytes``."""
        return self.projects or self.fsdp2_whole_state or self.matrix_params is not None

    def matrix_role(self, *, target: bool, embedding: bool, ndim: int) -> str | None:
        """The matrix-group role of a trainable parameter (see ``matrix_params``), or None when it
        gets no matrix group (AdamW): `target` is a linear weight the run targets (attention/MLP),
        `embedding` an nn.Embedding weight."""
        if self.matrix_params is None or ndim != 2:
            return None
        if target:
            return "hidden"
        if self.matrix_params == "all":
            return "embedding" if embedding else "head"
        return None

    def steps_whole(self, group: Mapping[str, Any]) -> bool:
        """Whether a param group's weights step whole (a projected group, or a matrix group whose
        role the class does not step row by row: `MatrixOptimizer.steps_whole`): under FSDP2 on
        owner ranks, which alone hold their state."""
        if "rank" in group or group.get("project"):
            return True
        return bool(group.get("matrix")) and self.cls.steps_whole(dict(group))

    @staticmethod
    def matrix_group(role: str) -> dict[str, Any]:
        """The options of a whole-matrix param group (without ``params``) for `role`."""
        return {"matrix": True, "role": role}

    @property
    def fixed_rank(self) -> int | None:
        """The rank the class always projects at (APOLLO-Mini: 1), or None; a fixed rank exempts
        the method from the rank <= min(m, n) check and from ``optim.rank``."""
        return getattr(self.cls, "FIXED_RANK", None) if self.projects else None

    def projection_group(
        self,
        *,
        rank: int,
        update_proj_gap: int,
        scale: float,
        proj_type: str = "std",
        basis: str = "default",
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The options of a projected param group (without ``params``) from the common settings:
        the class's fixed rank wins over `rank`, ``basis="default"`` is left to the class (which
        also fills its own aliases and defaults), and the basis options of `extra`
        (`PROJECTION_GROUP_EXTRAS`) are carried over."""
        if not self.projects:
            raise ValueError(f"{self.name} does not project")
        g: dict[str, Any] = {
            "rank": self.fixed_rank or rank,
            "update_proj_gap": update_proj_gap,
            "scale": scale,
            "proj_type": proj_type,
        }
        if basis != "default":
            g["basis"] = basis
        g.update({k: v for k, v in (extra or {}).items() if k in PROJECTION_GROUP_EXTRAS})
        return g

    def constructor_kwargs(self, kwargs: Mapping[str, Any], total_steps: int | None = None) -> dict[str, Any]:
        """The toolkit's constructor keywords from a config's `kwargs` (common settings plus
        ``optim.extra``): the basis options, which go to projected groups, removed, and the run
        length added where the method needs one. `build_optimizer` adds the method's defaults."""
        kw = {k: v for k, v in kwargs.items() if k not in PROJECTION_GROUP_EXTRAS}
        if self.needs_total_steps and "total_steps" not in kw and total_steps is not None:
            kw["total_steps"] = total_steps
        return kw

    def restart_kwargs(self, every: int) -> dict[str, Any]:
        """The constructor keyword that takes the restart period `every`, if the method has one."""
        return {self.restart_period_arg: every} if self.restart_period_arg and every > 0 else {}

    def build(self, param_groups: Iterable[dict[str, Any]], **kwargs: Any) -> torch.optim.Optimizer:
        """The optimizer over `param_groups` (torch format) with defaults `kwargs` (plus the
        method's own `defaults`, e.g. torch AdamW's foreach path)."""
        return self.cls(list(param_groups), **{**self.defaults, **kwargs})

    def state_bytes(self, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Exact bytes of optimizer state one parameter of `shape`/`dtype` holds after >= 1 step."""
        fn = self.state_bytes_fn or self.cls.state_bytes
        return int(fn(tuple(shape), group, dtype))

    def part_state_bytes(
        self, shape: tuple[int, ...], part: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype
    ) -> int:
        """Exact bytes of state one rank holds for its row shard `part` of a weight of `shape` that
        `steps_shards` (the class's ``part_state_bytes`` where the whole weight decides the format,
        as 8-bit moments do; else the formula at the part's shape); the whole weight's
        `state_bytes` when `part` is all of it."""
        if tuple(part) == tuple(shape):
            return self.state_bytes(shape, group, dtype)
        fn = None if self.state_bytes_fn else getattr(self.cls, "part_state_bytes", None)
        if fn is not None:
            return int(fn(tuple(shape), tuple(part), group, dtype))
        return self.state_bytes(part, group, dtype)

    def shared_state_bytes(self, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Bytes of state a parameter of `shape` refers to that are shared by all the optimizer's
        parameters (held once): an optimizer's state is ``sum_p state_bytes(p) + max_p
        shared_state_bytes(p)``. 0 for a method without such state."""
        fn = self.shared_state_fn or getattr(self.cls, "shared_state_bytes", None)
        return int(fn(tuple(shape), group, dtype)) if fn is not None else 0

    def pair_step_transient_bytes(self, m: int, n: int, rank: int, dtype: torch.dtype) -> int:
        """Bytes of the temporaries of one (B, A) pair's joint step (m x n target, rank r), for a
        method that `steps_factor_pairs`; 0 otherwise."""
        if not self.steps_factor_pairs:
            return 0
        return int(self.cls.exact_step_transient_bytes(m, n, rank, dtype))

    def step_transient_bytes(self, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Bytes of the temporaries the step holds while it updates one parameter of `shape` (at a
        basis refresh for a projecting method: its largest step)."""
        fn = self.step_transient_fn or _dense_update_transient
        return int(fn(tuple(shape), group, dtype))


def _spec(**kw: Any) -> MethodSpec:
    kw["defaults"] = MappingProxyType(dict(kw.get("defaults", {})))
    return MethodSpec(**kw)


METHODS: dict[str, MethodSpec] = {
    s.name: s
    for s in (
        _spec(
            name="adamw",
            target="optimizers.adamw:AdamW",
            # foreach: torch's fastest CPU/GPU path that is also deterministic.
            defaults={"foreach": True},
            state_bytes_fn=_torch_adamw_state_bytes,
            step_transient_fn=_foreach_adam_transient,
            foreach=True,
        ),
        _spec(
            name="adamw_8bit",
            target="optimizers.adamw_8bit:AdamW8bit",
            step_transient_fn=_fused_transient,
        ),
        _spec(
            name="adamw_4bit",
            target="optimizers.adamw_4bit:AdamW4bit",
            step_transient_fn=_quantised_4bit_transient,
        ),
        _spec(
            name="stable_spam",
            target="optimizers.stable_spam:StableSPAM",
            needs_total_steps=True,
            step_transient_fn=_clipped_update_transient,
        ),
        _spec(
            name="spam",
            target="optimizers.stable_spam:SPAM",
        ),
        _spec(
            name="galore",
            target="optimizers.galore:GaLoreAdamW",
            projects=True,
            step_transient_fn=_projected_transient,
        ),
        _spec(
            name="golore",
            target="optimizers.golore:GoLoreAdamW",
            projects=True,
            needs_total_steps=True,
            step_transient_fn=_projected_transient,
        ),
        _spec(
            name="galore_8bit",
            target="optimizers.galore_8bit:GaLoreAdamW8bit",
            projects=True,
            step_transient_fn=_dequantised_transient,
        ),
        _spec(
            name="galore_4bit",
            target="optimizers.galore_4bit:GaLoreAdamW4bit",
            projects=True,
            step_transient_fn=_quantised_4bit_transient,
        ),
        _spec(
            name="fira",
            target="optimizers.fira:FiraAdamW",
            projects=True,
            step_transient_fn=_projected_transient,
        ),
        _spec(
            name="apollo",
            target="optimizers.apollo:APOLLOAdamW",
            projects=True,
            step_transient_fn=_random_projected_transient,
        ),
        _spec(
            name="apollo_mini",
            target="optimizers.apollo:APOLLOMini",
            projects=True,
            step_transient_fn=_random_projected_transient,
        ),
        _spec(
            name="adam_mini",
            target="optimizers.adam_mini:AdamMini",
            head_blocks=True,
            step_transient_fn=_one_temporary_transient,
        ),
        _spec(
            name="loro",
            target="optimizers.loro:LOROAdamW",
            steps_factor_pairs=True,
            restart_period_arg="exact_every",
            step_transient_fn=_one_temporary_transient,
        ),
        _spec(
            name="muon",
            target="optimizers.muon:Muon",
            matrix_params="hidden",
            step_transient_fn=_matrix_rule_transient,
        ),
        _spec(
            name="swan",
            target="optimizers.swan:SWAN",
            matrix_params="hidden",
            step_transient_fn=_matrix_rule_transient,
        ),
        _spec(
            name="sinkgd",
            target="optimizers.sinkgd:SinkGD",
            matrix_params="hidden",
            step_transient_fn=_matrix_rule_transient,
        ),
        _spec(
            name="scale",
            target="optimizers.scale:SCALE",
            matrix_params="all",
            step_transient_fn=_matrix_rule_transient,
        ),
    )
}


def register(spec: MethodSpec) -> MethodSpec:
    """Adds `spec` to `METHODS` (a new method, or a test's toy one); an existing name is an error."""
    if spec.name in METHODS:
        raise ValueError(f"optimizer {spec.name!r} is already registered")
    METHODS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Removes `name` from `METHODS` (for tests that register a toy method)."""
    del METHODS[name]


def method_spec(name: str) -> MethodSpec:
    """The registry row for `name`; ValueError naming the choices otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(sorted(METHODS))}") from None


def get_optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """Returns the class registered under `name`; ValueError naming the choices otherwise."""
    return method_spec(name).cls


def build_optimizer(
    name: str, param_groups: Iterable[dict[str, Any]], **kwargs: Any
) -> torch.optim.Optimizer:
    """Constructs optimizer `name` over `param_groups` (torch format) with defaults `kwargs`
    (plus the method's own defaults from the registry, e.g. torch AdamW's foreach path)."""
    return method_spec(name).build(param_groups, **kwargs)


def state_bytes(name: str, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
    """Exact bytes of optimizer state one parameter of `shape`/`dtype` holds under method `name`
    (the registry's formula: each class's documented and tested ``state_bytes``)."""
    return method_spec(name).state_bytes(shape, group, dtype)


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Sums numel * element_size over the distinct tensors held in `optimizer.state`, on this process.

    A tensor that several parameters' states refer to (bitsandbytes' quantile maps) is held once
    and counted once (same start address, dtype and size). A sharded (FSDP2 DTensor) state tensor
    counts its local shard only: the bytes this rank holds.
    """

    inner = getattr(optimizer, "optimizer", optimizer)
    total, seen = 0, set()
    for st in inner.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                v = local(v)
                key = (v.device, v.data_ptr(), v.dtype, v.numel())
                if v.numel() and key in seen:
                    continue
                seen.add(key)
                total += v.numel() * v.element_size()
    return total


def __getattr__(name: str) -> Any:
    # `from optimizers import GaLoreAdamW`: every registered class by its own name, imported lazily.
    for spec in METHODS.values():
        if spec.class_name == name and not spec.target.startswith("torch."):
            return spec.cls
    raise AttributeError(f"module 'optimizers' has no attribute {name!r}")


__all__ = [
    "FACTOR_PAIRS_KEY",
    "METHODS",
    "PROJECTION_GROUP_EXTRAS",
    "MethodSpec",
    "Restarts",
    "assign_owners",
    "build_optimizer",
    "get_optimizer_class",
    "measured_state_bytes",
    "method_spec",
    "recovery_factor",
    "refactorize_",
    "register",
    "reset_",
    "shard_rows",
    "state_bytes",
    "unregister",
    "whole_cost",
]
