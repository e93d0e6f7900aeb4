"""Basis policies of the projected methods: a basis computed from the gradient (GaLore's SVD,
randomized SVD) and stored, or a seeded random one regenerated from integers (APOLLO); when a
refresh is due; one projected step's view of a matrix."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from optimizers import projection as proj
from optimizers._adam import STEP

BASIS = "basis"
"""P, the stored projection basis (absent for regenerated random bases)."""
REFRESH = "refresh"
"""k, bases computed (or random bases drawn) so far (int)."""
SEED = "seed"
"""The parameter's own seed (int), from the group's ``seed`` and its position."""


def refresh_due(state: dict[str, Any], group: dict[str, Any]) -> bool:
    """Whether this step starts with a new basis: none yet, or t % T == 0 on the pre-increment t."""
    return state[REFRESH] == 0 or state[STEP] % int(group["update_proj_gap"]) == 0


class BasisPolicy(Protocol):
    """When and how a projected parameter's basis P changes (`ComputedBasis`, `SeededRandomBasis`)."""

    def init_state(
        self, state: dict[str, Any], p: torch.Tensor, group: dict[str, Any], side: str, index: int
    ) -> None:
        """Sets the policy's state keys (``refresh``, ``seed``, ...) for the param at `index`."""

    def basis(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        side: str,
        stats: proj.RefreshStats,
    ) -> torch.Tensor | None:
        """P for this step (refreshed first when due), or None to skip the param this step."""

    def nbytes(self, shape: tuple[int, ...], group: dict[str, Any], side: str, dtype: torch.dtype) -> int:
        """Bytes of the policy's state tensors."""


class ComputedBasis:
    """Basis policy of the SVD family and the identity: P is recomputed from G when due and stored.

    State: ``basis`` (P, parameter dtype; s prod(basis_shape) bytes), ``refresh`` (k), ``seed``
    (mix_seed(group seed, parameter index): randomized_svd's sketch k is drawn from
    mix_seed(seed, k) and warm-started from the previous P).
    """

    def init_state(
        self, state: dict[str, Any], p: torch.Tensor, group: dict[str, Any], side: str, index: int
    ) -> None:
        state[REFRESH] = 0
        state[SEED] = proj.mix_seed(int(group["seed"]), index)
        # Allocated now (zeros) so a dummy step materialises every key with its final shape.
        bshape = proj.basis_shape(tuple(p.shape), group["rank"], side, group["basis"])
        state[BASIS] = torch.zeros(bshape, dtype=p.dtype, device=p.device)

    def basis(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        side: str,
        stats: proj.RefreshStats,
    ) -> torch.Tensor | None:
        """P for this step (parameter dtype), recomputed first when due (counted in `stats`).

        Returns None only when no basis exists yet and computing the first one failed; the caller
        then skips the parameter without advancing its counter, so the next step retries.
        """
        if not refresh_due(state, group):
            return state[BASIS]  # most steps: nothing else to do
        prev = state[BASIS] if state[REFRESH] > 0 else None
        failed = stats.failed
        new = proj.compute_basis(
            grad,
            group["rank"],
            side,
            group["basis"],
            prev,
            seed=state[SEED],
            refresh=state[REFRESH] + 1,
            oversample=group["oversample"],
            power_iters=group["power_iters"],
            warm_start=group["warm_start"],
            stats=stats,
        )
        if stats.failed > failed:
            return prev
        state[BASIS].copy_(new)
        state[REFRESH] += 1
        return state[BASIS]

    def nbytes(self, shape: tuple[int, ...], group: dict[str, Any], side: str, dtype: torch.dtype) -> int:
        """s prod(basis_shape): k n (right), m k (left) or k (m + n) (full) entries."""
        return math.prod(proj.basis_shape(shape, int(group["rank"]), side, group["basis"])) * dtype.itemsize


class SeededRandomBasis:
    """Basis policy of ``basis="random"`` (APOLLO, Zhu et al. 2024): a Gaussian P with N(0, 1/r)
    entries, regenerated every step from integers and never stored (0 bytes).

    On a due refresh the stream moves to its next basis (`advance`) and k is counted; every step
    then draws P with `projection.gaussian_basis` from `generator_seed` (a CPU generator, so P is
    the same on any hardware; on a GPU the CPU draw is held until the next refresh). This stream ("mix"):
    the parameter's seed is mix_seed(group seed, index) and basis k is drawn from
    mix_seed(seed, k) (`projection.random_basis`), independent of how many came before. Other
    streams (apollo-torch's seed chain) override `param_seed`, `advance` and `generator_seed`.
    """

    def param_seed(self, group: dict[str, Any], index: int) -> int:
        """Seed of the parameter at position `index` (over all groups)."""
        return proj.mix_seed(int(group["seed"]), index)

    def advance(self, state: dict[str, Any]) -> None:
        """Moves the stream to its next basis, before ``refresh`` counts it (nothing to do here)."""

    def generator_seed(self, state: dict[str, Any]) -> int:
        """Seed of the generator that draws the current basis."""
        return proj.mix_seed(state[SEED], state[REFRESH])

    def init_state(
        self, state: dict[str, Any], p: torch.Tensor, group: dict[str, Any], side: str, index: int
    ) -> None:
        state[REFRESH] = 0
        state[SEED] = self.param_seed(group, index)

    def basis(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        side: str,
        stats: proj.RefreshStats,
    ) -> torch.Tensor:
        """P for this step (parameter dtype); a due refresh only moves to the next one."""
        due = refresh_due(state, group)
        t0 = time.perf_counter()
        if due:
            self.advance(state)
            state[REFRESH] += 1
            stats.count += 1
        seed = self.generator_seed(state)
        basis = proj.gaussian_basis(
            tuple(p.shape), int(group["rank"]), side, seed, device=p.device, dtype=p.dtype, holder=p
        )
        if due:
            stats.seconds += time.perf_counter() - t0
        return basis

    def nbytes(self, shape: tuple[int, ...], group: dict[str, Any], side: str, dtype: torch.dtype) -> int:
        return 0


COMPUTED_BASIS = ComputedBasis()


@dataclass(slots=True)
class ProjectedStep:
    """What `ProjectedAdam._projected_update` gets for one projected m x n parameter and step.

    Attributes:
        p: the weight W.
        grad: G.
        low: R = proj(G).
        norm: N, the Adam-normalised R (see `adam_update`).
        basis: P (parameter dtype).
        side: "right", "left" or "full" (see `projection.choose_side`).
        state: the parameter's state (``state[STEP]`` is t, already counted).
        group: its param group.
    """

    p: torch.Tensor
    grad: torch.Tensor
    low: torch.Tensor
    norm: torch.Tensor
    basis: torch.Tensor
    side: str
    state: dict[str, Any]
    group: dict[str, Any]

    def back(self, x: torch.Tensor) -> torch.Tensor:
        """back(x) = x P (right), P x (left) or P_L x P_R (full): from R's space to G's."""
        return proj.project_back(x, self.basis, self.side, m=self.p.shape[0])
