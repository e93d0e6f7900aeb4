"""AdamW: torch.optim.AdamW, with weights stored in fewer bits than fp32 written through the one
writer.

Parameters stored in fp32 step exactly as torch.optim.AdamW steps them (its own code: foreach,
fused or single-tensor, as configured). A parameter whose storage rounds (bf16 weights with
``bf16-pure``, INT8 weights: `optimizers.writer.needs_writer`) steps in torch's single-tensor
operation order (`optimizers._adam.adamw_step_`) on its fp32 value, rounded back once
(`optimizers.writer.written`), with the same state (``step``, ``exp_avg``, ``exp_avg_sq``, in the
parameter's dtype: fp32 for an INT8 weight, which computes in fp32), so checkpoints are torch's.

State bytes: ``2 numel s + 4`` per parameter (s: the dtype's itemsize), as torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from optimizers._adam import adamw_step_
from optimizers._sharded import local
from optimizers.writer import needs_writer

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, state and numerics for fp32 weights); see the module
    docstring for weights stored in fewer bits."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        rounded = [
            [p for p in g["params"] if p.grad is not None and needs_writer(p)] for g in self.param_groups
        ]
        if not any(rounded):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        kept = [g["params"] for g in self.param_groups]
        try:  # torch steps every other parameter itself
            for g, r in zip(self.param_groups, rounded):
                ids = {id(p) for p in r}
                g["params"] = [p for p in g["params"] if id(p) not in ids]
            super().step()
        finally:
            for g, params in zip(self.param_groups, kept):
                g["params"] = params
        for g, r in zip(self.param_groups, rounded):
            if r and (g.get("amsgrad") or g.get("maximize")):
                raise ValueError("AdamW: amsgrad and maximize are not supported for weights that round")
            for p in r:
                self._rounded_step(p, g)
        return loss

    def _rounded_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            # Like the parameter: an FSDP2 shard's moments are shards (plain tensors inside).
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        adamw_step_(
            p,
            local(p.grad),
            local(state["exp_avg"]),
            local(state["exp_avg_sq"]),
            int(state["step"].item()),
            group["lr"],
            beta1,
            beta2,
            group["eps"],
            group["weight_decay"],
        )
