"""The factorized layer base and its low-rank kinds: Low-Rank, LoRA, ReLoRA."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from optimizers._sharded import whole, write_whole_

logger = logging.getLogger("effpretrain")


TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def init_on_cpu_(t: Tensor, init: Callable[[Tensor], object]) -> None:
    """Fills `t` with `init` (an ``nn.init`` function) run on the CPU: the values come from torch's
    global CPU generator, which the trainer seeds and checkpoints (`run_state.RngState`), so a
    factor drawn on a GPU (a ReLoRA re-initialisation, a layer built on the device) is the one the
    same run draws on the CPU, on any GPU model and after a resume on other hardware. On a CPU
    tensor it is ``init(t)`` itself; on a meta tensor too (nothing to fill, no draw consumed)."""
    if t.device.type in ("cpu", "meta"):
        init(t)
        return
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu")  # explicit: not a default-device context's
    init(host)
    with torch.no_grad():
        t.copy_(host)


def _kaiming_(t: Tensor) -> None:
    # nn.Linear's default: kaiming_uniform(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    init_on_cpu_(t, lambda x: nn.init.kaiming_uniform_(x, a=math.sqrt(5)))


def sparse_nnz(m: int, n: int, density: float) -> int:
    """floor(density * m * n), exact for decimal densities (0.29 * 100 is 29, not 28)."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"SLTrain density must be in (0, 1], got {density}")
    return math.floor(Fraction(str(density)) * m * n)


class FactorizedLinear(nn.Module):
    """Shared base: shapes, the scale s = alpha / r, the factors B (m x r) and A (r x n), a bias.

    Subclasses define `forward` and `dense_weight`. `bias`: None/False for none, the (trainable)
    bias parameter of the Linear being replaced, or True for a new one initialised as nn.Linear's.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        bias: nn.Parameter | bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= rank <= min(in_features, out_features):
            raise ValueError(f"rank {rank} must be in [1, min(m, n)={min(in_features, out_features)}]")
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        self.alpha = float(alpha)
        self.scale = self.alpha / rank
        kw = {"device": device, "dtype": dtype}
        self.B = nn.Parameter(torch.empty(out_features, rank, **kw))
        self.A = nn.Parameter(torch.empty(rank, in_features, **kw))
        if bias is True:
            bias = nn.Parameter(torch.empty(out_features, **kw))
            bound = 1.0 / math.sqrt(in_features)
            init_on_cpu_(bias, lambda x: nn.init.uniform_(x, -bound, bound))
        self.register_parameter("bias", None if bias is None or bias is False else bias)

    def factor_pair(self) -> tuple[nn.Parameter, nn.Parameter]:
        """(B, A), the pair refactorization re-splits; B A is all of the low-rank part."""
        return self.B, self.A

    def _low_rank_fp32(self) -> Tensor:
        return self.scale * (self.B.detach().float() @ self.A.detach().float())

    def dense_weight(self) -> Tensor:
        """The m x n effective weight, computed in fp32 and returned in the factors' dtype."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha:g}, bias={self.bias is not None}"
        )


class LowRankLinear(FactorizedLinear):
    """Pure factorization y = s B (A x) + b with no dense weight (benchmark section "Low-Rank").

    Both factors Kaiming-uniform (B is not zero: B A is the whole weight, so a zero B would start
    the layer at W = 0). Memory O((m + n) r) for weights, grads and Adam state.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        bias: nn.Parameter | bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, rank, alpha, bias, device, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _kaiming_(self.A)
        _kaiming_(self.B)

    @torch.no_grad()
    def from_dense_(self, weight: Tensor) -> None:
        """Starts from a pretrained m x n `weight` W: W = U S V^T (fp32 SVD), B = U_r sqrt(S_r / s),
        A = sqrt(S_r / s) V_r^T, so s B A = U_r S_r V_r^T, W's best rank-r approximation, with the
        factors balanced (equal singular values)."""
        u, sv, vh = torch.linalg.svd(weight.detach().float(), full_matrices=False)
        root = (sv[: self.rank] / self.scale).sqrt()
        self.B.copy_(u[:, : self.rank] * root)
        self.A.copy_(root[:, None] * vh[: self.rank])

    def forward(self, x: Tensor) -> Tensor:
        # Scale the r-dim intermediate: cheaper than scaling the output.
        return F.linear(F.linear(x, self.A) * self.scale, self.B, self.bias)

    @torch.no_grad()
    def dense_weight(self) -> Tensor:
        return self._low_rank_fp32().to(self.B.dtype)


class LoRALinear(FactorizedLinear):
    """LoRA for pretraining: y = W0 x + s B (A x) + b, W0 frozen at its random init.

    `weight` is W0 (requires_grad False), by default the very Parameter of the replaced Linear, so
    no copy is made. B = 0 and A Kaiming, so the model starts exactly at W0 and B receives gradient
    G (A x)^T != 0 from the first step.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        bias: nn.Parameter | bool | None = None,
        weight: nn.Parameter | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, rank, alpha, bias, device, dtype)
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
            _kaiming_(weight)
        if tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"W0 has shape {tuple(weight.shape)}, expected {(out_features, in_features)}")
        weight.requires_grad_(False)
        self.weight = weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A Kaiming-uniform, B zero (W0 untouched)."""
        _kaiming_(self.A)
        nn.init.zeros_(self.B)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(x, self.A) * self.scale, self.B)

    @torch.no_grad()
    def dense_weight(self) -> Tensor:
        return (self.weight.float() + self._low_rank_fp32()).to(self.weight.dtype)


class ReLoRALinear(LoRALinear):
    """LoRA whose update is periodically merged into W0 and restarted (ReLoRA).

    Every N steps `merge_and_reinit_()`: W0 <- W0 + s B A (fp32, cast back), then A Kaiming and
    B = 0 again, so the layer's function is unchanged by the merge and the next N steps learn a new
    rank-r update on top: the sum of updates can reach full rank. The optimizer state of B and A
    must then be reset or pruned (see `relora_merge_`), always after the merge.

    Full-rank warm start (ReLoRA's authors train the model full rank before the first LoRA cycle;
    `factor.warm_start_steps`): `begin_warm_start_` makes W0 trainable and freezes B (= 0) and A, so
    the layer is a plain Linear y = W0 x + b being trained; `end_warm_start_` switches back. Only
    `requires_grad` changes: the parameters, and so the state_dict keys, are the same in both phases.
    """

    @torch.no_grad()
    def merge_and_reinit_(self) -> None:
        """W0 <- W0 + s B A (fp32 then cast), then A <- Kaiming, B <- 0. Output is preserved.

        Under FSDP2 (DTensor W0, B, A) the merge runs on the whole tensors (gathered on every
        rank) and the new A is drawn whole on every rank from the same RNG state (the trainer's
        ranks share it), each rank keeping its shard: the result is a single process's. The new A
        is drawn on the CPU from torch's global generator and copied (`init_on_cpu_`), so it does
        not depend on the device.
        """

        w, b, a = whole(self.weight), whole(self.B), whole(self.A)
        write_whole_(self.weight, (w.float() + self.scale * (b.float() @ a.float())).to(w.dtype))
        new_a = torch.empty(a.shape, dtype=a.dtype, device=a.device)
        _kaiming_(new_a)
        write_whole_(self.A, new_a)
        self.B.zero_()
