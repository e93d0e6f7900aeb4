"""`MatrixOptimizer`: a whole-matrix rule for some 2-D weights, AdamW for the rest (shared base).

Muon, SWAN, SinkGD and SCALE each turn a weight's gradient G (or a momentum of it) into an update
direction by an operation on the whole matrix: an orthogonalisation, a whitening, row and column
normalisations. Everything else is the same and lives here: param-group parsing, AdamW for the
other parameters, the zero-gradient dummy step, exact resume and FSDP2 owner placement. A method
writes two hooks, `MatrixOptimizer._init_matrix_state` (its state keys) and
`MatrixOptimizer._matrix_update` (the rule), plus `MatrixOptimizer.matrix_state_bytes`.

Param groups are torch's. A group with ``matrix=True`` holds 2-D weights that take the method's
rule; its ``role`` ("hidden": attention/MLP weights, the default; "embedding"; "head") lets a
method treat them differently (SCALE: columns of the embedding, momentum on the head). The
toolkit decides which parameters get such a group once, from the registry
(`optimizers.MethodSpec.matrix_params`, `MethodSpec.matrix_group`). Every other group runs AdamW
with torch.optim.AdamW's numerics: W <- W (1 - eta lambda); M <- beta1 M + (1 - beta1) G;
V <- beta2 V + (1 - beta2) G^2; W <- W - (eta / (1 - beta1^t)) M / (sqrt(V / (1 - beta2^t)) + eps),
with eta the group's ``lr`` (``adam_lr`` when given: the AdamW groups' own learning rate).

State per parameter (tensors and python ints only, loadable with ``weights_only=True``):
``step`` (int t, steps with a nonzero gradient), AdamW's ``exp_avg`` / ``exp_avg_sq`` (parameter
dtype and shape) for the other parameters, and the method's keys for matrix weights.

A parameter whose whole gradient is zero in a step (a distributed checkpoint loader's dummy step)
gets its state allocated (zeros) but is otherwise skipped: t does not advance, W is not touched.

FSDP2 (DTensor parameters sharded by rows): AdamW parameters step on their local shards (state
sharded like the parameter). A matrix weight steps whole, once, on its owner rank
(``whole_matrix="owner"``, optimizers/_owners.py), which alone holds its state: the owner gets the
row shards of W and G, runs exactly the single-process step and sends every rank its rows of the
new W, so the result is bitwise that of one process given the same gradients and per-rank state
is about 1/N of the total. ``whole_matrix="gather"`` all-gathers W and G on every rank instead.
A method whose rule is row-local for some roles (`MatrixOptimizer.ROW_LOCAL_ROLES`) steps those on
their row shards, like AdamW (`MatrixOptimizer.steps_whole`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from optimizers._adam import adamw_step_
from optimizers._owners import DEFAULT_BUCKET_BYTES, OwnerPlaced
from optimizers._sharded import is_dtensor, local, nonzero_flags
from optimizers.precision import full_fp32

STEP = "step"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"

#: The roles a matrix group may have.
ROLES: tuple[str, ...] = ("hidden", "embedding", "head")


class MatrixOptimizer(OwnerPlaced, torch.optim.Optimizer):
    """A whole-matrix rule for ``matrix=True`` groups, AdamW for the others (base class).

    Args:
        params: parameters or torch param groups.
        lr: eta, the learning rate of the matrix rule (and of AdamW unless `adam_lr` is given).
        betas: AdamW's (beta1, beta2).
        eps: AdamW's epsilon.
        weight_decay: lambda, decoupled weight decay (W <- W (1 - eta lambda) before the update).
        adam_lr: the AdamW groups' learning rate when it differs from the rule's (SCALE's
            ``adam_lr``); None: `lr`. A group's own ``lr`` wins.
        whole_matrix: under FSDP2, "owner" (each matrix weight steps once, on its owner rank) or
            "gather" (on every rank).
        bucket_bytes: "owner": the most whole W and G bytes one owner gathers per collective.
        **options: the method's own options (`MATRIX_DEFAULTS`), defaults for every group.
    """

    #: The method's options and their defaults (every group gets them).
    MATRIX_DEFAULTS: ClassVar[dict[str, Any]] = {}
    #: Roles whose rule is row-local (each row's update depends on that row only, SCALE's row
    #: normalisation): under FSDP2 they step on their row shards, state sharded like the weight,
    #: with no exchange. Every other matrix steps whole on its owner rank.
    ROW_LOCAL_ROLES: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adam_lr: float | None = None,
        whole_matrix: str = "owner",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        **options: Any,
    ) -> None:
        unknown = set(options) - set(self.MATRIX_DEFAULTS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown option(s) {sorted(unknown)}; "
                f"its options are {sorted(self.MATRIX_DEFAULTS)}"
            )
        if lr < 0.0 or (adam_lr is not None and adam_lr < 0.0):
            raise ValueError(f"Invalid learning rate: lr={lr}, adam_lr={adam_lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Invalid betas {betas}: each must be in [0.0, 1.0)")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"Invalid eps {eps} or weight_decay {weight_decay}: must be >= 0")
        self._init_owners(whole_matrix, bucket_bytes)
        self._adam_lr = adam_lr
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "adam_lr": adam_lr,
        }
        defaults.update({**self.MATRIX_DEFAULTS, **options})
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group; records ``matrix`` (bool) and, for matrix groups, ``role``;
        an AdamW group without its own ``lr`` takes ``adam_lr`` when one was given."""
        if not param_group.get("matrix", False) and self._adam_lr is not None:
            param_group.setdefault("lr", self._adam_lr)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["betas"] = tuple(group["betas"])
        group["matrix"] = bool(group.get("matrix", False))
        if group["matrix"]:
            group.setdefault("role", "hidden")
            if group["role"] not in ROLES:
                raise ValueError(f"role must be one of {ROLES}, got {group['role']!r}")
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"{type(self).__name__}: a matrix group holds a parameter of shape "
                        f"{tuple(p.shape)}; only 2-D weights take the matrix rule (put vectors in a "
                        "group without 'matrix': they get AdamW)"
                    )
            self._check_matrix_group(group)

    def _check_matrix_group(self, group: dict[str, Any]) -> None:
        """Validates a matrix group's method options (a method overrides it)."""

    # ------------------------------------------------------------------ the method's hooks

    def _init_matrix_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Allocates the method's state keys for matrix weight `p` (whole-shaped and plain; an
        FSDP2 shard, a DTensor, for a row-local role)."""

    def _matrix_update(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """Applies the rule to the whole weight `p` with gradient `g` (plain tensors; a row-local
        role's local row shards, whose state tensors are read through `local`), in place;
        ``state["step"]`` has already been advanced."""
        raise NotImplementedError(f"{type(self).__name__} must define _matrix_update")

    @classmethod
    def matrix_state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Bytes of the method's state for one matrix weight (0: stateless)."""
        return 0

    # ------------------------------------------------------------------ state

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        state[STEP] = 0
        if group["matrix"]:
            self._init_matrix_state(p, group, state)
        else:  # an FSDP2 shard's moments stay DTensors sharded like it
            state[EXP_AVG] = torch.zeros_like(p)
            state[EXP_AVG_SQ] = torch.zeros_like(p)

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Exact bytes of tensor state for one parameter after >= 1 step (python ints cost 0):
        ``matrix_state_bytes`` for a matrix weight (a group with ``matrix`` true), AdamW's
        ``2 s prod(shape)`` (M, V; s the itemsize) otherwise."""
        if group.get("matrix", False):
            return int(cls.matrix_state_bytes(tuple(shape), group, dtype))
        return 2 * math.prod(shape) * dtype.itemsize

    # ------------------------------------------------------------------ step

    def _step_one(
        self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        state[STEP] += 1
        if group["matrix"]:
            self._matrix_update(p, g, state, group)
        else:
            beta1, beta2 = group["betas"]
            m, v = local(state[EXP_AVG]), local(state[EXP_AVG_SQ])
            adamw_step_(
                p, g, m, v, state[STEP], group["lr"], beta1, beta2, group["eps"], group["weight_decay"]
            )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimisation step over all parameters that have a gradient (placed by
        `OwnerPlaced._placed_step`: under FSDP2 a matrix whose rule is not row-local steps whole)."""
        return self._placed_step(  # orthogonalisation and whitening at full fp32 (`fp32_math`)
            closure,
            steps_whole=lambda group, p: self.steps_whole(group),
            step_one=lambda w, g, state, group, index: self._step_one(w, g, state, group),
            init_state=lambda ref, group, state, index: self._init_state(ref, group, state),
            fp32_math=True,
        )

    # ------------------------------------------------------------------ FSDP2

    def _whole_step_params(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """The sharded matrix weights (they step whole), in the optimizer's order."""
        return [
            (p, g) for g in self.param_groups for p in g["params"] if self.steps_whole(g) and is_dtensor(p)
        ]

    @classmethod
    def steps_whole(cls, group: dict[str, Any]) -> bool:
        """Whether a group's weights need the whole matrix (a matrix group whose role is not
        row-local): under FSDP2 they step on owner ranks, which alone hold their state."""
        return bool(group.get("matrix", False)) and group.get("role", "hidden") not in cls.ROW_LOCAL_ROLES

    # ------------------------------------------------------------------ checkpoint

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, keeping each saved tensor's own dtype (a method may keep state
        in another dtype than its parameter's on purpose)."""
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        keep = [
            (p, k, v)
            for pid, p in zip(saved_ids, params)
            for k, v in state_dict["state"].get(pid, {}).items()
            if torch.is_tensor(v) and v.dtype != p.dtype
        ]
        super().load_state_dict(state_dict)
        for p, k, v in keep:
            self.state[p][k] = v.to(device=p.device)


@full_fp32()
def newton_schulz_orthogonalise(
    x: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Keller Jordan's quintic Newton-Schulz iteration towards the polar factor U V^T of x = U S V^T
    (as torch.optim.Muon runs it, in bfloat16): X <- x / max(||x||_F, eps) on the wide side, then
    `steps` times A = X X^T, X <- a X + (b A + c A^2) X. Its fixed point is not exactly 1: the
    singular values end up in roughly [0.7, 1.2], which is what Muon uses."""
    a, b, c = coefficients
    y = x.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        y = y.T
    y = y.div(y.norm().clamp(min=eps))
    for _ in range(steps):
        gram = y @ y.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.addmm(y, poly, y, beta=a)
    return y.T if tall else y


__all__ = ["ROLES", "MatrixOptimizer", "newton_schulz_orthogonalise", "nonzero_flags"]
