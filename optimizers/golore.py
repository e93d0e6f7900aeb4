"""GoLore: GaLore whose basis becomes a random orthonormal one late in training (He et al. 2024)."""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar

import torch

from optimizers import projection as proj
from optimizers.galore import GaLoreAdamW
from optimizers.precision import full_fp32
from optimizers.projected_adam import (
    BASIS,
    COMPUTED_BASIS,
    REFRESH,
    SEED,
    STEP,
    BasisPolicy,
    refresh_due,
)


@full_fp32()
def orthonormal_basis(
    shape: tuple[int, ...],
    rank: int,
    side: str,
    generator_seed: int,
    *,
    device: torch.device | str = "cpu",
    holder: torch.Tensor | None = None,
) -> torch.Tensor:
    """A basis drawn uniformly (Haar) from the Stiefel manifold, in fp32: P with k = min(r, m, n)
    orthonormal rows (right side, k x n) or columns (left side, m x k).

    Q R = Z is the reduced QR decomposition of a d x k Gaussian Z (d = n or m) drawn from a CPU
    generator seeded with `generator_seed` (`projection.gaussian`: the same Z on any hardware, its
    CPU draw held for `holder` on a non-CPU device until the seed changes, `projection.held_on_host`)
    and factored on
    `device`; Q D with D = sign(diag(R)) is uniformly distributed (without the sign fix the
    distribution depends on the QR routine's sign convention). The QR runs where P is used, so P
    agrees across devices up to the QR's rounding, not bitwise.
    """
    if side not in ("left", "right"):
        raise ValueError(f"a random orthonormal basis is defined for side 'left' or 'right', got {side!r}")
    m, n = shape
    k = min(int(rank), m, n)
    zshape = (n if side == "right" else m, k)
    z = proj.held_on_host(
        holder,
        ("orthonormal_basis", int(generator_seed), zshape),
        lambda: proj.gaussian(zshape, proj.cpu_generator(generator_seed)),
        device=device,
    )
    q, r = torch.linalg.qr(z)
    q = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)
    return q.t().contiguous() if side == "right" else q


def switched(t: int, group: dict[str, Any]) -> bool:
    """Whether a refresh at the parameter's pre-increment step t draws a random basis:
    ``t >= rand_ratio * total_steps`` (GoLore's ``state["step"] >= rand_epoch``); from the first
    step when ``rand_ratio`` is 0, never when it is 1."""
    ratio = float(group["rand_ratio"])
    if ratio <= 0.0:
        return True
    if ratio >= 1.0 or group["total_steps"] is None:
        return False
    return t >= ratio * int(group["total_steps"])


class GoLoreBasis:
    """Basis policy of GoLore: `ComputedBasis` (the group's SVD family, stored) until the first
    refresh at which `switched`, then a random orthonormal basis (`orthonormal_basis`) from then on,
    redrawn at every refresh and regenerated every step from (the parameter's seed, refresh k),
    never stored: the stored basis is freed at the switch.

    State: ``refresh`` (k), ``seed``, and ``basis``: P (parameter dtype) until the switch, an empty
    tensor (0 bytes) from then on (the key stays, so a checkpoint's layout does not depend on the
    phase it was written in).
    """

    def init_state(
        self, state: dict[str, Any], p: torch.Tensor, group: dict[str, Any], side: str, index: int
    ) -> None:
        COMPUTED_BASIS.init_state(state, p, group, side, index)
        if float(group["rand_ratio"]) <= 0.0:
            state[BASIS] = state[BASIS].new_empty(0)  # random from the first step: never stored

    def basis(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        side: str,
        stats: proj.RefreshStats,
    ) -> torch.Tensor | None:
        """P for this step (parameter dtype), refreshed first when due."""
        due = refresh_due(state, group)
        if state[BASIS].numel():
            if not (due and switched(state[STEP], group)):
                return COMPUTED_BASIS.basis(p, grad, state, group, side, stats)
            state[BASIS] = state[BASIS].new_empty(0)  # the switch: the SVD basis is freed
        t0 = time.perf_counter()
        if due:
            state[REFRESH] += 1
            stats.count += 1
        seed = proj.mix_seed(state[SEED], state[REFRESH])
        basis = orthonormal_basis(tuple(p.shape), int(group["rank"]), side, seed, device=p.device, holder=p)
        basis = basis.to(p.dtype)
        if due:
            stats.seconds += time.perf_counter() - t0
        return basis

    def nbytes(self, shape: tuple[int, ...], group: dict[str, Any], side: str, dtype: torch.dtype) -> int:
        """The stored SVD basis (its peak, held until the switch); 0 when ``rand_ratio`` is 0."""
        if float(group["rand_ratio"]) <= 0.0:
            return 0
        return COMPUTED_BASIS.nbytes(shape, group, side, dtype)


GOLORE_BASIS = GoLoreBasis()


class GoLoreAdamW(GaLoreAdamW):
    """GoLore-AdamW (He et al., "Subspace optimization for large language models with convergence
    guarantees", 2024): GaLore-AdamW (`GaLoreAdamW`: same moments, schedule and update
    W <- W - eta_t alpha back(N)) whose projection, from the fraction ``rand_ratio`` of the run on,
    is drawn uniformly from the Stiefel manifold instead of computed from the gradient.

    With T the refresh gap and S = ``total_steps`` (the run length, from the trainer), a refresh at
    the parameter's pre-increment step t (t % T == 0; t is the parameter's Adam step counter, as
    in GoLore's code, so a momentum reset, which restarts t, also restarts the count towards the
    switch) computes P by the group's SVD-family basis
    while t < ``rand_ratio`` S, and draws a random orthonormal P (`orthonormal_basis`: QR of a
    seeded Gaussian, sign-fixed) once t >= ``rand_ratio`` S; between refreshes P is kept (stored
    before the switch, regenerated from (seed, refresh k) after it). GoLore's own runs use
    ``rand_ratio`` 0.8 (the default; pkumelon/Golore script/Go_pt.sh). ``rand_ratio`` 1 never
    switches (GaLore exactly); 0 is random from the first step (no basis is ever stored). Since
    the random basis is not computed from G, GoLore's projected gradient is an unbiased
    estimate of P^T P G up to scale, which gives its convergence guarantee under small batches.

    Group keys: GaLore's, plus ``rand_ratio`` (0.8) and ``total_steps`` (S; required when
    0 < rand_ratio < 1). ``proj_type="full"`` is refused unless rand_ratio is 1 (a random basis has one side).

    State per projected m x n weight (itemsize s, k = min(r, m, n)): ``step``, ``refresh``,
    ``seed`` (ints), ``exp_avg``, ``exp_avg_sq`` (low-rank) and ``basis`` (P before the switch,
    empty after it).
    `state_bytes` is the peak, the SVD phase's: right side 2 s m k + s k n, left side
    2 s k n + s m k (GaLore's); after the switch the state is s k n (right) or s m k (left) smaller
    (the moments only), and with rand_ratio 0 it is the moments only throughout. (A run's summary,
    measured after the switch, therefore reads below the estimate by the freed bases.)
    """

    PROJECTION_DEFAULTS: ClassVar[dict[str, Any]] = {
        **GaLoreAdamW.PROJECTION_DEFAULTS,
        "rand_ratio": 0.8,
        "total_steps": None,
    }

    @classmethod
    def _basis_policy(cls, group: dict[str, Any]) -> BasisPolicy:
        return GOLORE_BASIS

    def _check_projected(self, group: dict[str, Any]) -> None:
        super()._check_projected(group)
        ratio = float(group["rand_ratio"])
        if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
            raise ValueError(f"rand_ratio must be in [0, 1], got {group['rand_ratio']!r}")
        if 0.0 < ratio < 1.0 and (group["total_steps"] is None or int(group["total_steps"]) < 1):
            raise ValueError(
                f"rand_ratio={ratio} needs total_steps (the run length), got {group['total_steps']!r}"
            )
        if ratio < 1.0 and group["proj_type"] == "full":
            raise ValueError("GoLore's random basis has one side: proj_type='full' needs rand_ratio=1")
        if ratio < 1.0 and group["basis"] == "random":
            raise ValueError("GoLore draws its own random basis: use an SVD-family basis before the switch")


__all__ = ["GOLORE_BASIS", "GoLoreAdamW", "GoLoreBasis", "orthonormal_basis", "switched"]
