"""Fira: GaLore plus the scaled full-rank residual, with the norm-growth limiter (Chen et al. 2024)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from optimizers import projection as proj
from optimizers.projected_adam import STEP, Direction, ProjectedAdam, ProjectedStep

RESIDUAL_NORM = "residual_norm"
"""State key of ||S_{t-1}||, the previous (limited) residual's norm (a 0-d tensor)."""


class FiraAdamW(ProjectedAdam):
    """Fira-AdamW (Chen et al. 2024), drop-in for ``fira.FiraAdamW`` (its group key is ``alpha``).

    Same projection and low-rank Adam as `GaLoreAdamW`, giving R = proj(G) and
    N = M / (sqrt(V) + eps). Fira adds back what the projection throws away, rescaled the way
    Adam rescales the projected part:

        phi_i = ||N_i|| / (||R_i|| + 1e-8)     norms along the rank axis: per row of R when R is
                                               m x r (right side), per column when R is r x n (left)
        S = (G - alpha back(R)) * phi          (fira's code subtracts alpha back(R); with
                                               ``exact_residual=True`` it is G - back(R), the paper's)
        norm-growth limiter (``norm_growth_limit`` gamma = 1.01; None or 0 turns it off):
            if ||S_t|| > gamma ||S_{t-1}||: S_t <- S_t gamma ||S_{t-1}|| / ||S_t||
            (S_{t-1} is the limited previous residual; the first step is not limited)
        W <- W - eta_t (alpha back(N) + S),   then   W <- W - eta lambda W

    with eta_t as in `ProjectedAdam` (convention "reference" by default, as fira). With the
    identity basis at full rank and alpha = 1 the residual is exactly zero and Fira is AdamW.
    ``proj_type='full'`` is not defined for Fira's per-row scaling and is rejected.

    Group keys (paper symbol): ``rank`` (r), ``update_proj_gap`` (T, 200), ``alpha`` (alpha, 1.0;
    a galore-style ``scale`` is accepted when ``alpha`` is absent), ``proj_type`` ("std"),
    ``norm_growth_limit`` (gamma, 1.01), ``exact_residual`` (False), ``basis``, ``oversample`` (p),
    ``power_iters`` (q), ``warm_start``, ``seed``; plus the Adam keys of `ProjectedAdam`.

    State per projected weight: as GaLore plus ``residual_norm`` (||S_{t-1}||, a 0-d tensor in the
    parameter dtype, like fira's ``scaling_grad``). Memory for an m x n weight of itemsize s with
    k = min(r, m, n): right side 2 s m k + s k n + s; left side 2 s k n + s m k + s; non-projected
    2 s m n.
    """

    PROJECTION_DEFAULTS: ClassVar[dict[str, Any]] = {
        **{k: v for k, v in ProjectedAdam.PROJECTION_DEFAULTS.items() if k != "scale"},
        "alpha": 1.0,
        "norm_growth_limit": 1.01,
        "exact_residual": False,
    }
    SCALE_KEY: ClassVar[str] = "alpha"
    # A galore-format group (``scale``) drops in: its scale is Fira's alpha.
    ALIASES: ClassVar[dict[str, str]] = {"alpha": "scale"}
    # No "full": Fira's scaling phi is per row or per column of a one-sided R.
    CHOICES: ClassVar[dict[str, tuple[Any, ...]]] = {
        **ProjectedAdam.CHOICES,
        "proj_type": tuple(t for t in proj.PROJ_TYPES if t != "full"),
    }
    # ||S_{t-1}|| in the parameter dtype, like fira's ``scaling_grad``.
    EXTRA_STATE: ClassVar[dict[str, torch.dtype | None]] = {RESIDUAL_NORM: None}

    def _projected_update(self, s: ProjectedStep) -> tuple[Direction, float]:
        """alpha back(N) + S, the limited residual (see the class docstring)."""
        alpha = float(s.group["alpha"])
        # The rank axis of R: dim 1 when R is m x r (per-row phi), dim 0 when R is r x n (per column).
        dim = 0 if s.norm.shape[0] < s.norm.shape[1] else 1
        phi = torch.linalg.vector_norm(s.norm, dim=dim) / (torch.linalg.vector_norm(s.low, dim=dim) + 1e-8)
        if dim == 1:
            phi = phi.unsqueeze(1)
        back_r = s.back(s.low)
        residual = s.grad - back_r if s.group["exact_residual"] else s.grad - back_r * alpha
        residual.mul_(phi)
        gamma = s.group["norm_growth_limit"]
        res_norm = torch.linalg.vector_norm(residual)
        previous = s.state[RESIDUAL_NORM]
        if gamma and s.state[STEP] > 1:
            # limiter = max(||S_t|| / ||S_{t-1}||, gamma) / gamma >= 1, computed on device (no sync).
            limiter = torch.clamp(res_norm / (previous + 1e-8), min=gamma) / gamma
            residual.div_(limiter)
            res_norm = res_norm / limiter
        previous.copy_(res_norm)
        return s.back(s.norm).mul_(alpha).add_(residual), 1.0


__all__ = ["RESIDUAL_NORM", "FiraAdamW"]
