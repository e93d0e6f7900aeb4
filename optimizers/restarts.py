"""Periodic "restarts": refactorization + momentum reset every T steps, as an optimizer wrapper.

Glentis et al. (2025) pair factorized models (Low-Rank W = B A, SLTrain) with two techniques run
together every T optimizer steps (T = 200 at 1B):

1. weight refactorization: re-split every factor pair into its balanced form
   B = U S^1/2, A = S^1/2 V^T (optimizers.refactorization.refactorize_);
2. momentum reset: zero Adam's m, v and step counter for all trainable parameters
   (optimizers.momentum_reset.reset_),

followed by a "quick recovery" of the learning rate: a linear ramp from ~0.1% of the scheduled LR
back to the schedule over 10 steps (`recovery_factor`). ReLoRA's periodic merge fits the same
frame as a hook (run first, then refactorization and reset).

`Restarts` wraps any optimizer and is itself a torch.optim.Optimizer that shares the inner one's
`param_groups`, `state` and `defaults`, so LR schedulers, gradient clipping, Accelerate's
AcceleratedOptimizer and the HF Trainer treat it like the inner optimizer. Schedule, with
k = 1, 2, ...:

    wrapper step s (1-based count of inner steps taken)  ->  restart right after inner step s = k T.

So the restart happens after the k T-th update, and the LR for update k T + 1 is the first one
that `recovery_factor(k T, T, R)` lowers. With `start=S` the periods begin after update S: the
restarts follow updates S + k T. Its counters are saved in its state dict.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from optimizers.momentum_reset import reset_
from optimizers.refactorization import refactorize_

__all__ = ["Restarts", "recovery_factor"]

FactorPairs = Iterable[tuple[Tensor, Tensor]]


def recovery_factor(step: int, every: int, recovery_steps: int, floor: float = 1e-3) -> float:
    """LR multiplier of the quick-recovery ramp after each restart.

    `step` is the number of optimizer steps already taken when the LR for the next step is
    computed (what torch.optim.lr_scheduler.LambdaLR passes its lambda, when the scheduler is
    stepped once after each optimizer step). `Restarts(every=T)` fires right after the step that
    makes this count a positive multiple of T, so with j = step mod T:

        step < T, or j >= R          ->  1
        step >= T and 0 <= j < R     ->  floor + (1 - floor) * j / R

    i.e. the first update after a restart runs at `floor` x the scheduled LR, the next R - 1 ramp
    up linearly, and update number R after the restart is back on the schedule. Worked example,
    T = 200, R = 10, floor = 1e-3: steps 0..199 -> 1; step 200 -> 0.001; 201 -> 0.1009;
    209 -> 0.9001; 210..399 -> 1; 400 -> 0.001; ... If R > T the ramp is cut by the next restart.
    Multiply the base schedule by it: LambdaLR(opt, lambda s: schedule(s) * recovery_factor(s, T, R)).

    Args:
        step: optimizer steps taken so far (>= 0).
        every: restart period T (>= 1).
        recovery_steps: ramp length R (>= 0; 0 disables the ramp).
        floor: multiplier for the first update after a restart (the benchmark's ~0.1%), in [0, 1].

    Returns:
        The multiplier in [floor, 1].
    """
    if every < 1 or recovery_steps < 0 or step < 0:
        raise ValueError(
            f"need every >= 1, recovery_steps >= 0, step >= 0; got {every}, {recovery_steps}, {step}"
        )
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor}")
    if step < every or recovery_steps == 0:
        return 1.0
    j = step % every
    if j >= recovery_steps:
        return 1.0
    return floor + (1.0 - floor) * j / recovery_steps


class Restarts(torch.optim.Optimizer):
    """Runs the inner optimizer and, every `every` steps, hooks + refactorization + momentum reset.

    Each `step(closure)`: run the inner step; count it; if the count is a positive multiple of
    `every`, call `restart()`, which runs (under no_grad, in this order) every hook, then
    `refactorize_(factor_pairs)`, then `reset_(optimizer)` on all of the optimizer's parameters
    (the benchmark rebuilds the whole optimizer). Steps that did not update (Accelerate's
    gradient-accumulation micro-steps and fp16 overflow skips, when the inner optimizer is an
    AcceleratedOptimizer) are not counted, nor is a first step on all-zero gradients (what
    distributed-checkpoint loaders run to materialise state), so the count equals updates made.
    Wrap the raw optimizer before `accelerator.prepare`, though, so the LR scheduler and Accelerate
    see this one.

    Args:
        optimizer: the optimizer to wrap (any torch.optim.Optimizer).
        factor_pairs: (B, A) pairs to refactorize, or a zero-arg callable returning them at each
            restart (use one when the parameter objects may change, e.g. after model surgery).
        every: restart period T in optimizer steps (>= 1).
        refactorize: re-split the pairs at each restart.
        reset_momentum: zero the state named by `reset_keys` at each restart.
        hooks: zero-arg callables run at each restart before refactorization and reset (e.g.
            `lambda: relora_merge_(model)`).
        reset_keys: state keys reset by the momentum reset (None: the optimizer's own,
            `optimizers.momentum_reset.reset_keys`).
        start: updates before the first period begins: restarts fire right after update
            start + k every (k >= 1), none earlier (ReLoRA's full-rank warm start of `start` steps).

    Attributes:
        optimizer: the wrapped optimizer.
        num_steps: updates taken through this wrapper (saved as state_dict()["restarts"]["step"]).
        num_restarts: restarts fired (saved as ["restarts"]["count"]).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        factor_pairs: FactorPairs | Callable[[], FactorPairs],
        every: int,
        refactorize: bool = True,
        reset_momentum: bool = True,
        hooks: Iterable[Callable[[], Any]] = (),
        reset_keys: Sequence[str] | None = None,
        start: int = 0,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Restarts wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"Restarts: every must be an int >= 1, got {every!r}")
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"Restarts: start must be an int >= 0, got {start!r}")
        # No super().__init__: it would build new param groups; everything is shared with `optimizer`.
        self.optimizer = optimizer
        self._factor_pairs = factor_pairs if callable(factor_pairs) else list(factor_pairs)
        self.every = every
        self.refactorize = refactorize
        self.reset_momentum = reset_momentum
        self.hooks = list(hooks)
        self.reset_keys = None if reset_keys is None else tuple(reset_keys)
        self.start = start
        self.num_steps = 0
        self.num_restarts = 0
        # What Optimizer.__init__ would set up, so register_*_hook and profiling work on the wrapper.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    # Properties, not copies: the inner load_state_dict replaces its `state` and `param_groups`.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"Restarts(every={self.every}, refactorize={self.refactorize}, "
            f"reset_momentum={self.reset_momentum}, hooks={len(self.hooks)}, optimizer={self.optimizer!r})"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def factor_pairs(self) -> list[tuple[Tensor, Tensor]]:
        """The (B, A) pairs a restart would refactorize now."""
        pairs = self._factor_pairs() if callable(self._factor_pairs) else self._factor_pairs
        return list(pairs)

    def _inner_updated(self) -> bool:
        # Accelerate's wrapper turns micro-steps and fp16 overflows into no-ops; don't count those.
        gradient_state = getattr(self.optimizer, "gradient_state", None)
        if gradient_state is not None and not getattr(gradient_state, "sync_gradients", True):
            return False
        return not getattr(self.optimizer, "step_was_skipped", False)

    def _is_state_init_dummy(self) -> bool:
        # Distributed-checkpoint loaders materialise state with one step on all-zero gradients before
        # any real step; that is not an update and must not move the restart schedule. Checked only
        # while the state is still empty, so the reduction over gradients runs once per run.
        if self.optimizer.state:
            return False
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return bool(grads) and all(not bool(torch.any(gr != 0)) for gr in grads)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Inner step, then a restart if this was update number start + k * every (k >= 1)."""
        dummy = closure is None and self._is_state_init_dummy()
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if not dummy and self._inner_updated():
            self.num_steps += 1
            since = self.num_steps - self.start
            if since > 0 and since % self.every == 0:
                self.restart()
        return loss

    @torch.no_grad()
    def restart(self) -> None:
        """Runs one restart now: hooks, then refactorization, then momentum reset."""
        for hook in self.hooks:
            hook()
        if self.refactorize:
            refactorize_(self.factor_pairs())
        if self.reset_momentum:
            reset_(self.optimizer, keys=self.reset_keys)
        self.num_restarts += 1

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``"restarts": {"step": int, "count": int}``."""
        sd = dict(self.optimizer.state_dict())
        sd["restarts"] = {"step": self.num_steps, "count": self.num_restarts}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the inner optimizer's state and this wrapper's counters."""
        sd = dict(state_dict)
        counters = sd.pop("restarts", None)
        if not isinstance(counters, dict) or set(counters) != {"step", "count"}:
            raise ValueError(
                "optimizer state dict has no valid 'restarts' entry; it was not saved by Restarts"
            )
        self.optimizer.load_state_dict(sd)
        self.num_steps = int(counters["step"])
        self.num_restarts = int(counters["count"])
