"""`ProjectedAdam`: Adam on a projected gradient, the shared base of GaLore, Fira and APOLLO.

It owns everything that is not the method's own update rule: param-group parsing and
eligibility, defaults, the basis policy and its refresh schedule, the (low-rank) Adam moments,
the AdamW convention, zero-gradient dummy steps, exact resume, telemetry and the state-memory
formula. A method writes one hook, `ProjectedAdam._projected_update`, that turns the low-rank Adam
output into the full-size update direction (GaLore: alpha back(N); Fira: + the scaled residual;
APOLLO: the channel-scaled raw gradient); everything else it declares as data.

Public, stable API (other modules build on it):

* Param groups are torch's. A group that has ``rank`` (galore-torch / apollo-torch / fira format:
  ``rank``, ``update_proj_gap``, ``proj_type``, ``scale`` (Fira: ``alpha``)) is projected; any other
  group runs plain AdamW. At construction each group gets ``group["project"] = True/False`` and
  every missing key is filled from the defaults; step() never changes ``param_groups``.
* Projected-group keys and defaults (`ProjectedAdam.PROJECTION_DEFAULTS`): ``rank`` (r, required),
  ``update_proj_gap`` (T, 200), ``proj_type`` ("std"), ``scale`` (alpha, 1.0), ``basis``
  ("randomized_svd" | "svd" | "random" | "identity"), ``oversample`` (p), ``power_iters`` (q),
  ``warm_start`` (True), ``seed`` (0); ``random_stream`` ("mix") where the method has more than
  one seeded random stream (APOLLO). Every group also has ``lr`` (eta, 1e-3), ``betas``
  (beta1, beta2 = 0.9, 0.999), ``eps`` (epsilon, 1e-6), ``weight_decay`` (lambda, 0.0),
  ``correct_bias`` (True) and ``adam_convention`` ("reference" | "torch", see below).
* State per parameter (tensors and python numbers only; torch's key names, the module constants
  `STEP`, `EXP_AVG`, `EXP_AVG_SQ`, `BASIS`, `REFRESH`, `SEED`): ``step`` (int t), ``exp_avg`` /
  ``exp_avg_sq`` (M, V: low-rank shape for projected params, the parameter's shape otherwise;
  parameter dtype), and for projected params ``basis`` (P, parameter dtype, absent for the
  "random" method which is regenerated), ``refresh`` (int k, bases computed so far) and ``seed``
  (int). Methods add keys (`ProjectedAdam.EXTRA_STATE`: Fira's ``residual_norm``).
* Telemetry: ``refresh_count`` (int), ``refresh_seconds`` (float), ``failed_refreshes`` (int),
  cumulative since construction (not saved in the state dict).
* ``state_bytes(shape, group, dtype)`` classmethod: exact bytes of tensor state after >= 1 step;
  works on a plain dict group (missing keys take the defaults; projected iff it has ``rank``).
* ``resolve_group(group)`` classmethod: a plain dict group with ``project`` and defaults filled.
* ``fused`` constructor option (as torch.optim.AdamW's): None uses torch's fused Adam kernel
  wherever it applies, True requires it (an error where it cannot run), False never uses it.

What a method supplies (GaLore, Fira and APOLLO are each one file of this):

* ``_projected_update(s: ProjectedStep) -> (D, alpha)``: the one required hook. D is the
  full-size direction, applied as W <- W - eta_t alpha D (plus weight decay); D may also be a
  factor pair (A, B) standing for D = A B, applied by one fused ``addmm_`` with no m x n temporary.
* Data, as class attributes (extend by copying): ``PROJECTION_DEFAULTS`` and ``ADAM_DEFAULTS``
  (keys and defaults), ``SCALE_KEY`` (the key holding alpha), ``ALIASES`` (a key that takes
  another key's value when missing: Fira's ``alpha`` <- ``scale``), ``CHOICES`` (allowed values per
  key), ``FIXED_RANK`` (APOLLO-Mini's 1), ``EXTRA_STATE`` (0-d state tensors by key and dtype).
* Moment storage, ``MOMENTS``: an `AdamMoments` class (init / update / nbytes). The default keeps
  M and V in the parameter dtype and advances them with `adam_update`; GaLore-8bit and the 4-bit
  methods (optimizers/moments_4bit.py) swap in quantised storage.
* Basis policy: `ComputedBasis` (the SVD family and the identity: recomputed from G when due and
  stored) or, for ``basis="random"``, a `SeededRandomBasis` from ``RANDOM_STREAMS`` (regenerated
  from integers every step, never stored; APOLLO adds apollo-torch's seed chain).

Schedule (galore-torch's): on a parameter's own pre-increment counter t, the basis is recomputed
when t % T == 0 (so on steps 1, T + 1, 2T + 1, ... counting from 1) or when none exists yet.
Moments are kept across refreshes (standard GaLore). A refresh that fails (non-finite gradient
or a failed decomposition, see `projection.compute_basis`) keeps the previous basis until the
next scheduled refresh; when there is no previous basis yet the parameter is skipped for that
step without advancing t, so the next step retries. randomized_svd bases are warm-started from
the previous basis and their random sketch is drawn from (state ``seed``, refresh k), so runs and
resumed runs are bitwise reproducible.

Adam conventions (``adam_convention``):

* "reference" (default; galore-torch, fira and apollo-torch, i.e. the old transformers AdamW):
  M <- beta1 M + (1 - beta1) R;  V <- beta2 V + (1 - beta2) R^2;  N = M / (sqrt(V) + eps);
  W <- W - eta_t D(N);  then W <- W - eta lambda W;  with eta_t = eta sqrt(1 - beta2^t) / (1 - beta1^t).
* "torch" (torch.optim.AdamW): W <- W (1 - eta lambda) first; N = M / (sqrt(V / (1 - beta2^t)) + eps),
  eta_t = eta / (1 - beta1^t). The two differ only in where eps enters and in the (second-order)
  order of weight decay; with the identity basis "torch" reproduces torch.optim.AdamW.

A parameter whose gradient is entirely zero in a step (distributed checkpoint loaders step once on
zero gradients to materialise state) gets its state allocated (zeros) but is otherwise skipped: no
basis is computed, its counter t does not advance, the weight is not touched. The check costs one
host synchronisation per step for all parameters together.

FSDP2 (parameters and gradients are DTensors sharded across ranks): non-projected parameters
run AdamW on their local shards (moments sharded like the parameter) when the moment storage
allows it (`AdamMoments.steps_shards`: element-wise moments, or 8-bit rows of whole blocks). A
projected parameter's step (and any other dense one) runs on the whole matrix, once, on the parameter's owner rank (``whole_matrix="owner"``, the
default; optimizers/_owners.py): the owner receives the row shards of G and W, computes the basis
and the update exactly as a single process would (Fira's and APOLLO's norms over the whole
matrix), keeps that parameter's state (other ranks hold none for it) and sends every rank its rows
of the new W. ``whole_matrix="gather"`` instead all-gathers G and W on every rank, which repeats
the step N times and keeps the state whole on every rank (`ProjectedAdam._whole_step_sharded`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from optimizers import projection as proj
from optimizers._adam import (
    ADAM_CONVENTIONS,
    EXP_AVG,
    EXP_AVG_SQ,
    STEP,
    AdamMoments,
    _check_adam,
    _decay,
    adam_update,
    fusable,
)
from optimizers._owners import DEFAULT_BUCKET_BYTES, OwnerPlaced
from optimizers._sharded import is_dtensor as _is_dtensor
from optimizers.bases import (
    BASIS,
    COMPUTED_BASIS,
    REFRESH,
    SEED,
    BasisPolicy,
    ComputedBasis,
    ProjectedStep,
    SeededRandomBasis,
    refresh_due,
)
from optimizers.writer import written

Direction = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""D, a full-size tensor, or a factor pair (A, B) standing for D = A B."""


# ---------------------------------------------------------------------- the optimizer


class ProjectedAdam(OwnerPlaced, torch.optim.Optimizer):
    """AdamW whose groups with ``rank`` run Adam on a projected gradient R = proj(G) (base class).

    Args:
        params: parameters or torch param groups; groups with ``rank`` are projected.
        lr: eta, learning rate.
        betas: (beta1, beta2), Adam's moment coefficients.
        eps: epsilon, added to sqrt(V) (placement per `adam_convention`).
        weight_decay: lambda, decoupled weight decay.
        correct_bias: apply Adam's bias correction (1 - beta^t).
        adam_convention: "reference" (galore-torch numerics) or "torch" (torch.optim.AdamW numerics).
        fused: torch's fused Adam kernel: None where it applies, True always (an error where it
            cannot run), False never (see `adam_update`).
        whole_matrix: under FSDP2, where a sharded parameter's whole-matrix step runs: "owner"
            (once, on its owner rank, which alone holds its state) or "gather" (on every rank).
        bucket_bytes: "owner": the most whole W and G bytes one owner gathers per collective.
        **options: defaults for projected groups' keys (`PROJECTION_DEFAULTS`), e.g.
            ``basis="svd"``, or for a method's extra every-group keys (`ADAM_DEFAULTS`); a
            group's own value wins.
    """

    #: Keys filled into projected groups (those with ``rank``) when missing. Methods extend it.
    PROJECTION_DEFAULTS: ClassVar[dict[str, Any]] = {
        "update_proj_gap": 200,
        "proj_type": "std",
        "scale": 1.0,
        "basis": "randomized_svd",
        "oversample": proj.DEFAULT_OVERSAMPLE,
        "power_iters": proj.DEFAULT_POWER_ITERS,
        "warm_start": True,
        "seed": 0,
    }
    #: Defaults of the Adam keys every group gets (the reference packages' signature).
    ADAM_DEFAULTS: ClassVar[dict[str, Any]] = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-6,
        "weight_decay": 0.0,
        "correct_bias": True,
        "adam_convention": "reference",
    }
    #: Group key holding alpha, the factor on the projected-back update (Fira calls it ``alpha``).
    SCALE_KEY: ClassVar[str] = "scale"
    #: key -> source: a projected group missing `key` takes its `source` key's value.
    ALIASES: ClassVar[dict[str, str]] = {}
    #: Allowed values of projected groups' keys.
    CHOICES: ClassVar[dict[str, tuple[Any, ...]]] = {"proj_type": proj.PROJ_TYPES, "basis": proj.METHODS}
    #: The only rank the method runs at (APOLLO-Mini: 1), also given to a ``project=True`` group
    #: without one; None: any rank, required.
    FIXED_RANK: ClassVar[int | None] = None
    #: 0-d state tensors a method keeps per projected parameter: key -> dtype (None: the
    #: parameter's), zeros at first; each costs its itemsize in `state_bytes`.
    EXTRA_STATE: ClassVar[dict[str, torch.dtype | None]] = {}
    #: Moment storage (init / update / bytes of ``exp_avg`` and ``exp_avg_sq``).
    MOMENTS: ClassVar[type[AdamMoments]] = AdamMoments
    #: Whether the update reads the gradient only through R = proj(G) (GaLore), so that one step's
    #: micro-batch gradients may be summed as R_k = proj(G_k) in an r x max(m, n) accumulator
    #: (`accumulation_basis`, the trainer's ``train.update_in_backward``). Fira (its residual
    #: G - back(R)) and APOLLO (its channel scaling of G itself) read G: False.
    PROJECTED_GRAD_ONLY: ClassVar[bool] = False
    #: Seeded random streams of ``basis="random"`` by the group's ``random_stream`` ("mix" when
    #: the group has none).
    RANDOM_STREAMS: ClassVar[dict[str, SeededRandomBasis]] = {"mix": SeededRandomBasis()}

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        correct_bias: bool | None = None,
        adam_convention: str | None = None,
        fused: bool | None = None,
        whole_matrix: str = "owner",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        **options: Any,
    ) -> None:
        self._init_owners(whole_matrix, bucket_bytes)
        given = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "correct_bias": correct_bias,
            "adam_convention": adam_convention,
        }
        defaults = {**self.ADAM_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
        for k in list(options):
            if k in self.ADAM_DEFAULTS:  # a method's own every-group option (8-bit: min_8bit_size)
                defaults[k] = options.pop(k)
        defaults["betas"] = tuple(defaults["betas"])
        _check_adam(defaults)
        unknown = set(options) - set(self.PROJECTION_DEFAULTS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown option(s) {sorted(unknown)}; "
                f"projection options are {sorted(self.PROJECTION_DEFAULTS)}"
            )
        # Set before super().__init__, which calls add_param_group for every group.
        self._projection_defaults = {**self.PROJECTION_DEFAULTS, **options}
        self.moments = self.MOMENTS(fused=fused)
        self.refresh_stats = proj.RefreshStats()
        self._refreshed_ahead: dict[int, int] = {}  # id(p) -> the step whose basis is ready
        super().__init__(params, defaults)

    @property
    def refresh_count(self) -> int:
        """Bases computed (or random bases moved to) since construction."""
        return self.refresh_stats.count

    @property
    def refresh_seconds(self) -> float:
        """Wall time spent on those refreshes."""
        return self.refresh_stats.seconds

    @property
    def failed_refreshes(self) -> int:
        """Refreshes that kept the previous basis (non-finite gradient, failed decomposition)."""
        return self.refresh_stats.failed

    # ------------------------------------------------------------------ groups

    @classmethod
    def _is_projected(cls, group: dict[str, Any]) -> bool:
        if "project" in group:
            return bool(group["project"])
        return group.get("rank") is not None

    @classmethod
    def _fill_projected(cls, group: dict[str, Any], defaults: dict[str, Any]) -> None:
        """Fills a projected group's missing keys in place: the fixed rank, aliases, defaults."""
        if group.get("rank") is None and cls.FIXED_RANK is not None:
            group["rank"] = cls.FIXED_RANK
        for key, source in cls.ALIASES.items():
            if key not in group and source in group:
                group[key] = group[source]
        for k, v in defaults.items():
            group.setdefault(k, v)

    @classmethod
    def resolve_group(cls, group: dict[str, Any]) -> dict[str, Any]:
        """A copy of a plain dict group with ``project`` decided and every default filled.

        This is what construction records in each group; `state_bytes` uses it so that it works
        without building an optimizer.
        """
        g = {k: v for k, v in group.items() if k != "params"}
        for k, v in cls.ADAM_DEFAULTS.items():
            g.setdefault(k, v)
        g["project"] = cls._is_projected(g)
        if g["project"]:
            cls._fill_projected(g, dict(cls.PROJECTION_DEFAULTS))
        return g

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, then records eligibility and fills projection defaults."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["betas"] = tuple(group["betas"])
        _check_adam(group)
        group["project"] = self._is_projected(group)
        if group["project"]:
            self._fill_projected(group, self._projection_defaults)
            self._check_projected(group)

    def _check_projected(self, group: dict[str, Any]) -> None:
        """Checks a projected group's options (the class's data) and that each param is 2-D."""
        name = type(self).__name__
        if group.get("rank") is None:
            raise ValueError("a group with project=True needs a 'rank'")
        if int(group["rank"]) < 1:
            raise ValueError(f"rank must be a positive int, got {group['rank']!r}")
        if self.FIXED_RANK is not None and int(group["rank"]) != self.FIXED_RANK:
            raise ValueError(f"{name} is rank {self.FIXED_RANK}, got rank={group['rank']!r}")
        if int(group["update_proj_gap"]) < 1:
            raise ValueError(f"update_proj_gap must be a positive int, got {group['update_proj_gap']!r}")
        choices = {**self.CHOICES, "random_stream": tuple(self.RANDOM_STREAMS)}
        for key, allowed in choices.items():
            value = group.get(key, "mix") if key == "random_stream" else group[key]
            if value not in allowed:
                raise ValueError(f"{key} must be one of {allowed}, got {value!r}")
        if group["basis"] == "random" and group["proj_type"] == "full":
            raise ValueError("basis='random' does not support proj_type='full'")
        if float(group[self.SCALE_KEY]) < 0:
            raise ValueError(f"{self.SCALE_KEY} must be >= 0, got {group[self.SCALE_KEY]!r}")
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(
                    f"{name}: a group with 'rank' holds a parameter of shape {tuple(p.shape)}; "
                    "only 2-D weight matrices can be projected. Put biases, norms and embeddings in a "
                    "group without 'rank' (they then get plain AdamW)."
                )

    @classmethod
    def _basis_policy(cls, group: dict[str, Any]) -> BasisPolicy:
        if group["basis"] != "random":
            return COMPUTED_BASIS
        return cls.RANDOM_STREAMS[group.get("random_stream", "mix")]

    # ------------------------------------------------------------------ state

    @staticmethod
    def _side(p: torch.Tensor, group: dict[str, Any]) -> str:
        return proj.choose_side(tuple(p.shape), group["proj_type"])

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], index: int) -> None:
        state[STEP] = 0
        if not group["project"]:
            # FSDP2 where the moments allow (element-wise, or 8-bit rows of whole blocks): sharded
            # like the parameter, each rank steps its shard.
            sharded = _is_dtensor(p) and self.moments.steps_shards(tuple(p.shape))
            self.moments.init(state, p, None if sharded else tuple(p.shape), group)
            return
        side = self._side(p, group)
        self._basis_policy(group).init_state(state, p, group, side, index)
        self.moments.init(
            state, p, proj.low_rank_shape(tuple(p.shape), group["rank"], side, group["basis"]), group
        )
        for key, dtype in self.EXTRA_STATE.items():
            state[key] = torch.zeros((), dtype=dtype or p.dtype, device=p.device)

    def refresh_basis_ahead(
        self, p: torch.Tensor, group: dict[str, Any], grad: torch.Tensor
    ) -> tuple[torch.Tensor, str] | None:
        """Refreshes `p`'s due basis now, from `grad` (the first micro-batch's gradient of an
        accumulating step under updates in backward, ``train.in_backward_refresh=first_micro``), and
        returns (P, side) to sum the step's micro-batch gradients in; the step then projects with
        that P and does not refresh again. None where `accumulation_basis` would refuse for another
        reason than the refresh, or the refresh failed (the step then refreshes from the summed G).
        """
        if not (self.PROJECTED_GRAD_ONLY and group["project"]) or _is_dtensor(p):
            return None
        policy = self._basis_policy(group)
        if not isinstance(policy, ComputedBasis):
            return None
        state = self.state[p]
        if not state:
            flat = [q for g in self.param_groups for q in g["params"]]
            self._init_state(p, group, state, next(i for i, q in enumerate(flat) if q is p))
        side = self._side(p, group)
        if refresh_due(state, group):
            done = state[REFRESH]
            policy.basis(p, grad, state, group, side, self.refresh_stats)
            if state[REFRESH] == done:
                return None
            self._refreshed_ahead[id(p)] = int(state[STEP])
        return state[BASIS], side

    def accumulation_basis(self, p: torch.Tensor, group: dict[str, Any]) -> tuple[torch.Tensor, str] | None:
        """(P, side) in which the micro-batch gradients of `p`'s next step may be summed, or None.

        Summing R_k = proj(G_k) is exact in real arithmetic when the next step projects with the
        same stored, orthonormal P (proj(back(sum R_k)) = sum R_k): a method whose update reads G
        only through R (`PROJECTED_GRAD_ONLY`), a stored (`ComputedBasis`) basis that exists and is
        not due for a refresh, and a plain (not FSDP2-sharded) tensor. Otherwise None: the caller
        keeps a full accumulator (a refresh needs the whole summed G).
        """
        state = self.state.get(p)
        if not (self.PROJECTED_GRAD_ONLY and group["project"] and state) or _is_dtensor(p):
            return None
        if not isinstance(self._basis_policy(group), ComputedBasis) or refresh_due(state, group):
            return None
        return state[BASIS], self._side(p, group)

    # ------------------------------------------------------------------ numerics

    def _projected_update(self, s: ProjectedStep) -> tuple[Direction, float]:
        """The method's update rule: the full-size direction D and a factor alpha.

        Applied as W <- W - eta_t alpha D with the convention's weight decay (`_apply_update`).
        D may be a factor pair (A, B) standing for D = A B (GaLore: (N, P) on the right side),
        which is applied by one fused ``addmm_`` with no m x n temporary.

        Args:
            s: this parameter's step: W, G, R, N, P, the side, its state and group.
        """
        raise NotImplementedError(f"{type(self).__name__} must define _projected_update")

    def _adam(
        self, x: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> tuple[torch.Tensor, float]:
        """Counts the step (t <- t + 1) and advances the moments with x = R or G: (N, eta_t)."""
        state[STEP] += 1
        return self.moments.update(state, x, group)

    def _dense_step(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """Plain AdamW for a non-projected parameter."""
        norm, step_size = self._adam(grad, state, group)
        self._apply_update(p, norm, step_size, group)

    def _projected_step(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """P from the basis policy, R = proj(G), Adam on R, then the method's update."""
        side = self._side(p, group)
        if self._refreshed_ahead.pop(id(p), None) == state[STEP]:
            basis = state[BASIS]  # refreshed from this step's first micro-batch (`refresh_basis_ahead`)
        else:
            basis = self._basis_policy(group).basis(p, grad, state, group, side, self.refresh_stats)
        if basis is None:
            return
        low = proj.project(grad, basis, side)
        norm, step_size = self._adam(low, state, group)
        update, alpha = self._projected_update(ProjectedStep(p, grad, low, norm, basis, side, state, group))
        self._apply_update(p, update, step_size, group, alpha)

    @staticmethod
    def _apply_update(
        p: torch.Tensor, update: Direction, step_size: float, group: dict[str, Any], alpha: float = 1.0
    ) -> None:
        """W <- W - eta_t alpha D, with decoupled weight decay before (torch) or after (reference),
        written once (`optimizers.writer.written`)."""
        with written(p) as w:
            _decay(w, group, before=True)
            if isinstance(update, tuple):
                w.addmm_(update[0].to(w.dtype), update[1].to(w.dtype), alpha=-step_size * alpha)
            else:
                w.add_(update, alpha=-step_size * alpha)
            _decay(w, group, before=False)

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimisation step over all parameters that have a gradient (placed by
        `OwnerPlaced._placed_step`: under FSDP2 a projected weight, and any weight whose moments
        do not allow its row shards (`AdamMoments.steps_shards`), steps whole, on its owner rank or
        gathered on every rank, so that the basis, Fira's and APOLLO's norms and the 8-bit blocks
        are a single process's).

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).
        """
        return self._placed_step(  # bases, projections and norms at full fp32 (`fp32_math`)
            closure,
            steps_whole=self._steps_whole,
            step_one=self._step_one,
            init_state=self._init_state,
            fp32_math=True,
        )

    def _steps_whole(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        return bool(group["project"]) or not self.moments.steps_shards(tuple(p.shape))

    def _step_one(
        self, w: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any], index: int
    ) -> None:
        (self._projected_step if group["project"] else self._dense_step)(w, g, state, group)

    def _whole_step_params(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """The sharded parameters whose step needs the whole matrix, in the optimizer's order."""
        return [
            (p, g)
            for g in self.param_groups
            for p in g["params"]
            if _is_dtensor(p) and self._steps_whole(g, p)
        ]

    # ------------------------------------------------------------------ checkpoint

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, keeping each saved tensor's own dtype.

        torch casts every floating-point state tensor to its parameter's dtype on load; our state
        may hold other dtypes on purpose (8-bit moments, their fp32 scales, APOLLO's fp32 norm), so
        those are put back exactly as saved (moved to the parameter's device).
        """
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        keep: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        for pid, p in zip(saved_ids, params):
            for k, v in state_dict["state"].get(pid, {}).items():
                if torch.is_tensor(v) and k != STEP and v.dtype != p.dtype:
                    keep.append((p, k, v))
        super().load_state_dict(state_dict)
        for p, k, v in keep:
            self.state[p][k] = v.to(device=p.device)
        for g in self.param_groups:  # a weight that stepped whole when the checkpoint was written
            for p in g["params"]:
                if self.state.get(p) and not g["project"] and _is_dtensor(p) and not self._steps_whole(g, p):
                    self.moments.adopt_whole(self.state[p], p)

    # ------------------------------------------------------------------ memory

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Exact bytes of tensor state for one parameter after >= 1 step (python ints cost 0).

        With s the itemsize of `dtype`, k = min(r, m, n) (k = r for the random method) and the
        side from `proj_type` (std: right if m >= n else left), for the default moment storage:

        * not projected (no ``rank``): 2 s prod(shape)                       (M, V)
        * right side:  2 s m k + s k n     (M, V are m x k; P is k x n)
        * left side:   2 s k n + s m k     (M, V are k x n; P is m x k)
        * full:        2 s k^2 + s k (m + n)
        * basis "random": the P term is 0 (regenerated, never stored).

        plus the itemsize of each `EXTRA_STATE` scalar; `MOMENTS` may replace the moments' term
        (see the methods' docstrings).

        Args:
            shape: the parameter's shape.
            group: a param group (a plain dict is fine; missing keys take the defaults).
            dtype: the parameter's dtype.
        """
        g = cls.resolve_group(group)
        shape = tuple(shape)
        if not g["project"]:
            return cls.MOMENTS.nbytes(math.prod(shape), dtype, g, shape=shape)
        side = proj.choose_side(shape, g["proj_type"])
        low = proj.low_rank_shape(shape, int(g["rank"]), side, g["basis"])
        extra = sum((dt or dtype).itemsize for dt in cls.EXTRA_STATE.values())
        basis = cls._basis_policy(g).nbytes(shape, g, side, dtype)
        return cls.MOMENTS.nbytes(math.prod(low), dtype, g, shape=low) + basis + extra

    @classmethod
    def part_state_bytes(
        cls, shape: tuple[int, ...], part: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype
    ) -> int:
        """Bytes of state a rank holds for its row shard `part` of a non-projected weight of
        `shape` that steps its shards under FSDP2 (`AdamMoments.steps_shards`)."""
        g = cls.resolve_group(group)
        return cls.MOMENTS.part_nbytes(math.prod(shape), math.prod(part), dtype, g)


__all__ = [
    "ADAM_CONVENTIONS",
    "BASIS",
    "EXP_AVG",
    "EXP_AVG_SQ",
    "REFRESH",
    "SEED",
    "STEP",
    "AdamMoments",
    "BasisPolicy",
    "ComputedBasis",
    "Direction",
    "ProjectedAdam",
    "ProjectedStep",
    "SeededRandomBasis",
    "adam_update",
    "fusable",
    "refresh_due",
]
