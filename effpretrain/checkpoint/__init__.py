"""Complete, atomic, weights_only-safe checkpoints.

A checkpoint is a folder ``checkpoints/step-N/`` holding:

- ``model.safetensors``: the model's state_dict (parameters and persistent buffers);
- ``optimizer.pt``: the optimizer's state_dict (tensors and plain numbers only);
- or, for FSDP2 runs, instead of those two: ``dcp/``, the model's and optimizer's tensors written
  shard by shard by every rank (`effpretrain.checkpoint.sharded`), the optimizer's non-tensor part
  being kept in ``trainer.pt``;
- ``trainer.pt``: the run's other named parts (`effpretrain.checkpoint.states`): progress (step,
  tokens), data-stream position (for a streamed source every rank's, gathered as ``data.ranks``),
  scheduler, RNG states, the in-backward engine's state, the resolved config;
- ``config.yaml``: the resolved config;
- ``COMPLETE``: written last; a folder without it does not count.

Modules: `commit` (the atomic write, pruning, a failed write's error), `files` (safe reading, the
weight check, finding the checkpoint to resume), `sharded` (FSDP2's DCP format), `states` (the
named stateful parts a run saves and restores).
"""

from effpretrain.checkpoint.commit import (
    MARKER,
    CheckpointWriteError,
    complete_checkpoints,
    discard_temp,
    prune,
    save_checkpoint,
    temp_folder,
    unwrap_dcp,
    write_error_cause,
)
from effpretrain.checkpoint.files import find_resume, load_checkpoint, read_model_state, resolve_checkpoint
from effpretrain.checkpoint.states import Checkpointer
from effpretrain.checkpoint.weights import load_model_weights

__all__ = [
    "MARKER",
    "CheckpointWriteError",
    "Checkpointer",
    "complete_checkpoints",
    "discard_temp",
    "find_resume",
    "load_checkpoint",
    "load_model_weights",
    "prune",
    "read_model_state",
    "resolve_checkpoint",
    "save_checkpoint",
    "temp_folder",
    "unwrap_dcp",
    "write_error_cause",
]
