"""APOLLO and APOLLO-Mini: SGD-like memory with Adam-like, structured learning-rate scaling.

Zhu et al. 2024, "APOLLO: SGD-like Memory, AdamW-level Performance" (arXiv 2412.05270);
PAPER.md section 2.5. Adam runs on a random low-rank projection R of the gradient only to
estimate how Adam would rescale each channel (or the whole tensor); the raw gradient, rescaled
by that estimate, is the update. The projection is a seeded Gaussian map regenerated from
integers every step, so it is never stored.
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar

import torch

from optimizers import projection as proj
from optimizers.projected_adam import ProjectedAdam

__all__ = ["APOLLOAdamW", "APOLLOMini", "apollo_torch_next_seed"]

SCALE_TYPES: tuple[str, ...] = ("channel", "tensor")
RANDOM_STREAMS: tuple[str, ...] = ("mix", "apollo_torch")

# apollo-torch advances a parameter's seed by taking the 15th int64 draw of a CPU generator.
_APOLLO_SEED_ADVANCE = 15


def apollo_torch_next_seed(seed: int) -> int:
    """The seed of the next projection in apollo-torch's chain (its ``next_seed``).

    Reproduced so that ``random_stream="apollo_torch"`` draws exactly the projections
    apollo-torch draws: a CPU ``torch.Generator`` seeded with `seed` yields
    ``_APOLLO_SEED_ADVANCE`` uniform ints in [0, 2^63 - 1); the last one is the next seed.
    """
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    draws = torch.randint(0, torch.iinfo(torch.int64).max, (_APOLLO_SEED_ADVANCE,), generator=gen)
    return int(draws[-1])


class APOLLOAdamW(ProjectedAdam):
    r"""APOLLO-AdamW, drop-in for ``apollo_torch.APOLLOAdamW`` (same group format and numerics).

    For a projected m x n weight W with gradient G (right side when m >= n: P is r x n with
    i.i.d. N(0, 1/r) entries, R = G P^T is m x r; left side otherwise: P is m x r, R = P^T G is
    r x n), each step t:

        M <- beta1 M + (1 - beta1) R,   V <- beta2 V + (1 - beta2) R^2,   N = M / (sqrt(V) + eps)
        channel:  s_c = ||N_c|| / (||R_c|| + 1e-8)    one factor per channel c, the norms taken
                  along the rank axis (per row of W on the right side, per column on the left)
        tensor:   s = ||N||_F / (||R||_F + 1e-8)       (APOLLO-Mini, rank 1)
        D = G * s                                     (the raw gradient, scaled)
        norm-growth limiter (Fira), gamma = ``norm_growth_limit`` (1.01):
            if ||D_t|| > gamma ||D_{t-1}||:  D_t <- D_t gamma ||D_{t-1}|| / ||D_t||   (not on step 1)
        W <- W - eta_t sqrt(alpha) D,   then   W <- W - eta lambda W

    with eta_t = eta sqrt(1 - beta2^t) / (1 - beta1^t) and alpha = ``scale``. With
    ``scale_front=True`` the sqrt(alpha) factor is applied before the limiter (apollo-torch's
    ``--scale_front``). The projection is refreshed every T = ``update_proj_gap`` steps
    (on steps 1, T + 1, 2T + 1, ...) from integers, never stored; the moments are kept across
    refreshes, as in apollo-torch. ``adam_convention="torch"`` switches the Adam part to
    torch.optim.AdamW's eps and decay placement (see `ProjectedAdam`).

    Random streams (group key ``random_stream``):

    * ``"mix"`` (default): projection k of a parameter is drawn from
      ``projection.mix_seed(seed, k)`` (`projection.random_basis`), with the parameter's seed
      ``mix_seed(group seed, index)``: independent of how many refreshes came before.
    * ``"apollo_torch"``: apollo-torch's stream, bit for bit: the parameter at position i
      (1-based over all groups) starts from seed ``group seed + i`` and each refresh after the
      first advances it with `apollo_torch_next_seed`; the current one is kept in state as
      ``proj_seed``. Draws use a generator on the parameter's device, as apollo-torch does.

    Param groups use apollo-torch's keys: a group with ``rank`` (r) is projected; ``proj``
    ("random" | "svd", an alias of our ``basis``; default "random"), ``scale_type`` ("channel" |
    "tensor"), ``update_proj_gap`` (T, 200), ``scale`` (alpha, 1.0), ``proj_type`` ("std";
    "full" is rejected), plus ours: ``scale_front`` (False), ``norm_growth_limit`` (gamma, 1.01;
    0 or None disables it), ``random_stream`` ("mix"), ``seed`` (0), and the Adam keys ``lr``
    (eta), ``betas`` (beta1, beta2), ``eps`` (1e-6), ``weight_decay`` (lambda), ``correct_bias``.
    Groups without ``rank`` run plain AdamW. ``group["project"]`` records the decision.

    State per projected weight: ``step``, ``refresh`` (k), ``seed`` (ints; ``proj_seed`` too for
    the apollo_torch stream), ``exp_avg`` and ``exp_avg_sq`` (low-rank, parameter dtype) and
    ``scaled_grad_norm`` (||D_{t-1}||, fp32 scalar). Memory for an m x n weight of itemsize s:
    right side 2 s m r + 4, left side 2 s r n + 4 (a non-random ``proj`` adds the stored basis,
    s r n or s m r); non-projected 2 s m n.

    Args:
        params: parameters or param groups (apollo-torch format).
        lr: eta.
        betas: (beta1, beta2).
        eps: epsilon (apollo-torch default 1e-6).
        weight_decay: lambda, decoupled, applied after the step as apollo-torch does.
        correct_bias: Adam bias correction.
        scale_front: apollo-torch's ``scale_front`` (default for groups).
        disable_nl: apollo-torch's ``disable_nl``: turns the norm-growth limiter off by default.
        no_deprecation_warning: accepted for apollo-torch signature compatibility; ignored.
        **projection_defaults: defaults for projected groups' keys (a group's own value wins).
    """

    PROJECTION_DEFAULTS: ClassVar[dict[str, Any]] = {
        **ProjectedAdam.PROJECTION_DEFAULTS,
        "basis": "random",
        "scale_type": "channel",
        "scale_front": False,
        "norm_growth_limit": 1.01,
        "random_stream": "mix",
    }

    def __init__(
        self,
        params: Any,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        correct_bias: bool | None = None,
        scale_front: bool = False,
        disable_nl: bool = False,
        no_deprecation_warning: bool = True,
        **projection_defaults: Any,
    ) -> None:
        del no_deprecation_warning  # apollo-torch's signature; there is nothing to warn about here
        projection_defaults.setdefault("scale_front", scale_front)
        if disable_nl:
            projection_defaults.setdefault("norm_growth_limit", 0.0)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            correct_bias=correct_bias,
            **projection_defaults,
        )

    # ------------------------------------------------------------------ groups

    @classmethod
    def _fill_projected(cls, group: dict[str, Any], defaults: dict[str, Any]) -> None:
        # apollo-torch names the projection method ``proj``; ours is ``basis``.
        if "proj" in group and "basis" not in group:
            group["basis"] = group["proj"]
        super()._fill_projected(group, defaults)

    def _validate_projected(self, group: dict[str, Any]) -> None:
        super()._validate_projected(group)
        if group["proj_type"] == "full":
            raise ValueError(
                f"{type(self).__name__} does not support proj_type='full' (its scaling is per channel)"
            )
        if group["scale_type"] not in SCALE_TYPES:
            raise ValueError(f"scale_type must be one of {SCALE_TYPES}, got {group['scale_type']!r}")
        if group["random_stream"] not in RANDOM_STREAMS:
            raise ValueError(f"random_stream must be one of {RANDOM_STREAMS}, got {group['random_stream']!r}")
        if float(group["scale"]) < 0:
            raise ValueError(f"scale must be >= 0, got {group['scale']!r}")

    # ------------------------------------------------------------------ state

    def _param_seed(self, group: dict[str, Any], index: int) -> int:
        if group["random_stream"] == "apollo_torch":
            # apollo-torch numbers parameters from 1 over all groups and seeds each with its number.
            return int(group["seed"]) + index + 1
        return super()._param_seed(group, index)

    def _init_extra_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        # fp32 whatever the param dtype: the limiter compares successive norms, and a bf16 norm
        # would make the 1% growth bound coarse (bf16 resolves ~0.8%).
        state["scaled_grad_norm"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if group["random_stream"] == "apollo_torch":
            state["proj_seed"] = state["seed"]

    @classmethod
    def _extra_state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """``scaled_grad_norm``: one fp32 scalar, 4 bytes (ints cost nothing)."""
        return 4

    # ------------------------------------------------------------------ numerics

    def _random_basis(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        """The current Gaussian projection (N(0, 1/r) entries) in the parameter dtype."""
        side, rank = self._side(p, group), int(group["rank"])
        shape = tuple(p.shape)
        if group["random_stream"] == "apollo_torch":
            gen = torch.Generator(device=p.device).manual_seed(state["proj_seed"])
            bshape = proj.basis_shape(shape, rank, side, "random")
            basis = torch.randn(bshape, generator=gen, device=p.device, dtype=torch.float32) / math.sqrt(rank)
        else:
            basis = proj.random_basis(
                shape, rank, side, seed=state["seed"], refresh=state["refresh"], device=p.device
            )
        return basis.to(p.dtype)

    def _current_basis(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> torch.Tensor | None:
        """Random projections are regenerated every step; a refresh only moves to the next one."""
        if group["basis"] != "random":
            return super()._current_basis(p, grad, state, group)
        due = self._refresh_due(state, group)
        t0 = time.perf_counter()
        if due:
            if group["random_stream"] == "apollo_torch" and state["refresh"] > 0:
                state["proj_seed"] = apollo_torch_next_seed(state["proj_seed"])
            state["refresh"] += 1
            self.refresh_count += 1
        basis = self._random_basis(p, state, group)
        if due:
            self.refresh_seconds += time.perf_counter() - t0
        return basis

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
        if group["scale_type"] == "channel":
            # The rank axis of R: columns of the m x r R (right side), rows of the r x n R (left).
            rank_dim = 1 if self._side(p, group) == "right" else 0
            factor = torch.linalg.vector_norm(norm, dim=rank_dim, keepdim=True) / (
                torch.linalg.vector_norm(low, dim=rank_dim, keepdim=True) + 1e-8
            )
        else:
            factor = torch.linalg.vector_norm(norm) / (torch.linalg.vector_norm(low) + 1e-8)
        update = grad * factor
        root_scale = math.sqrt(float(group["scale"]))
        if group["scale_front"]:
            update.mul_(root_scale)
        gamma = group["norm_growth_limit"]
        if gamma:
            upd_norm = torch.linalg.vector_norm(update, dtype=torch.float32)
            if state["step"] > 1:
                # limiter = max(||D_t|| / ||D_{t-1}||, gamma) / gamma >= 1, on device (no host sync).
                limiter = torch.clamp(upd_norm / (state["scaled_grad_norm"] + 1e-8), min=gamma) / gamma
                update.div_(limiter.to(update.dtype))
                upd_norm = upd_norm / limiter
            state["scaled_grad_norm"].copy_(upd_norm)
        return update, (1.0 if group["scale_front"] else root_scale)


class APOLLOMini(APOLLOAdamW):
    r"""APOLLO-Mini: APOLLO with a rank-1 projection and one tensor-wise scaling factor.

    The rule of `APOLLOAdamW` with r = 1 and ``scale_type="tensor"``:
    s = ||N||_F / (||R||_F + 1e-8), D = G s, W <- W - eta_t sqrt(alpha) D, and apollo-torch's
    recommended alpha = ``scale`` = 128 (its README's APOLLO-Mini setting). A projected group may
    omit ``rank`` if it sets ``project=True``; a rank other than 1 is an error (use "apollo" with
    ``scale_type="tensor"`` for that).

    State per projected m x n weight of itemsize s: ``exp_avg``/``exp_avg_sq`` of shape m x 1
    (right side, m >= n) or 1 x n (left), plus the fp32 ``scaled_grad_norm``:
    right 2 s m + 4 bytes, left 2 s n + 4; non-projected 2 s m n.
    """

    PROJECTION_DEFAULTS: ClassVar[dict[str, Any]] = {
        **APOLLOAdamW.PROJECTION_DEFAULTS,
        "scale_type": "tensor",
        "scale": 128.0,
    }

    @classmethod
    def _fill_projected(cls, group: dict[str, Any], defaults: dict[str, Any]) -> None:
        if group.get("rank") is None:
            group["rank"] = 1
        super()._fill_projected(group, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As `ProjectedAdam`, with ``rank`` defaulting to 1 for a group marked ``project=True``."""
        if param_group.get("project") and param_group.get("rank") is None:
            param_group = {**param_group, "rank": 1}
        super().add_param_group(param_group)

    def _validate_projected(self, group: dict[str, Any]) -> None:
        super()._validate_projected(group)
        if int(group["rank"]) != 1:
            raise ValueError(
                f"APOLLOMini is rank 1, got rank={group['rank']!r}; "
                "use APOLLOAdamW with scale_type='tensor' for a higher rank"
            )
