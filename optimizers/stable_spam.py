"""Stable-SPAM and SPAM: Adam with spike-aware gradient clipping and periodic momentum reset.

SPAM (Huang et al. 2025, arXiv 2501.06842) clips gradient entries that spike far above Adam's
second moment, zeroes the moments every ΔT steps and re-warms the step size after each reset.
Stable-SPAM (Huang et al. 2025, arXiv 2502.17055) replaces the fixed spike threshold by adaptive
per-tensor statistics (an EMA of max|G| for element-wise clipping, EMAs of ||G|| and ||G||^2 for
norm scaling), keeps the periodic reset and anneals beta1 over the run. Huang et al. 2025; docs/methods.md (Stable-SPAM).

Both keep all state per parameter (so DDP, Accelerate and the HF Trainer need nothing special)
and hold only tensors and python ints. Under FSDP2 (DTensor parameters sharded across ranks) each
rank updates its own shard: SPAM is element-wise, and Stable-SPAM's per-tensor statistics are
those of the whole tensor: max|G| by an all-reduce (max), ||G|| from fp64 partial sums of
squares added by an all-reduce (sum), which is also how a single process computes it, so a
sharded run takes the same steps as one process. Moments are sharded like the parameter; the
scalar EMAs are whole (identical) on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch

from optimizers._adam import adamw_step_
from optimizers._owners import OwnerPlaced
from optimizers._sharded import local as _local
from optimizers._sharded import shard_group as _shard_group
from optimizers._sharded import whole_max_abs as _whole_max_abs
from optimizers._sharded import whole_norm as _whole_norm

__all__ = ["SPAM", "StableSPAM"]


def _init_adam_state(state: dict[str, Any], p: torch.Tensor) -> None:
    """Adam's step counters and zero moments (shaped, and under FSDP2 sharded, like `p`)."""
    state["step"] = 0
    state["global_step"] = 0
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _cosine(progress: float) -> float:
    """Half-cosine from 1 (progress 0) to 0 (progress >= 1)."""
    return 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))


class StableSPAM(OwnerPlaced, torch.optim.Optimizer):
    r"""Stable-SPAM: AdamW with adaptive clipping, adaptive norm scaling and momentum reset.

    The default, ``rule="official"``, is the rule of the official code (TianjinYellow/StableSPAM,
    galore_torch/stablespam.py), which the benchmark ran unchanged (OptimAI-Lab/
    Memory_Efficient_Pretraining, para_eff_pt/pt_stable_spam/stablespam.py); See docs/methods.md (Stable-SPAM).
    For each parameter tensor with gradient G at global step t (1-based, counted per tensor),
    with Adam's step counter k (advanced first, k = t until the first reset) and the annealing
    factor s_t:

    0. Annealing: a cosine over T + 1 steps (T = `total_steps`) from 1 to s_min = `anneal_min`::

           s_t = s_min + (1 - s_min) (1 + cos(pi min(t, T + 1) / (T + 1))) / 2

       (the official code's CosineAnnealingLR(T_max = T + 1) is periodic and would rise again
       after step T + 1; we hold s_min there, which only matters past the run's end).
    1. Adaptive element-wise clipping (AdaClip), theta = `theta`::

           T_t  = theta T_{t-1} + (1 - theta) max|G|,     T^_t = T_t / (1 - theta^k)
           G_ij <- G_ij * T^_t / max|G|   where |G_ij| > T^_t        (clip_rule="rescale")
           G_ij <- sign(G_ij) T^_t        where |G_ij| > T^_t        (clip_rule="clamp")

       "rescale" is what the official code does (the largest entry lands exactly on T^_t, the
       others above it are scaled by the same factor); "clamp" is the literal reading of
       "entries above it are scaled down to it", kept as a knob.
    2. Adaptive gradient-norm scaling (AdaGN) on the clipped G, gamma1 annealed::

           m_t = (gamma1 s_t) m_{t-1} + (1 - gamma1 s_t) ||G||,   v_t = gamma2 v_{t-1} + (1 - gamma2) ||G||^2
           m^_t = m_t / (1 - (gamma1 s_t)^k),   v^_t = v_t / (1 - gamma2^k)
           G  <- G / ||G|| * m^_t / (sqrt(v^_t) + eps)               (unchanged when ||G|| = 0)

       T_t, m_t and v_t are never reset, but their bias correction uses k, which every momentum
       reset restarts: right after a reset 1 - theta^k is tiny, T^_t is hundreds of times T_t
       (clipping is effectively off) and v^_t is inflated likewise.
    3. Adam with beta1_t = beta1 s_t, as torch.optim.AdamW computes it (decay first)::

           p <- p (1 - lr lambda);  m <- beta1_t m + (1 - beta1_t) G;  v <- beta2 v + (1 - beta2) G^2
           p <- p - lr / (1 - beta1_t^k) m / (sqrt(v / (1 - beta2^k)) + eps)
    4. Momentum reset (MoRet) when t is a multiple of Delta T = `reset_interval`: steps 1-2 use
       the advanced k as usual, step 3 advances the old moments and applies them with k = 1
       bias correction, and only then are m and v replaced by zeros and k set to 1, so the next
       step uses k = 2 with moments that hold one gradient.

    ``rule="global_step"`` is the rule this class ran before (kept for comparison): T^_t, m^_t
    and v^_t are bias-corrected with the global step t (matching the never-reset EMAs); at a
    reset m, v and k restart from zero before the update (the boundary step is step k = 1 of
    fresh moments); and s_t is the cosine over T steps,
    s_t = s_min + (1 - s_min) (1 + cos(pi min(t, T) / T)) / 2. On spiky synthetic gradients the
    two rules' updates differ by ~25% per step after a reset (median; tests/optimizers).

    Differences from the official code, on purpose: t and the reset schedule are counted per
    tensor (the official code counts optimizer steps, the same when every parameter has a
    gradient each step, and does not save its count in the state dict); the official code
    also writes the clipped values into p.grad, ours leaves p.grad alone. The scalar statistics
    T_t, m_t, v_t are fp32 whatever the parameter dtype. In pure bf16 the official code keeps
    them as bf16 scalars, where an EMA with coefficient 0.999 stops moving: 0.999 T rounds back
    to T (bf16's half-ulp is 2^-9 to 2^-8 relative), so T_t and v_t never decay and rise only on
    a sample more than 2-4 times their value (on steady gradients T_t stalls at a fraction of
    max|G|), while m_t (coefficient 0.425-0.85) keeps moving at bf16's 3 significant digits.
    We follow the fp32 rule instead (bf16 cannot even represent 0.999).

    With adaptive_clip=False, norm_scaling=False, reset_interval=0 and total_steps=None the
    optimizer is exactly torch.optim.AdamW (same lr, betas, eps, weight_decay), under either rule.

    Args:
        params: Parameters or param groups (torch format). Every option below may be set per group.
        lr: Learning rate eta.
        betas: (beta1, beta2) of Adam; beta1 is the start value of the annealed beta1_t.
        eps: epsilon of Adam and of the norm scaling denominator.
        weight_decay: Decoupled weight decay lambda.
        gamma1: gamma1, EMA coefficient of ||G|| (annealed by s_t). Paper default 0.85.
        gamma2: gamma2, EMA coefficient of ||G||^2. Paper default 0.999.
        theta: theta, EMA coefficient of max|G| for the clipping threshold. Paper default 0.999.
        total_steps: T, the run length for the cosine annealing of beta1 and gamma1 (the official
            code's total_T). None turns annealing off (s_t = 1); pass the run's optimizer steps.
        anneal_min: Final value of the annealing factor s_t (official eta_min, 0.5).
        reset_interval: Delta T, steps between momentum resets (paper 500); 0 never resets.
        adaptive_clip: Switches step 1 (AdaClip) on or off.
        clip_rule: "rescale" (official code, default) or "clamp"; see step 1.
        norm_scaling: Switches step 2 (AdaGN) on or off.
        rule: "official" (default) or "global_step"; see above.

    State per parameter: ``step`` (int, Adam step k, restarted by resets), ``global_step``
    (int, t), ``exp_avg`` and ``exp_avg_sq`` (param shape and dtype), and the fp32 scalars
    ``exp_avg_max`` (T_t), ``exp_avg_norm`` (m_t) and ``exp_avg_norm_sq`` (v_t).
    """

    # Scalar EMAs kept in fp32 whatever the param dtype (bf16 cannot even represent 0.999).
    _FP32_KEYS = ("exp_avg_max", "exp_avg_norm", "exp_avg_norm_sq")
    RULES = ("official", "global_step")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        gamma1: float = 0.85,
        gamma2: float = 0.999,
        theta: float = 0.999,
        total_steps: int | None = None,
        anneal_min: float = 0.5,
        reset_interval: int = 500,
        adaptive_clip: bool = True,
        clip_rule: str = "rescale",
        norm_scaling: bool = True,
        rule: str = "official",
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid lr {lr}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if eps < 0.0:
            raise ValueError(f"invalid eps {eps}: must be >= 0")
        for name, val in (("gamma1", gamma1), ("gamma2", gamma2), ("theta", theta)):
            if not 0.0 <= val < 1.0:
                raise ValueError(f"invalid {name} {val}: must be in [0, 1)")
        if total_steps is not None and total_steps <= 0:
            raise ValueError(f"invalid total_steps {total_steps}: must be > 0 or None")
        if reset_interval < 0:
            raise ValueError(f"invalid reset_interval {reset_interval}: must be >= 0")
        if clip_rule not in ("rescale", "clamp"):
            raise ValueError(f"invalid clip_rule {clip_rule!r}: choose 'rescale' or 'clamp'")
        if rule not in self.RULES:
            raise ValueError(f"invalid rule {rule!r}: choose 'official' or 'global_step'")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            gamma1=gamma1,
            gamma2=gamma2,
            theta=theta,
            total_steps=total_steps,
            anneal_min=anneal_min,
            reset_interval=reset_interval,
            adaptive_clip=adaptive_clip,
            clip_rule=clip_rule,
            norm_scaling=norm_scaling,
            rule=rule,
        )
        super().__init__(params, defaults)

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Exact bytes of state tensors one parameter holds after >= 1 step.

        ``2 * numel * itemsize(dtype) + 3 * 4``: exp_avg and exp_avg_sq in the param dtype plus
        three fp32 scalar EMAs; the step counters are python ints (0 bytes). Independent of
        the group options (either rule): the EMAs are kept even when a feature is switched off.
        """
        numel = math.prod(shape)
        return 2 * numel * torch.empty((), dtype=dtype).element_size() + 3 * 4

    def annealing_factor(self, group: dict[str, Any], t: int) -> float:
        """s_t = s_min + (1 - s_min) (1 + cos(pi min(t, S) / S)) / 2 with S = T + 1 (official
        rule) or S = T (global_step rule); 1 without T."""
        total = group["total_steps"]
        if total is None:
            return 1.0
        span = total + 1 if group["rule"] == "official" else total
        lo = group["anneal_min"]
        return lo + (1.0 - lo) * _cosine(t / span)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs one optimization step (see the class docstring for the rule), placed by
        `OwnerPlaced._placed_step`: an FSDP2 shard steps alone, its statistics those of the whole
        tensor (reduced over the parameter's process group). Every gradient steps, a zero one
        included (the reset schedule and the annealing count every step a tensor takes)."""
        params = self._flat_params()
        return self._placed_step(
            closure,
            steps_whole=lambda group, p: False,
            step_one=lambda w, g, state, group, index: self._step_param(params[index], w, g, state, group),
            init_state=lambda ref, group, state, index: self._init_state(ref, state),
            skip_zero=False,
        )

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        _init_adam_state(state, p)
        for key in self._FP32_KEYS:
            state[key] = torch.zeros((), dtype=torch.float32, device=p.device)

    def _step_param(
        self,
        p: torch.Tensor,
        w: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
    ) -> None:
        """Steps 0-4 of the class docstring for parameter `p`, whose local tensor is `w` and local
        gradient `grad` (`p` itself only names the process group of an FSDP2 shard's statistics)."""
        official = group["rule"] == "official"
        interval = group["reset_interval"]
        state["global_step"] += 1
        t = state["global_step"]
        reset = interval > 0 and t % interval == 0
        if reset and not official:
            _zero_moments_(state, 0)
        state["step"] += 1
        k = state["step"]
        s = self.annealing_factor(group, t)
        t_stats = k if official else t

        shards = _shard_group(p)
        if group["adaptive_clip"]:
            grad = _adaptive_clip(grad, state["exp_avg_max"], group, t_stats, shards)
        if group["norm_scaling"]:
            grad = _norm_scale(grad, state, group, s, t_stats, shards)

        beta1, beta2 = group["betas"]
        adamw_step_(
            w,
            grad,
            _local(state["exp_avg"]),
            _local(state["exp_avg_sq"]),
            1 if reset and official else k,
            group["lr"],
            beta1 * s,
            beta2,
            group["eps"],
            group["weight_decay"],
        )
        if reset and official:
            # The official reset: the boundary step used the old moments (with k = 1); the next
            # step starts from zero moments with k = 2.
            _zero_moments_(state, 1)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loader, then the fp32 scalar EMAs restored in fp32 (torch casts them to the
        param dtype, which would make a bf16 resume inexact). A state dict saved before `rule`
        existed ran the global-step rule and keeps it."""
        _load_state_dict_keep_fp32(self, state_dict, self._FP32_KEYS)
        for group in self.param_groups:
            if "rule" not in group:
                group.pop("reset_stats_correction", None)
                group["rule"] = "global_step"


def _zero_moments_(state: dict[str, Any], step: int) -> None:
    """Momentum reset: zero Adam's moments in place and set its step counter to `step`."""
    state["exp_avg"].zero_()
    state["exp_avg_sq"].zero_()
    state["step"] = step


def _adaptive_clip(
    grad: torch.Tensor, ema_max: torch.Tensor, group: dict[str, Any], t_stats: int, shards: Any
) -> torch.Tensor:
    """AdaClip (step 1): updates T_t (`ema_max`, fp32, in place) and returns the clipped G.

    The statistics stay fp32: a bf16 max/threshold would round the EMA away.
    """
    theta = group["theta"]
    g_max = _whole_max_abs(grad, shards)
    ema_max.mul_(theta).add_(g_max, alpha=1 - theta)
    threshold = ema_max / (1 - theta**t_stats)
    spike = grad.abs() > threshold
    if group["clip_rule"] == "rescale":
        # Where nothing spikes, g_max may be 0 and the ratio nan; where() drops it.
        clipped = grad * (threshold / g_max).to(grad.dtype)
    else:
        clipped = grad.sign() * threshold.to(grad.dtype)
    return torch.where(spike, clipped, grad)


def _norm_scale(
    grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any], s: float, t_stats: int, shards: Any
) -> torch.Tensor:
    """AdaGN (step 2): updates m_t and v_t (fp32, in place) and returns G rescaled to m^ / (sqrt(v^) + eps)."""
    gamma1, gamma2 = group["gamma1"] * s, group["gamma2"]
    norm = _whole_norm(grad, shards)
    ema_norm, ema_norm_sq = state["exp_avg_norm"], state["exp_avg_norm_sq"]
    ema_norm.mul_(gamma1).add_(norm, alpha=1 - gamma1)
    ema_norm_sq.mul_(gamma2).add_(norm * norm, alpha=1 - gamma2)
    m_hat = ema_norm / (1 - gamma1**t_stats)
    v_hat = ema_norm_sq / (1 - gamma2**t_stats)
    target = m_hat / (v_hat.sqrt() + group["eps"])
    # A zero gradient (e.g. a checkpoint loader's dummy step) stays zero.
    factor = torch.where(norm > 0, target / norm, torch.ones_like(norm))
    return grad * factor.to(grad.dtype)


class SPAM(OwnerPlaced, torch.optim.Optimizer):
    r"""SPAM: spike-aware AdamW with periodic momentum reset and a cosine re-warm after resets.

    For each parameter tensor with gradient G at global step t (1-based, counted per tensor),
    with v the second moment from the previous step:

    1. Momentum reset: when t is a multiple of `reset_interval` (Delta T, paper 500), exp_avg
       and exp_avg_sq are zeroed before the update. The official code keeps Adam's step counter
       (bias correction continues); `reset_step_counter=True` restarts it too.
    2. Spike-aware clipping, theta = `threshold` (paper 5000)::

           G_ij <- sign(G_ij) sqrt(theta v_ij)    where G_ij^2 > theta v_ij

       skipped during the first `clip_delay` (20) steps after the start and after each reset,
       while v is still too young to define a spike.
    3. AdamW step (torch.optim.AdamW's formula) with the step size multiplied by a re-warm
       factor: after a reset at step t0, for c = t - t0 < N = `warmup_steps` (150),
       mult = 1 - (1 - warmup_start) (1 + cos(pi c / N)) / 2, rising from `warmup_start`
       (0.01) to 1; otherwise 1. Weight decay is not re-warmed.

    Differences from the official code, on purpose: the Adam update uses torch.optim.AdamW's
    eps placement and decay order (the official code uses the HF form sqrt(v) + eps with
    decay after the step), and the cosine re-warm ends exactly at 1 after N steps.

    With threshold=0 and reset_interval=0 the optimizer is exactly torch.optim.AdamW (same lr,
    betas, eps, weight_decay; note SPAM's default eps is 1e-6, torch's 1e-8).

    Args:
        params: Parameters or param groups (torch format). Every option below may be set per group.
        lr: Learning rate eta.
        betas: (beta1, beta2) of Adam.
        eps: epsilon of Adam (official default 1e-6).
        weight_decay: Decoupled weight decay lambda.
        threshold: theta, spike threshold on G^2 / v; 0 disables clipping.
        reset_interval: Delta T, steps between momentum resets; 0 never resets.
        warmup_steps: N, length of the cosine re-warm after each reset; 0 disables it.
        warmup_start: Step-size multiplier right at a reset (official: 1 - 0.99).
        clip_delay: Steps after the start and after each reset without clipping.
        reset_step_counter: Also restart Adam's step (bias correction) at a reset.

    State per parameter: ``step`` (int, Adam step), ``global_step`` (int, t), ``exp_avg`` and
    ``exp_avg_sq`` (param shape and dtype).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        threshold: float = 5000.0,
        reset_interval: int = 500,
        warmup_steps: int = 150,
        warmup_start: float = 0.01,
        clip_delay: int = 20,
        reset_step_counter: bool = False,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"invalid lr {lr}: must be >= 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if eps < 0.0:
            raise ValueError(f"invalid eps {eps}: must be >= 0")
        if threshold < 0.0:
            raise ValueError(f"invalid threshold {threshold}: must be >= 0")
        if reset_interval < 0 or warmup_steps < 0 or clip_delay < 0:
            raise ValueError("reset_interval, warmup_steps and clip_delay must be >= 0")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            threshold=threshold,
            reset_interval=reset_interval,
            warmup_steps=warmup_steps,
            warmup_start=warmup_start,
            clip_delay=clip_delay,
            reset_step_counter=reset_step_counter,
        )
        super().__init__(params, defaults)

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Exact bytes of state tensors one parameter holds after >= 1 step.

        ``2 * numel * itemsize(dtype)``: exp_avg and exp_avg_sq in the param dtype; the step
        counters are python ints (0 bytes).
        """
        return 2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def lr_multiplier(group: dict[str, Any], t: int) -> float:
        """Cosine re-warm factor of the step size at global step t (1 outside a re-warm)."""
        interval, warm = group["reset_interval"], group["warmup_steps"]
        if interval <= 0 or warm <= 0 or t < interval:
            return 1.0
        since = t % interval
        if since >= warm:
            return 1.0
        start = group["warmup_start"]
        return 1.0 - (1.0 - start) * _cosine(since / warm)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Performs one optimization step (see the class docstring for the rule), placed by
        `OwnerPlaced._placed_step`: element-wise, so an FSDP2 shard steps alone. Every gradient
        steps, a zero one included (the reset schedule counts every step a tensor takes)."""
        return self._placed_step(
            closure,
            steps_whole=lambda group, p: False,
            step_one=lambda w, g, state, group, index: self._step_param(w, g, state, group),
            init_state=lambda ref, group, state, index: _init_adam_state(state, ref),
            skip_zero=False,
        )

    def _step_param(
        self, w: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]
    ) -> None:
        """Steps 1-3 of the class docstring for one (local) tensor."""
        beta1, beta2 = group["betas"]
        interval, threshold = group["reset_interval"], group["threshold"]
        state["global_step"] += 1
        t = state["global_step"]
        if interval > 0 and t % interval == 0:
            state["exp_avg"].zero_()
            state["exp_avg_sq"].zero_()
            if group["reset_step_counter"]:
                state["step"] = 0
        state["step"] += 1

        since_reset = t % interval if interval > 0 else t
        if threshold > 0 and since_reset >= group["clip_delay"]:
            bound = _local(state["exp_avg_sq"]) * threshold
            spike = grad * grad > bound
            grad = torch.where(spike, grad.sign() * bound.sqrt(), grad)

        adamw_step_(
            w,
            grad,
            _local(state["exp_avg"]),
            _local(state["exp_avg_sq"]),
            state["step"],
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
            lr_mult=self.lr_multiplier(group, t),
        )


def _load_state_dict_keep_fp32(
    opt: torch.optim.Optimizer, state_dict: dict[str, Any], fp32_keys: tuple[str, ...]
) -> None:
    """Loads `state_dict` into `opt`, keeping the tensors under `fp32_keys` in their saved dtype.

    torch.optim.Optimizer.load_state_dict casts every floating state tensor except ``step`` to
    its parameter's dtype; for bf16 params that rounds fp32 statistics and breaks exact resume.
    """
    saved = state_dict["state"]
    torch.optim.Optimizer.load_state_dict(opt, state_dict)
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = chain.from_iterable(g["params"] for g in opt.param_groups)
    for pid, p in zip(saved_ids, params):
        for key in fp32_keys:
            if pid in saved and key in saved[pid]:
                # A copy: the caller's state_dict must not alias live optimizer state.
                opt.state[p][key] = saved[pid][key].detach().to(device=p.device, copy=True)
