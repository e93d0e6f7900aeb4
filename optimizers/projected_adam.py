"""`ProjectedAdam`: the shared base of the gradient-projection optimizers (GaLore, Fira, APOLLO).

It owns everything that is not the method's own update rule: param-group parsing and
eligibility, defaults, the basis-refresh schedule, the (low-rank) Adam moments, the AdamW
convention, zero-gradient dummy steps, exact resume, telemetry and the state-memory formula.
A subclass writes one hook, `_projected_update`, that turns the low-rank Adam output into the
full-size update direction (GaLore: alpha back(N); Fira: + the scaled residual; APOLLO: the
channel-scaled raw gradient).

Public, stable API (other modules build on it):

* Param groups are torch's. A group that has ``rank`` (galore-torch / apollo-torch / fira format:
  ``rank``, ``update_proj_gap``, ``proj_type``, ``scale`` (Fira: ``alpha``)) is projected; any other
  group runs plain AdamW. At construction each group gets ``group["project"] = True/False`` and
  every missing key is filled from the defaults; step() never changes ``param_groups``.
* Projected-group keys and defaults (`PROJECTION_DEFAULTS`): ``rank`` (r, required),
  ``update_proj_gap`` (T, 200), ``proj_type`` ("std"), ``scale`` (alpha, 1.0), ``basis``
  ("randomized_svd" | "svd" | "random" | "identity"), ``oversample`` (p), ``power_iters`` (q),
  ``warm_start`` (True), ``seed`` (0). Every group also has ``lr`` (eta, 1e-3), ``betas``
  (beta1, beta2 = 0.9, 0.999), ``eps`` (epsilon, 1e-6), ``weight_decay`` (lambda, 0.0),
  ``correct_bias`` (True) and ``adam_convention`` ("reference" | "torch", see below).
* State per parameter (tensors and python numbers only; torch's key names):
  ``step`` (int t), ``exp_avg`` / ``exp_avg_sq`` (M, V: low-rank shape for projected params, the
  parameter's shape otherwise; parameter dtype), and for projected params ``basis`` (P, parameter
  dtype, absent for the "random" method which is regenerated), ``refresh`` (int k, bases computed
  so far) and ``seed`` (int). Subclasses may add keys (Fira: ``residual_norm``).
* Telemetry attributes: ``refresh_count`` (int), ``refresh_seconds`` (float), ``failed_refreshes``
  (int): cumulative since construction (not saved in the state dict).
* ``state_bytes(shape, group, dtype)`` classmethod: exact bytes of tensor state after >= 1 step;
  works on a plain dict group (missing keys take the defaults; projected iff it has ``rank``).
* ``resolve_group(group)`` classmethod: a plain dict group with ``project`` and defaults filled.

Subclass hooks (stable; override as needed, call ``super()`` where it says "extend"):

* ``_projected_update(p, grad, low, norm, basis, state, group) -> (D, alpha)``: required; the
  full-size direction, applied as W <- W - eta_t alpha D (plus weight decay) by `_apply_update`.
* ``PROJECTION_DEFAULTS`` / ``ADAM_DEFAULTS`` / ``SCALE_KEY`` class attributes (extend by copying).
* ``_fill_projected(group, defaults)`` (classmethod, extend: aliases such as Fira's alpha),
  ``_validate_projected(group)`` (extend), ``_param_seed(group, index)``,
  ``_init_extra_state(p, group, state)`` and ``_extra_state_bytes(shape, group, dtype)`` (own keys),
  ``_init_moments`` / ``_adam`` / ``_moment_bytes`` (moment storage, e.g. 8-bit),
  ``_current_basis`` / ``_refresh_due`` (basis policy), ``_projected_step`` (the whole projected
  step: basis, project, Adam, update).
* Helpers: ``_side(p, group)``, ``_back(norm, basis, p, group)`` = back(N), ``_adam_math``, ``_decay``,
  ``_apply_update``.

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
run AdamW on their local shards (moments sharded like the parameter). A projected parameter's
step runs on the whole matrix: every rank all-gathers the full gradient and weight, computes the
same basis and update as a single process would (Fira's and APOLLO's norms over the whole
matrix), and keeps its own shard; see `_whole_step_sharded` for the memory and
communication cost. Its projected state is replicated on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from optimizers import projection as proj
from optimizers._sharded import is_dtensor as _is_dtensor
from optimizers._sharded import local, whole, write_whole_

ADAM_CONVENTIONS: tuple[str, ...] = ("reference", "torch")


def _sample(g: torch.Tensor, size: int = 256) -> torch.Tensor:
    """About `size` entries of `g` spread over it (a strided view); `g` itself when it is small
    or not contiguous (a full pass then costs about as much as taking a sample)."""
    n = g.numel()
    if n <= 16 * size or not g.is_contiguous():
        return g
    return g.as_strided((size,), (n // size,))  # one dispatch (a view plus a slice is two)


_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HAS_FUSED_ADAM = hasattr(torch, "_fused_adam_")  # torch.optim.Adam(fused=True)'s kernel


def _fusable(m: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether torch's fused Adam kernel can advance these moments: plain (not DTensor or other
    subclass), contiguous tensors of one float dtype and shape on one CPU or CUDA device."""
    return (
        _HAS_FUSED_ADAM
        and type(m) is type(v) is type(x) is torch.Tensor
        and m.dtype == v.dtype == x.dtype in _FUSED_DTYPES
        and x.device.type in ("cpu", "cuda")  # the kernel itself refuses tensors on two devices
        and m.shape == x.shape
        and x.is_contiguous()  # the kernel reads memory in order: it needs contiguous tensors
        and m.is_contiguous()
        and v.is_contiguous()
    )


def _fused_normalised(
    m: torch.Tensor, v: torch.Tensor, x: torch.Tensor, t: int, group: dict[str, Any], bc1: float, bc2: float
) -> tuple[torch.Tensor, float]:
    """`ProjectedAdam._adam_math` (bias-corrected) in one pass of torch's fused Adam kernel.

    The kernel updates M and V as Adam does and then a "parameter" P by
    P <- P - (lr / bc1) M / (sqrt(V) / sqrt(bc2) + eps'). Starting from P = 0 with
    lr = -bc1 / sqrt(bc2) and eps' = eps / sqrt(bc2) leaves P = M / (sqrt(V) + eps) (the
    reference convention's N); lr = -bc1 and eps' = eps leave the torch convention's N. Three
    dispatches (zeros, the step count, the kernel) instead of seven element-wise passes; this
    matters for small low-rank moments, whose step is dominated by per-operation overhead.
    """
    beta1, beta2 = group["betas"]
    norm = torch.zeros_like(m)
    steps = torch.full((), float(t), dtype=torch.float32, device=m.device)
    if group["adam_convention"] == "torch":
        lr, eps, step_size = -bc1, group["eps"], group["lr"] / bc1
    else:
        root = math.sqrt(bc2)
        lr, eps, step_size = -bc1 / root, group["eps"] / root, group["lr"] * root / bc1
    torch._fused_adam_(
        [norm], [x], [m], [v], [], [steps],
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=0.0, eps=eps, amsgrad=False, maximize=False,
    )  # fmt: skip
    return norm, step_size


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype` (s in the state-memory formulas)."""
    return torch.empty((), dtype=dtype).element_size()


class ProjectedAdam(torch.optim.Optimizer):
    """AdamW whose groups with ``rank`` run Adam on a projected gradient R = proj(G) (base class).

    Args:
        params: parameters or torch param groups; groups with ``rank`` are projected.
        lr: eta, learning rate.
        betas: (beta1, beta2), Adam's moment coefficients.
        eps: epsilon, added to sqrt(V) (placement per `adam_convention`).
        weight_decay: lambda, decoupled weight decay.
        correct_bias: apply Adam's bias correction (1 - beta^t).
        adam_convention: "reference" (galore-torch numerics) or "torch" (torch.optim.AdamW numerics).
        **options: defaults for projected groups' keys (`PROJECTION_DEFAULTS`), e.g.
            ``basis="svd"``, or for a subclass's extra every-group keys (`ADAM_DEFAULTS`); a
            group's own value wins.
    """

    SHARDED_DENSE: ClassVar[bool] = True
    """Under FSDP2, non-projected weights step shard by shard (element-wise moments). A subclass
    whose dense moments are not element-wise sets False: they then step on the whole tensor."""

    #: Keys filled into projected groups (those with ``rank``) when missing. Subclasses extend it.
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
    #: Group key holding alpha, the factor on the projected-back update (Fira calls it ``alpha``).
    SCALE_KEY: ClassVar[str] = "scale"
    #: Defaults of the Adam keys every group gets (the reference packages' signature).
    ADAM_DEFAULTS: ClassVar[dict[str, Any]] = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-6,
        "weight_decay": 0.0,
        "correct_bias": True,
        "adam_convention": "reference",
    }

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        correct_bias: bool | None = None,
        adam_convention: str | None = None,
        **options: Any,
    ) -> None:
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
            if k in self.ADAM_DEFAULTS:  # a subclass's own every-group option (8-bit: min_8bit_size)
                defaults[k] = options.pop(k)
        defaults["betas"] = tuple(defaults["betas"])
        self._check_adam(defaults)
        unknown = set(options) - set(self.PROJECTION_DEFAULTS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown option(s) {sorted(unknown)}; "
                f"projection options are {sorted(self.PROJECTION_DEFAULTS)}"
            )
        # Set before super().__init__, which calls add_param_group for every group.
        self._projection_defaults = {**self.PROJECTION_DEFAULTS, **options}
        self.refresh_count: int = 0
        self.refresh_seconds: float = 0.0
        self.failed_refreshes: int = 0
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ groups

    @staticmethod
    def _check_adam(g: dict[str, Any]) -> None:
        if g["lr"] < 0.0:
            raise ValueError(f"Invalid learning rate: {g['lr']} - should be >= 0.0")
        b1, b2 = g["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"Invalid betas {g['betas']}: each must be in [0.0, 1.0)")
        if g["eps"] < 0.0:
            raise ValueError(f"Invalid epsilon value: {g['eps']} - should be >= 0.0")
        if g["adam_convention"] not in ADAM_CONVENTIONS:
            raise ValueError(
                f"adam_convention must be one of {ADAM_CONVENTIONS}, got {g['adam_convention']!r}"
            )

    @classmethod
    def _is_projected(cls, group: dict[str, Any]) -> bool:
        if "project" in group:
            return bool(group["project"])
        return group.get("rank") is not None

    @classmethod
    def _fill_projected(cls, group: dict[str, Any], defaults: dict[str, Any]) -> None:
        """Fills missing projection keys of `group` in place (subclasses may map aliases first)."""
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
        self._check_adam(group)
        group["project"] = self._is_projected(group)
        if not group["project"]:
            return
        if group.get("rank") is None:
            raise ValueError("a group with project=True needs a 'rank'")
        self._fill_projected(group, self._projection_defaults)
        self._validate_projected(group)

    def _validate_projected(self, group: dict[str, Any]) -> None:
        """Checks a projected group's options and that each of its params is a 2-D matrix."""
        if int(group["rank"]) < 1:
            raise ValueError(f"rank must be a positive int, got {group['rank']!r}")
        if int(group["update_proj_gap"]) < 1:
            raise ValueError(f"update_proj_gap must be a positive int, got {group['update_proj_gap']!r}")
        if group["proj_type"] not in proj.PROJ_TYPES:
            raise ValueError(f"proj_type must be one of {proj.PROJ_TYPES}, got {group['proj_type']!r}")
        if group["basis"] not in proj.METHODS:
            raise ValueError(f"basis must be one of {proj.METHODS}, got {group['basis']!r}")
        if group["basis"] == "random" and group["proj_type"] == "full":
            raise ValueError("basis='random' does not support proj_type='full'")
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(
                    f"{type(self).__name__}: a group with 'rank' holds a parameter of shape {tuple(p.shape)}; "
                    "only 2-D weight matrices can be projected. Put biases, norms and embeddings in a "
                    "group without 'rank' (they then get plain AdamW)."
                )

    # ------------------------------------------------------------------ state

    def _side(self, p: torch.Tensor, group: dict[str, Any]) -> str:
        return proj.choose_side(tuple(p.shape), group["proj_type"])

    def _param_seed(self, group: dict[str, Any], index: int) -> int:
        """Seed of the parameter at position `index` (over all groups): mix_seed(group seed, index)."""
        return proj.mix_seed(int(group["seed"]), index)

    def _init_moments(
        self, state: dict[str, Any], shape: tuple[int, ...], p: torch.Tensor, group: dict[str, Any]
    ) -> None:
        """Allocates ``exp_avg`` / ``exp_avg_sq`` of `shape` (parameter dtype). 8-bit overrides."""
        state["exp_avg"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        state["exp_avg_sq"] = torch.zeros(shape, dtype=p.dtype, device=p.device)

    def _init_extra_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Hook for a subclass's own state keys of a projected param (Fira: residual_norm)."""

    def _init_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], index: int) -> None:
        state["step"] = 0
        if not group["project"]:
            if _is_dtensor(p) and self.SHARDED_DENSE:
                # FSDP2: sharded like the parameter; AdamW is element-wise, so each rank steps its shard.
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            else:
                self._init_moments(state, tuple(p.shape), p, group)
            return
        side = self._side(p, group)
        shape, method = tuple(p.shape), group["basis"]
        state["refresh"] = 0
        state["seed"] = self._param_seed(group, index)
        self._init_moments(state, proj.low_rank_shape(shape, group["rank"], side, method), p, group)
        if method != "random":
            # Allocated now (zeros) so a dummy step materialises every key with its final shape.
            bshape = proj.basis_shape(shape, group["rank"], side, method)
            state["basis"] = torch.zeros(bshape, dtype=p.dtype, device=p.device)
        self._init_extra_state(p, group, state)

    # ------------------------------------------------------------------ numerics

    def _refresh_due(self, state: dict[str, Any], group: dict[str, Any]) -> bool:
        return state["refresh"] == 0 or state["step"] % int(group["update_proj_gap"]) == 0

    def _current_basis(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> torch.Tensor | None:
        """The basis P for this step (parameter dtype), refreshing it first when due.

        Returns None only when no basis exists yet and computing the first one failed; the caller
        then skips the parameter without advancing its counter, so the next step retries.
        """
        method = group["basis"]
        due = self._refresh_due(state, group)
        if not due and method != "random":
            return state["basis"]  # most steps: nothing else to do
        side = self._side(p, group)
        if method == "random":
            if due:
                state["refresh"] += 1
                self.refresh_count += 1
            basis = proj.random_basis(
                tuple(p.shape),
                group["rank"],
                side,
                seed=state["seed"],
                refresh=state["refresh"],
                device=p.device,
            )
            return basis.to(p.dtype)
        prev = state["basis"] if state["refresh"] > 0 else None
        stats = proj.RefreshStats()
        new = proj.compute_basis(
            grad,
            group["rank"],
            side,
            method,
            prev,
            seed=state["seed"],
            refresh=state["refresh"] + 1,
            oversample=group["oversample"],
            power_iters=group["power_iters"],
            warm_start=group["warm_start"],
            stats=stats,
        )
        self.refresh_seconds += stats.seconds
        self.failed_refreshes += stats.failed
        if stats.failed:
            return prev
        state["basis"].copy_(new)
        state["refresh"] += 1
        self.refresh_count += 1
        return state["basis"]

    def _adam(
        self, x: torch.Tensor, state: dict[str, Any], group: dict[str, Any], reuse_x: bool = False
    ) -> tuple[torch.Tensor, float]:
        """Advances t and the moments (``exp_avg``, ``exp_avg_sq``) with x = R or G; see `_adam_math`."""
        state["step"] += 1
        return self._adam_math(
            state["exp_avg"], state["exp_avg_sq"], x, state["step"], group, out=x if reuse_x else None
        )

    @staticmethod
    def _adam_math(
        m: torch.Tensor,
        v: torch.Tensor,
        x: torch.Tensor,
        t: int,
        group: dict[str, Any],
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, float]:
        """Updates M, V in place with x at step t; returns (N, eta_t) per the group's convention.

        M <- beta1 M + (1 - beta1) x;  V <- beta2 V + (1 - beta2) x^2;  then
        reference: N = M / (sqrt(V) + eps), eta_t = eta sqrt(1 - beta2^t) / (1 - beta1^t);
        torch:     N = M / (sqrt(V / (1 - beta2^t)) + eps), eta_t = eta / (1 - beta1^t).
        (Without bias correction both factors are 1.)

        `out`: a buffer shaped like M that may be overwritten (x itself when the caller no longer
        needs it): N is computed into it with the same operations, so no temporaries are allocated.

        With bias correction on plain contiguous CPU/CUDA tensors of one dtype, torch's fused
        Adam kernel does all of it in one pass (`_fused_normalised`; N then lands in a new
        buffer and `out` is unused); the result differs from the op-by-op one by fp32 rounding.
        """
        beta1, beta2 = group["betas"]
        bc1 = 1.0 - beta1**t if group["correct_bias"] else 1.0
        bc2 = 1.0 - beta2**t if group["correct_bias"] else 1.0
        if group["correct_bias"] and _fusable(m, v, x):
            return _fused_normalised(m, v, x, t, group, bc1, bc2)
        m.mul_(beta1).add_(x, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(x, x, value=1.0 - beta2)
        denom = torch.sqrt(v, out=out) if out is not None else v.sqrt()
        if group["adam_convention"] == "torch":
            denom.div_(math.sqrt(bc2)).add_(group["eps"])
            step_size = group["lr"] / bc1
        else:
            denom.add_(group["eps"])
            step_size = group["lr"] * math.sqrt(bc2) / bc1
        return torch.div(m, denom, out=denom), step_size

    def _apply_update(
        self,
        p: torch.Tensor,
        update: torch.Tensor,
        step_size: float,
        group: dict[str, Any],
        alpha: float = 1.0,
    ) -> None:
        """W <- W - eta_t alpha D, with decoupled weight decay before (torch) or after (reference)."""
        self._decay(p, group, before=True)
        p.add_(update, alpha=-step_size * alpha)
        self._decay(p, group, before=False)

    @staticmethod
    def _decay(p: torch.Tensor, group: dict[str, Any], before: bool) -> None:
        """W <- W (1 - eta lambda) if this is the convention's moment for it (torch: before the update)."""
        lr, wd = group["lr"], group["weight_decay"]
        if group["adam_convention"] == "torch":
            if before and wd != 0.0:
                p.mul_(1.0 - lr * wd)
        elif not before and wd > 0.0:
            p.add_(p, alpha=-lr * wd)  # galore-torch's exact operation

    def _dense_step(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """Plain AdamW for a non-projected parameter."""
        norm, step_size = self._adam(grad, state, group)
        self._apply_update(p, norm, step_size, group)

    def _projected_update(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        low: torch.Tensor,
        norm: torch.Tensor,
        basis: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
    ) -> tuple[torch.Tensor, float]:
        """Subclass hook: the full-size direction D and a factor alpha, with W <- W - eta_t alpha D.

        Args:
            p: the weight W (m x n).
            grad: G.
            low: R = proj(G).
            norm: N, the Adam-normalised R (see `_adam`).
            basis: P (parameter dtype).
            state: the parameter's state.
            group: its group.
        """
        raise NotImplementedError

    def _projected_step(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        basis = self._current_basis(p, grad, state, group)
        if basis is None:
            return
        side = self._side(p, group)
        low = proj.project(grad, basis, side)
        norm, step_size = self._adam(low, state, group)
        update, alpha = self._projected_update(p, grad, low, norm, basis, state, group)
        self._apply_update(p, update, step_size, group, alpha)

    def _back(
        self, norm: torch.Tensor, basis: torch.Tensor, p: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """back(N) for this parameter's side (no scale)."""
        return proj.project_back(norm, basis, self._side(p, group), m=p.shape[0])

    # ------------------------------------------------------------------ step

    @staticmethod
    def _nonzero_flags(grads: list[torch.Tensor]) -> list[bool]:
        """[G != 0 anywhere, for G in grads] with one host synchronisation per device (two when
        some large gradient's sample is all zero, as in a checkpoint loader's dummy step).

        Uses ||G||_2 != 0 (a fused multi-tensor norm, several times faster than an inf-norm or
        any() on CPU), first on a strided sample of each large G; inf/nan count as nonzero. A
        gradient whose every entry is below ~1e-19 (squares underflow in fp32) also reads as
        zero, which is harmless.
        """
        flags: list[bool] = [True] * len(grads)
        sharded = [g for g in grads if _is_dtensor(g)]
        if sharded:
            # FSDP2: a shard may be zero where the whole gradient is not; decide on the whole one,
            # identically on every rank (the projected step has collectives).
            import torch.distributed as dist

            norms = torch.stack([n.float() for n in torch._foreach_norm([local(g) for g in grads], ord=2)])
            nonzero = norms.ne(0).float()
            dist.all_reduce(nonzero, op=dist.ReduceOp.MAX, group=sharded[0].device_mesh.get_group())
            return [bool(v) for v in nonzero.tolist()]
        by_device: dict[torch.device, list[int]] = {}
        for i, g in enumerate(grads):
            by_device.setdefault(g.device, []).append(i)
        for idx in by_device.values():
            # A strided sample of ~256 entries proves "nonzero" for almost every real gradient of
            # a large matrix at a fraction of a full pass; only a gradient whose sample is all zero
            # gets a full norm. Both answers are exact: a nonzero sample entry is a nonzero entry.
            views = [_sample(grads[i]) for i in idx]
            if len(views) == 1:  # one norm: no list of results to stack
                norms = [float(torch.linalg.vector_norm(views[0], dtype=torch.float32))]
            else:
                norms = torch.stack(torch._foreach_norm(views, ord=2, dtype=torch.float32)).tolist()
            unsure = []
            for i, view, norm in zip(idx, views, norms):
                flags[i] = norm != 0.0  # nan (an inf/nan entry) counts as nonzero
                if not flags[i] and view is not grads[i]:
                    unsure.append(i)
            if unsure:
                norms = torch.stack(
                    torch._foreach_norm([grads[i] for i in unsure], ord=2, dtype=torch.float32)
                ).tolist()
                for i, norm in zip(unsure, norms):
                    flags[i] = norm != 0.0
        return flags

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimisation step over all parameters that have a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries: list[tuple[dict[str, Any], torch.Tensor, int]] = []
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                    entries.append((group, p, index))
                index += 1
        if not entries:
            return loss
        live = self._nonzero_flags([p.grad for _, p, _ in entries])
        for (group, p, idx), nonzero in zip(entries, live):
            state = self.state[p]
            if not state:
                self._init_state(p, group, state, idx)
            if not nonzero:
                continue
            if not _is_dtensor(p):
                (self._projected_step if group["project"] else self._dense_step)(p, p.grad, state, group)
            elif group["project"]:
                self._whole_step_sharded(p, state, group, self._projected_step)
            elif not self.SHARDED_DENSE:
                self._whole_step_sharded(p, state, group, self._dense_step)
            else:
                self._dense_step(p, p.grad, state, group)
        return loss

    def _whole_step_sharded(
        self,
        p: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        step_fn: Callable[[torch.Tensor, torch.Tensor, dict[str, Any], dict[str, Any]], None],
    ) -> None:
        """`step_fn` (the projected step, or the dense one of an 8-bit subclass) of an
        FSDP2-sharded (DTensor) weight, run on the whole matrix.

        The basis needs the whole gradient, and Fira's and APOLLO's norms are over the whole
        matrix, so every rank all-gathers the full gradient G and the full weight W, runs exactly
        the single-process step on them (same basis on every rank: same inputs, same seeds), and
        keeps its own shard of the updated W. The projected state (low-rank moments, basis) is
        therefore replicated, not sharded: its size is already O((m + n) r).

        Cost per projected m x n weight and step, world size N, itemsize s: two all-gathers (G and
        W) of (N - 1)/N m n s bytes received each, and two transient full m x n buffers on every
        rank (freed after the step); the basis computation is repeated on every rank instead of
        being communicated. Gathering W keeps every subclass's update rule (in-place on W, weight
        decay included) bitwise identical to a single process.

        Subclasses whose dense moments are not element-wise (8-bit block-wise quantisation:
        `SHARDED_DENSE` False) step their non-projected weights this way too, so the 8-bit blocks
        are those of a single process; that state is then whole on every rank as well.
        """
        weight = whole(p)
        step_fn(weight, whole(p.grad), state, group)
        write_whole_(p, weight)  # identical on every rank: each keeps its own chunk

    # ------------------------------------------------------------------ checkpoint

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load_state_dict, keeping each saved tensor's own dtype.

        torch casts every floating-point state tensor to its parameter's dtype on load; our state
        may hold other dtypes on purpose (8-bit moments, their fp32 scales), so those are put back
        exactly as saved (moved to the parameter's device).
        """
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        keep: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        for pid, p in zip(saved_ids, params):
            for k, v in state_dict["state"].get(pid, {}).items():
                if torch.is_tensor(v) and k != "step" and v.dtype != p.dtype:
                    keep.append((p, k, v))
        super().load_state_dict(state_dict)
        for p, k, v in keep:
            self.state[p][k] = v.to(device=p.device)

    # ------------------------------------------------------------------ memory

    @classmethod
    def _moment_bytes(cls, numel: int, dtype: torch.dtype, group: dict[str, Any]) -> int:
        """Bytes of exp_avg + exp_avg_sq holding `numel` entries each: 2 numel s (s = itemsize)."""
        return 2 * numel * itemsize(dtype)

    @classmethod
    def _extra_state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Bytes of a subclass's own state keys for a projected param (0 here)."""
        return 0

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Exact bytes of tensor state for one parameter after >= 1 step (python ints cost 0).

        With s the itemsize of `dtype`, k = min(r, m, n) (k = r for the random method) and the
        side from `proj_type` (std: right if m >= n else left):

        * not projected (no ``rank``): 2 s prod(shape)                       (M, V)
        * right side:  2 s m k + s k n     (M, V are m x k; P is k x n)
        * left side:   2 s k n + s m k     (M, V are k x n; P is m x k)
        * full:        2 s k^2 + s k (m + n)
        * basis "random": the P term is 0 (regenerated, never stored).

        Subclasses add their own terms (see their docstrings).

        Args:
            shape: the parameter's shape.
            group: a param group (a plain dict is fine; missing keys take the defaults).
            dtype: the parameter's dtype.
        """
        g = cls.resolve_group(group)
        numel = math.prod(shape)
        if not g["project"]:
            return cls._moment_bytes(numel, dtype, g)
        side = proj.choose_side(tuple(shape), g["proj_type"])
        low = proj.low_rank_shape(tuple(shape), int(g["rank"]), side, g["basis"])
        total = cls._moment_bytes(math.prod(low), dtype, g)
        if g["basis"] != "random":
            total += math.prod(proj.basis_shape(tuple(shape), int(g["rank"]), side, g["basis"])) * itemsize(
                dtype
            )
        return total + cls._extra_state_bytes(tuple(shape), g, dtype)


__all__ = ["ADAM_CONVENTIONS", "ProjectedAdam", "itemsize"]
