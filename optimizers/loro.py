"""LORO: the Low-rank Riemannian Optimizer (Mo et al., "Parameter and Memory Efficient Pretraining
via Low-rank Riemannian Optimization", ICLR 2025; reference code mzf666/LORO-main,
loro_torch/loro_optim.py).

A Low-Rank model keeps each target weight as a product W = B A (B m x r, A r x n; any constant scale
s = alpha / r sits outside and is unaffected). Its gradients are dL/dB = G A^T and dL/dA = B^T G
with G = dL/d(B A). LORO steps the pairs in two ways:

* lazy step (every step but one in K): Adam on B and A, each with its own moments, at the learning
  rate times ``lazy_lr_scale`` (default r / min(m, n); LORO's ``lr_scaler = -1``, r / d_model, is
  the same number for every LLaMA target, whose hidden size d_model is the smaller side);
* exact step (every K-th update of the pair): the Riemannian gradient step on the manifold of
  rank-r matrices at W = B A, then a retraction back to rank r. With thin QRs B = U R_B and
  A^T = V R_A (so W = U R_B R_A^T V^T, U and V orthonormal), the tangent-space projection of a
  full gradient G is

      P(G) = U U^T G + G V V^T - U U^T G V V^T,

  and LORO obtains the two factors it needs without forming G from the factor gradients:
  G V = dB R_A^{-1} and U^T G = R_B^{-T} dA. The stepped point W - eta P(G) has rank <= 2r:

      W - eta P(G) = [U, G V] [[(R_B R_A^T + eta U^T G V) V^T - eta U^T G], [-eta V^T]],

  an (m x 2r) (2r x n) product, which is retracted to rank r by its truncated SVD computed the way
  the weight refactorization computes every SVD of a factor pair: two thin QRs and a small-core
  SVD (`optimizers.refactorization.balanced_factors` with ``rank=r``), returning the balanced
  split B = U_r S_r^1/2, A = S_r^1/2 V_r^T. The m x n matrix is never formed.

As in LORO's code, the exact step's "gradients" dB and dA are the Adam directions of the step
(M / (sqrt(V) + eps) after this step's moment update) and eta is the bias-corrected step size
eta_t = eta sqrt(1 - beta2^t) / (1 - beta1^t) (no ``lazy_lr_scale``, no weight decay). After an
exact step LORO refreshes every Adam state (m, v and t to zero) and re-warms the learning rate
over a few steps; in the toolkit that is the `optimizers.restarts.Restarts` wrapper with
``every = K``, no refactorization and a momentum reset, and the restarts' LR recovery ramp
(`recovery_factor`): the registry passes ``restarts.every`` as ``exact_every`` so the two agree.
Its counter of pair updates, ``loro_step``, is kept apart from Adam's ``step`` so the reset does
not move the exact-step schedule.

Param groups are torch's; a group with ``factor_pairs: True`` (`PAIRS_KEY`) lists the pairs as
``[B_1, A_1, B_2, A_2, ...]`` (what `effpretrain.models.factor_pairs` gives, flattened; the toolkit
builds that group from the registry's `MethodSpec.steps_factor_pairs`). Every other group, and a
pair whose B or A has no gradient, runs plain Adam. Adam follows LORO's code ("reference"
convention, the old transformers AdamW: N = M / (sqrt(V) + eps), eta_t as above, decoupled weight
decay W <- W - eta lambda W after the update; ``adam_convention="torch"`` gives torch.optim.AdamW).
LORO's code decays the factors with eta_t instead of eta; every LORO script runs without weight
decay, where the two agree.

State per parameter: ``step`` (int t, Adam's, reset by the restarts), ``exp_avg`` and
``exp_avg_sq`` (the parameter's shape and dtype), and for paired parameters ``loro_step`` (int,
the pair's updates; never reset). `LOROAdamW.state_bytes` is 2 numel s (the counters are python
ints). A first step on all-zero gradients with no state yet (a distributed-checkpoint loader's) only
allocates the state, as `Restarts` does not count it either.

FSDP2: B and A are sharded by rows. Lazy steps are element-wise on each rank's shard; an exact step
gathers the whole B, A and their Adam directions (one all-gather each, as the refactorization
does), every rank computes the same retraction and keeps its own rows, so all ranks and one
process agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from optimizers import FACTOR_PAIRS_KEY as PAIRS_KEY
from optimizers._owners import OwnerPlaced
from optimizers._sharded import is_dtensor, local, shard_group, whole, write_whole_
from optimizers.precision import full_fp32
from optimizers.projected_adam import ADAM_CONVENTIONS, _decay, adam_update
from optimizers.refactorization import balanced_factors
from optimizers.writer import written

__all__ = ["PAIRS_KEY", "LOROAdamW", "riemannian_step"]

LORO_STEP = "loro_step"
"""A paired parameter's count of its pair's updates (int; not reset with Adam's moments)."""


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    # As the refactorization: QR, triangular solves and SVD in fp32 at least.
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


@torch.no_grad()
@full_fp32()
def riemannian_step(B: Tensor, A: Tensor, dB: Tensor, dA: Tensor, lr: float) -> tuple[Tensor, Tensor]:
    """LORO's exact step: W = B A moved by -lr times the tangent-space projection of G, retracted.

    With B = U R_B and A^T = V R_A (thin QRs), G V = dB R_A^{-1} and U^T G = R_B^{-T} dA; the
    stepped point is the rank-<= 2r product given in the module docstring, and the result is its
    rank-r truncated SVD, balanced (B' = U_r S_r^1/2, A' = S_r^1/2 V_r^T). If dB = G A^T and
    dA = B^T G for some m x n G, then B' A' = T_r(W - lr P_W(G)) with T_r the truncated SVD.
    B and A need full rank r (R_B, R_A invertible): the manifold's tangent space is only defined
    there, as in LORO's code (torch.linalg.solve); a rank-deficient pair gives non-finite factors.

    Args:
        B: m x r factor (full column rank).
        A: r x n factor (full row rank).
        dB: m x r gradient (or Adam direction) of B.
        dA: r x n gradient (or Adam direction) of A.
        lr: the step size.

    Returns:
        (B', A') in the compute dtype (fp32, or fp64 for fp64 inputs); inputs are not modified.
    """
    dtype = _compute_dtype(B, A, dB, dA)
    r = B.shape[1]
    U, R_B = torch.linalg.qr(B.detach().to(dtype))
    V, R_A = torch.linalg.qr(A.detach().to(dtype).T)
    GV = torch.linalg.solve_triangular(R_A, dB.detach().to(dtype), upper=True, left=False)
    UtG = torch.linalg.solve_triangular(R_B.T, dA.detach().to(dtype), upper=False)
    core = R_B @ R_A.T + lr * (UtG @ V)
    top = core @ V.T - lr * UtG
    del UtG
    B2 = torch.cat([U, GV], dim=1)
    del U, GV
    A2 = torch.cat([top, V.T.mul(-lr)], dim=0)
    del top, V
    return balanced_factors(B2, A2, rank=r)


def _whole_like(p: Tensor, t: Tensor) -> Tensor:
    """The whole tensor of which `t` is this rank's shard laid out like `p` (`t` itself unsharded)."""
    if not is_dtensor(p):
        return t
    from torch.distributed.tensor import DTensor

    return whole(DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()))


def _all_zero(grads: list[Tensor]) -> bool:
    """Whether every gradient is zero everywhere (decided on the whole tensors under FSDP2)."""
    flag = torch.zeros((), device=local(grads[0]).device)
    for g in grads:
        flag = torch.maximum(flag, local(g).ne(0).any().to(flag.dtype))
    group = next((shard_group(g) for g in grads if is_dtensor(g)), None)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return not bool(flag)


class LOROAdamW(OwnerPlaced, torch.optim.Optimizer):
    """LORO over factor-pair groups, Adam over the rest (see the module docstring for the maths).

    Args:
        params: parameters or param groups (torch format); a group with ``factor_pairs: True`` holds
            (B, A) pairs as ``[B_1, A_1, B_2, A_2, ...]``.
        lr: learning rate eta.
        betas: (beta1, beta2).
        eps: epsilon (LORO's 1e-6).
        weight_decay: decoupled weight decay lambda (lazy and Adam steps only).
        correct_bias: Adam's bias correction.
        adam_convention: "reference" (LORO's code) or "torch" (torch.optim.AdamW).
        exact_every: K, an exact step on every K-th update of a pair (LORO's ``loro_freq``).
        lazy_lr_scale: the lazy steps' LR multiplier for the factors; None: r / min(m, n) per pair.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        adam_convention: str = "reference",
        exact_every: int = 500,
        lazy_lr_scale: float | None = None,
    ) -> None:
        if lr < 0.0 or eps < 0.0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"LORO needs lr >= 0, eps >= 0 and betas in [0, 1); got {lr}, {eps}, {betas}")
        if adam_convention not in ADAM_CONVENTIONS:
            raise ValueError(f"adam_convention must be one of {ADAM_CONVENTIONS}, got {adam_convention!r}")
        if not isinstance(exact_every, int) or isinstance(exact_every, bool) or exact_every < 1:
            raise ValueError(f"exact_every must be an int >= 1, got {exact_every!r}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "correct_bias": correct_bias,
            "adam_convention": adam_convention,
            "exact_every": exact_every,
            "lazy_lr_scale": lazy_lr_scale,
            PAIRS_KEY: False,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group[PAIRS_KEY]:
                self._check_pairs(group["params"])

    @staticmethod
    def _check_pairs(params: list[Tensor]) -> None:
        if len(params) % 2:
            raise ValueError("a factor_pairs group lists (B, A) pairs: it needs an even number of params")
        for B, A in zip(params[::2], params[1::2]):
            if (
                B.ndim != 2
                or A.ndim != 2
                or B.shape[1] != A.shape[0]
                or B.shape[1] > min(B.shape[0], A.shape[1])
            ):
                raise ValueError(
                    f"a factor pair needs B (m x r) and A (r x n) with r <= min(m, n); "
                    f"got {tuple(B.shape)} and {tuple(A.shape)}"
                )

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """``exp_avg`` and ``exp_avg_sq`` in the parameter dtype: ``2 * numel * itemsize`` (``step``
        and ``loro_step`` are python ints)."""
        return 2 * math.prod(shape) * dtype.itemsize

    @classmethod
    def exact_step_transient_bytes(cls, m: int, n: int, rank: int, dtype: torch.dtype) -> int:
        """An upper bound of the temporaries of one pair's exact step: the whole B, A and their
        Adam directions in the parameter dtype (``2 s r (m + n)``, gathered under FSDP2), and in
        fp32 the QR factors, G V and U^T G, the 2r-wide product's factors, their QRs, the rotated
        singular vectors and the result (``4 * 9 r (m + n)``) with the r x r and 2r x 2r cores
        (``4 * 24 r^2``)."""
        return 2 * dtype.itemsize * rank * (m + n) + 4 * (9 * rank * (m + n) + 24 * rank * rank)

    # ------------------------------------------------------------------ steps

    @staticmethod
    def _init_state(p: Tensor, state: dict[str, Any], paired: bool) -> None:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p)  # an FSDP2 shard stays a shard
        state["exp_avg_sq"] = torch.zeros_like(p)
        if paired:
            state[LORO_STEP] = 0

    @staticmethod
    def _adam(grad: Tensor, state: dict[str, Any], group: dict[str, Any]) -> tuple[Tensor, float]:
        """Counts Adam's step and advances the moments: (N, eta_t) on this rank's shard."""
        state["step"] += 1
        return adam_update(local(state["exp_avg"]), local(state["exp_avg_sq"]), grad, state["step"], group)

    @staticmethod
    def _write(p: Tensor, norm: Tensor, step_size: float, group: dict[str, Any]) -> None:
        # Through the parameter itself, not its local view: the writer keys an FSDP2 shard's
        # rounding noise by the parameter's plan and the shard's row offset.
        with written(p) as w:
            _decay(w, group, before=True)
            w.add_(norm, alpha=-step_size)
            _decay(w, group, before=False)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update, placed by `OwnerPlaced._placed_step` (the closure, then every parameter
        with a gradient on its local shard, at full fp32: the QRs and SVD of the exact step): lazy
        or exact steps for the pairs, Adam for everything else.

        A pair's update is per parameter where it can be: B's Adam direction (and its lazy step),
        then A's, whose step also makes the pair's exact step when it is due (B, stepped just
        before it, waits for it). Parameters are stepped in order and a pair's B and A are
        neighbours in it, so this is the order of the pair-at-once rule.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).
        """
        params = self._flat_params()
        partner: dict[int, int] = {}  # a paired parameter's index -> its partner's
        start = 0
        for group in self.param_groups:
            if group[PAIRS_KEY]:
                for b in range(start, start + len(group["params"]), 2):
                    partner[b], partner[b + 1] = b + 1, b
            start += len(group["params"])
        waiting: dict[int, tuple[Tensor, float]] = {}  # a B's (N, eta_t), until its A's step

        def step_one(w: Tensor, g: Tensor, state: dict[str, Any], group: dict[str, Any], index: int) -> None:
            mate = partner.get(index)
            if mate is None or params[mate].grad is None:
                # Not paired, or half a pair: no Riemannian step can be formed, Adam alone.
                norm, eta = self._adam(g, state, group)
                self._write(params[index], norm, eta, group)
            else:
                self._pair_part(params, index, mate, g, state, group, waiting)

        return self._placed_step(
            closure,
            steps_whole=lambda group, p: False,
            step_one=step_one,
            init_state=lambda ref, group, state, index: self._init_state(ref, state, group[PAIRS_KEY]),
            skip_zero=False,
            fp32_math=True,
        )

    def _pair_part(
        self,
        params: list[Tensor],
        index: int,
        mate: int,
        grad: Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        waiting: dict[int, tuple[Tensor, float]],
    ) -> None:
        """One factor's part of its pair's update (B first, then A; see `step`): its Adam
        direction, then the lazy step, or, at A when the pair's count reaches a multiple of K, the
        exact step of both. Both lazy steps use B's eta_t, as the exact step does."""
        norm, eta = self._adam(grad, state, group)
        state[LORO_STEP] += 1
        is_b = mate > index
        b, a = (index, mate) if is_b else (mate, index)
        B, A = params[b], params[a]
        exact = self.state[B][LORO_STEP] % group["exact_every"] == 0
        if is_b:
            waiting[b] = (norm, eta)
            if exact:
                return
        else:
            nB, eta = waiting.pop(b)
            if exact:
                new_B, new_A = riemannian_step(
                    whole(B), whole(A), _whole_like(B, nB), _whole_like(A, norm), eta
                )
                write_whole_(B, new_B)
                write_whole_(A, new_A)
                return
        scale = group["lazy_lr_scale"]
        if scale is None:
            scale = B.shape[1] / min(B.shape[0], A.shape[1])
        self._write(params[index], norm, eta * scale, group)

    def _step_placed(self, *args: Any, **kwargs: Any) -> None:
        """The driver's step after the closure, but for LORO's dummy step, which is one decision
        over every parameter (not the driver's per-parameter `skip_zero`, which could step one
        factor of a pair and not the other): a first step with no state yet on all-zero gradients
        (a distributed-checkpoint loader's) only allocates the state, as `Restarts` does not count
        it either."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        if not self.state and _all_zero(grads):
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        self._init_state(p, self.state[p], g[PAIRS_KEY])
            return
        super()._step_placed(*args, **kwargs)
