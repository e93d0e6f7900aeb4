"""Memory: the analytic estimate (no tensor is allocated), its terms, the measured numbers and the
published figures (`published`). Modules: `terms` (precisions, shapes, the per-parameter tally and
the distributed terms), `activations`, `in_backward_terms`, `estimator` (the sums and the peak),
`published`; the measurement instrument `accounting` (tensor accounting: `saved_tensor_bytes`,
`measure_loss_bytes`) and a training step measured by category with it (`measure`), and the
pre-flight check `preflight`.

Estimate, per rank, in bytes:

- weights: every parameter (and persistent buffer such as SLTrain's sparse index) at its dtype;
- grads: trainable parameters at the gradient dtype (= parameter dtype);
- optimizer_state: the method's exact formula per parameter (`MethodSpec.state_bytes`), which
  for each class is the same formula its docstring states and its tests check, plus once the
  state all parameters share (`MethodSpec.shared_state_bytes`: 8-bit AdamW's quantile maps);
- activations: the tensors autograd saves for backward in one micro-batch, as HF's LLaMA block
  (SDPA attention, SiLU MLP, RMSNorm) and the factorized layers really save them, per precision
  (`SAVED_BYTES`, `activation_terms`; equal to the measured saved bytes), a checkpointed block
  keeping only its input, plus what the loss saves (`loss_bytes`);
- peak: the largest live total at any moment of a step (`peak_moments`): the end of the forward,
  the loss's backward, each block's backward (with a checkpointed block's recompute) and the
  optimizer step with the method's transients (`MethodSpec.step_transient_bytes`) and a
  restart's (`FactorSpec.restart_transient_bytes`); gradients held across accumulation
  micro-steps, DDP buckets and FSDP2's gathered units included. ``detail["peak_phase"]``
  ("forward_backward" or "optimizer_step"), ``detail["peak_moment"]`` and
  ``detail["peak_terms"]`` say where it is reached and of what it is made.

With ``train.update_in_backward`` (`effpretrain.in_backward`: each parameter steps inside
backward and its gradient is freed) no moment holds every gradient: the gradient term is the
accumulators of an accumulating step (low rank, r x max(m, n), for the matrices of a class whose
update reads G only through R, between refreshes; full otherwise) plus the gradients in flight
(`in_backward_terms` states the rule), a refresh step's full accumulators are the bounded spike
(``refresh_*`` moments), and the optimizer step's transient moves into each block's backward
(`in_backward_moments`).

The parameter shapes are those of the preset's LlamaForCausalLM built on PyTorch's meta device
(shapes only, no storage); a factorized target's tensors come from `FactorSpec.param_counts`
(building SLTrain's random support at 1B shapes would take far longer than the estimate).

``dtype`` names the precision, as ``train.precision`` does (`PRECISIONS`): ``fp32``;
``bf16-mixed`` (fp32 weights/grads/states, bf16 activations); ``bf16-pure`` (weights, grads and
states in bf16, the paper's setting).
Under FSDP2 weights, grads and element-wise states are sharded over ranks, while a projected
matrix's low-rank moments and basis, the state of the 8-bit methods (adamw_8bit, galore_8bit:
`MethodSpec.fsdp2_whole_state`; galore_8bit's weights whose rows are whole 256-entry blocks are the
exception, sharded by rows: `MethodSpec.steps_shards`) and a whole-matrix method's matrix weights' state
(Muon's momentum, SCALE's embedding: `MethodSpec.steps_whole`), are whole-tensor state held by one owner rank per
parameter, placed as the optimizers place it (`optimizers.assign_owners`, optimizers/_owners.py);
under DDP every rank holds all. Weights and gradients are rank 0's, the largest share (torch.chunk
gives it ceil(rows / N) rows of every tensor); the optimizer state is the largest rank's, and
``detail["optimizer_state_per_rank"]`` lists every rank's.

Measured: exact optimizer-state bytes from the state tensors, and peak memory (CUDA max allocated,
or the process's peak RSS on CPU).
"""

from effpretrain.memory.accounting import (
    accounting,
    measure_loss_bytes,
    peak_memory_bytes,
    saved_tensor_bytes,
    tensor_bytes,
)
from effpretrain.memory.activations import (
    SAVED_BYTES,
    Activations,
    LossBytes,
    SavedBytes,
    activation_bytes,
    activation_terms,
    checkpointed_layers,
    loss_bytes,
)
from effpretrain.memory.estimator import (
    Estimate,
    estimate,
    estimate_from_config,
    format_table,
    plan_checkpointing,
)
from effpretrain.memory.in_backward_terms import InBackwardTerms, in_backward_terms, lowrank_accumulator_bytes
from effpretrain.memory.terms import (
    PRECISIONS,
    ParamShape,
    Precision,
    data_bytes,
    model_param_shapes,
    precision,
)
from effpretrain.optim_setup import HEAD_TARGETS, head_group, projection_group

__all__ = [
    "HEAD_TARGETS",
    "PRECISIONS",
    "SAVED_BYTES",
    "Activations",
    "Estimate",
    "InBackwardTerms",
    "LossBytes",
    "ParamShape",
    "Precision",
    "SavedBytes",
    "accounting",
    "activation_bytes",
    "activation_terms",
    "checkpointed_layers",
    "data_bytes",
    "estimate",
    "estimate_from_config",
    "format_table",
    "head_group",
    "in_backward_terms",
    "loss_bytes",
    "lowrank_accumulator_bytes",
    "measure_loss_bytes",
    "model_param_shapes",
    "peak_memory_bytes",
    "plan_checkpointing",
    "precision",
    "projection_group",
    "saved_tensor_bytes",
    "tensor_bytes",
]
