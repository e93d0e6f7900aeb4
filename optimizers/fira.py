"""Fira: GaLore plus the scaled full-rank residual, with the norm-growth limiter (PAPER.md 2.4)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from optimizers.projected_adam import ProjectedAdam, itemsize


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

    @classmethod
    def _fill_projected(cls, group: dict[str, Any], defaults: dict[str, Any]) -> None:
        # A galore-format group (``scale``) drops in: its scale is Fira's alpha.
        if "alpha" not in group and "scale" in group:
            group["alpha"] = group["scale"]
        super()._fill_projected(group, defaults)

    def _validate_projected(self, group: dict[str, Any]) -> None:
        super()._validate_projected(group)
        if group["proj_type"] == "full":
            raise ValueError("FiraAdamW does not support proj_type='full' (its scaling is per row or column)")

    def _init_extra_state(self, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        state["residual_norm"] = torch.zeros((), dtype=p.dtype, device=p.device)

    @classmethod
    def _extra_state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """``residual_norm``: one scalar of the parameter dtype, s bytes."""
        return itemsize(dtype)

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
        alpha = float(group["alpha"])
        # The rank axis of R: dim 1 when R is m x r (per-row phi), dim 0 when R is r x n (per column).
        dim = 0 if norm.shape[0] < norm.shape[1] else 1
        phi = torch.linalg.vector_norm(norm, dim=dim) / (torch.linalg.vector_norm(low, dim=dim) + 1e-8)
        if dim == 1:
            phi = phi.unsqueeze(1)
        back_r = self._back(low, basis, p, group)
        residual = grad - back_r if group["exact_residual"] else grad - back_r * alpha
        residual.mul_(phi)
        gamma = group["norm_growth_limit"]
        res_norm = torch.linalg.vector_norm(residual)
        if gamma and state["step"] > 1:
            # limiter = max(||S_t|| / ||S_{t-1}||, gamma) / gamma >= 1, computed on device (no sync).
            limiter = torch.clamp(res_norm / (state["residual_norm"] + 1e-8), min=gamma) / gamma
            residual.div_(limiter)
            res_norm = res_norm / limiter
        state["residual_norm"].copy_(res_norm)
        update = self._back(norm, basis, p, group)
        return update.mul_(alpha).add_(residual), 1.0


__all__ = ["FiraAdamW"]
