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
from torch.optim.adam import adam

from optimizers._adam import adamw_step_
from optimizers._sharded import local
from optimizers.writer import needs_writer

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, state and numerics for fp32 weights); see the module
    docstring for weights stored in fewer bits."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """torch.optim.AdamW's step (its own group set-up and functional kernel, as configured)
        for the fp32 weights of each group, then the rounded ones one at a time. Written out
        rather than through ``super().step()``, which would run the step hooks a second time."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            rounded = [p for p in group["params"] if p.grad is not None and needs_writer(p)]
            if rounded and (group.get("amsgrad") or group.get("maximize")):
                raise ValueError("AdamW: amsgrad and maximize are not supported for weights that round")
            ids = {id(p) for p in rounded}
            self._torch_step({**group, "params": [p for p in group["params"] if id(p) not in ids]})
            for p in rounded:
                self._rounded_step(p, group)
        return loss

    def _torch_step(self, group: dict[str, Any]) -> None:
        """torch.optim.Adam's step body for one group (AdamW's decoupled weight decay)."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps)
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=getattr(self, "grad_scale", None),
            found_inf=getattr(self, "found_inf", None),
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )

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
