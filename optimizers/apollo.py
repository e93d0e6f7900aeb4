"""APOLLO and APOLLO-Mini: SGD-like memory with Adam-like, structured learning-rate scaling.

Zhu et al. 2024, "APOLLO: SGD-like Memory, AdamW-level Performance" (arXiv 2412.05270);
Zhu et al. 2024 (APOLLO). Adam runs on a random low-rank projection R of the gradient only to
estimate how Adam would rescale each channel (or the whole tensor); the raw gradient, rescaled
by that estimate, is the update. The projection is a seeded Gaussian map regenerated from
integers every step, so it is never stored.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from optimizers import projection as proj
from optimizers.projected_adam import (
    REFRESH,
    SEED,
    STEP,
    Direction,
    ProjectedAdam,
    ProjectedStep,
    SeededRandomBasis,
)

__all__ = [
    "PROJ_SEED",
    "SCALED_GRAD_NORM",
    "APOLLOAdamW",
    "APOLLOMini",
    "ApolloTorchStream",
    "apollo_torch_next_seed",
]

SCALE_TYPES: tuple[str, ...] = ("channel", "tensor")

SCALED_GRAD_NORM = "scaled_grad_norm"
"""State key of ||D_{t-1}||, the previous (limited) update's norm (fp32, 0-d)."""
PROJ_SEED = "proj_seed"
"""State key of the current seed in apollo-torch's chain (int; ``random_stream="apollo_torch"`` only)."""

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


class ApolloTorchStream(SeededRandomBasis):
    """apollo-torch's random stream, bit for bit on the CPU (``random_stream="apollo_torch"``).

    The parameter at position i (0-based over all groups) starts from seed ``group seed + i + 1``
    (apollo-torch numbers parameters from 1 and seeds each with its number); each refresh after
    the first advances the seed with `apollo_torch_next_seed`, and basis k is drawn from the
    current seed itself, kept in state as ``proj_seed``.
    """

    def param_seed(self, group: dict[str, Any], index: int) -> int:
        return int(group["seed"]) + index + 1

    def init_state(
        self, state: dict[str, Any], p: torch.Tensor, group: dict[str, Any], side: str, index: int
    ) -> None:
        super().init_state(state, p, group, side, index)
        state[PROJ_SEED] = state[SEED]

    def advance(self, state: dict[str, Any]) -> None:
        if state[REFRESH] > 0:
            state[PROJ_SEED] = apollo_torch_next_seed(state[PROJ_SEED])

    def generator_seed(self, state: dict[str, Any]) -> int:
        return state[PROJ_SEED]


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
    * ``"apollo_torch"``: apollo-torch's stream (bit for bit on the CPU): the parameter at position i
      (1-based over all groups) starts from seed ``group seed + i`` and each refresh after the
      first advances it with `apollo_torch_next_seed`; the current one is kept in state as
      ``proj_seed`` (`ApolloTorchStream`). Every draw comes from a CPU generator, as all of this
      package's random bases (`projection.gaussian`): bit for bit apollo-torch's on the CPU; on a
      GPU apollo-torch draws from the device's generator, so there the two runs' projections are
      different draws of the same distribution, and ours do not change with the hardware.

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
    # apollo-torch names the projection method ``proj``; ours is ``basis``.
    ALIASES: ClassVar[dict[str, str]] = {"basis": "proj"}
    # No "full": the scaling is per channel of a one-sided R.
    CHOICES: ClassVar[dict[str, tuple[Any, ...]]] = {
        **ProjectedAdam.CHOICES,
        "proj_type": tuple(t for t in proj.PROJ_TYPES if t != "full"),
        "scale_type": SCALE_TYPES,
    }
    # fp32 whatever the param dtype: the limiter compares successive norms, and a bf16 norm
    # would make the 1% growth bound coarse (bf16 resolves ~0.8%).
    EXTRA_STATE: ClassVar[dict[str, torch.dtype | None]] = {SCALED_GRAD_NORM: torch.float32}
    RANDOM_STREAMS: ClassVar[dict[str, SeededRandomBasis]] = {
        **ProjectedAdam.RANDOM_STREAMS,
        "apollo_torch": ApolloTorchStream(),
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

    def _projected_update(self, s: ProjectedStep) -> tuple[Direction, float]:
        """D = G s (channel- or tensor-wise s), limited; alpha = sqrt(scale) unless applied in front."""
        group = s.group
        if group["scale_type"] == "channel":
            # The rank axis of R: columns of the m x r R (right side), rows of the r x n R (left).
            rank_dim = 1 if s.side == "right" else 0
            factor = torch.linalg.vector_norm(s.norm, dim=rank_dim, keepdim=True) / (
                torch.linalg.vector_norm(s.low, dim=rank_dim, keepdim=True) + 1e-8
            )
        else:
            factor = torch.linalg.vector_norm(s.norm) / (torch.linalg.vector_norm(s.low) + 1e-8)
        update = s.grad * factor
        root_scale = math.sqrt(float(group["scale"]))
        if group["scale_front"]:
            update.mul_(root_scale)
        gamma = group["norm_growth_limit"]
        if gamma:
            upd_norm = torch.linalg.vector_norm(update, dtype=torch.float32)
            previous = s.state[SCALED_GRAD_NORM]
            if s.state[STEP] > 1:
                # limiter = max(||D_t|| / ||D_{t-1}||, gamma) / gamma >= 1, on device (no host sync).
                limiter = torch.clamp(upd_norm / (previous + 1e-8), min=gamma) / gamma
                update.div_(limiter.to(update.dtype))
                upd_norm = upd_norm / limiter
            previous.copy_(upd_norm)
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
    FIXED_RANK: ClassVar[int | None] = 1
