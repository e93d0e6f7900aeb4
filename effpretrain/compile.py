"""`train.compile`: regional compilation of the decoder blocks with `torch.compile`.

Every decoder layer's ``forward`` is replaced (on the instance) by one compiled function,
`_block_forward`, that takes the layer as an argument. Dynamo caches compiled code per code
object and treats a module's parameters as graph inputs, so the first layer's graph serves every
layer of the same shapes: compile time is one block's, at any depth (torchtitan compiles each
transformer block for the same reason). What stays eager around it, on purpose:

- the module's hooks (its ``__call__``): FSDP2's all-gather and reduce-scatter hooks, transformers'
  output-capturing hooks and the memory measurement's forward pre-hook run as they do without
  compilation, and FSDP2 can shard a compiled block (compile first, then `fully_shard`);
- the embeddings, the final norm and the loss (the chunked loss computes its own gradients);
- the optimizers, restarts, refactorization and the in-backward hooks: they act on the parameters
  and their gradients, which are leaves outside the compiled graphs.

Activation checkpointing is traced inside the compiled function (torch's ``checkpoint`` as a
higher-order operator, non-reentrant): a layer whose ``gradient_checkpointing`` flag is set
(`effpretrain.models.set_activation_checkpointing`) is recomputed in the backward. transformers'
own checkpointing wrapper is bypassed (it would call the compiled function inside an eager
checkpoint, where Dynamo cannot trace and would fall back to eager). Its only side effect, the
`kernels` package's context variable, is not replayed in the recomputation
(``skip_fwd_side_effects_in_bwd_under_checkpoint``).

Compilation never falls back to eager silently: the graph must be whole (``fullgraph=True``: a
graph break is an error), and hitting the recompile limit is an error
(``fail_on_recompile_limit_hit``) instead of Dynamo's silent eager fallback. The limit allows a
graph per combination the trainer creates (training and evaluation, checkpointed or not, before
and after a warm start's switch, bf16 or fp32), not one per layer.

Memory: weights, gradients and optimizer state are eager's. What a compiled block saves for
backward is what inductor's partitioner chooses; it recomputes cheap element-wise work instead of
saving it, so it saves no more than eager autograd (tiny, fp32: 21% fewer activation bytes,
`tests/test_compile.py`), and the estimator's eager count is an upper bound.

A model's parameters and ``state_dict`` keys are unchanged (no ``_orig_mod.`` prefix), so
checkpoints of compiled and eager runs are interchangeable.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import shutil
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "COMPILE_WARMUP_STEPS",
    "RECOMPILE_LIMIT",
    "check_compilable",
    "compile_blocks",
    "compile_seconds",
    "compiled_blocks",
    "decoder_layers",
    "is_compiled",
]

#: Steps a compiled run takes before its blocks are compiled: the first call of a block traces and
#: compiles it (Inductor, and on CUDA Triton's autotuning, whose buffers the allocator sees), so a
#: memory measurement of that step is the compiler's as much as the run's (`effpretrain.memory.
#: measure`, the trainer's default `train.memory_steps`).
COMPILE_WARMUP_STEPS = 1

#: Graphs one compiled block function may hold (Dynamo's default is 8): each distinct combination
#: of training/evaluation, checkpointing, requires_grad pattern and dtype needs its own.
RECOMPILE_LIMIT = 32

_COMPILED: dict[tuple[Any, ...], Any] = {}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated decoder blocks (transformers' ``GradientCheckpointingLayer``s)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _block_forward(layer: torch.nn.Module, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """One decoder block: `forward` (the layer class's own, unwrapped) on `layer`, checkpointed
    when the layer's flag asks for it and a backward will follow."""
    if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
        return checkpoint(forward, layer, *args, use_reentrant=False, **kwargs)
    return forward(layer, *args, **kwargs)


def _compiled(backend: str) -> Any:
    """The one compiled block function for `backend` (shared by every layer and model)."""
    key = (backend,)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_block_forward, backend=backend, fullgraph=True)
    return _COMPILED[key]


def _configure_dynamo() -> None:
    import torch._dynamo.config as dynamo

    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 8 * RECOMPILE_LIMIT)
    dynamo.fail_on_recompile_limit_hit = True
    dynamo.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def check_compilable(device: torch.device) -> None:
    """Refuses, before anything is built, a compilation that cannot run here.

    Raises:
        ValueError: torch older than 2.6 (no ``torch.compiler.set_stance``, which the CPU memory
            measurement needs); on CUDA, no Triton (inductor's GPU code generator); on CPU, no C++
            compiler (inductor generates C++: ``CXX`` or g++ / clang++ / c++ on PATH); any other
            device.
    """
    if not hasattr(torch.compiler, "set_stance"):
        raise ValueError(f"train.compile needs torch >= 2.6 (this is {torch.__version__})")
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "train.compile on CUDA needs triton, inductor's kernel generator (pip install triton)"
            )
    elif device.type == "cpu":
        named = os.environ.get("CXX")
        if not (named and shutil.which(named)) and not any(
            shutil.which(c) for c in ("g++", "clang++", "c++")
        ):
            raise ValueError(
                "train.compile on CPU needs a C++ compiler (g++ or clang++ on PATH, or CXX): inductor generates C++"
            )
    else:
        raise ValueError(f"train.compile on a {device.type} device is not supported (CUDA and CPU are)")


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compiles every decoder block of `model` in place (regional compilation); returns how many.

    Call it after the model's surgery (factorization), checkpointing flags, dtype and device are
    set, and before DDP or FSDP2 wrap it; the blocks then compile on their first call.

    Args:
        model: a transformers causal LM with the LLaMA layer layout.
        backend: the `torch.compile` backend (``inductor``; ``aot_eager`` traces without code
            generation, for tests of the tracing alone).

    Raises:
        ValueError: the model has no decoder blocks, or they are compiled already.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"train.compile: {type(model).__name__} has no decoder blocks to compile")
    if any(is_compiled(layer) for layer in layers):
        raise ValueError("train.compile: the model's blocks are compiled already")
    _configure_dynamo()
    fn = _compiled(backend)
    for layer in layers:
        # The class's forward below transformers' checkpointing wrapper (which `_block_forward`
        # replaces): the same function object for every layer, so one graph serves them all.
        forward = inspect.unwrap(type(layer).forward)
        layer.forward = functools.partial(fn, layer, forward)
    return len(layers)


def is_compiled(layer: torch.nn.Module) -> bool:
    """Whether `compile_blocks` compiled this layer."""
    f = layer.__dict__.get("forward")
    return isinstance(f, functools.partial) and f.func in _COMPILED.values()


def compiled_blocks(model: torch.nn.Module) -> int:
    """How many of `model`'s decoder blocks are compiled (0 for an eager model)."""
    return sum(is_compiled(layer) for layer in decoder_layers(model))


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far: Dynamo's tracing and the forward graphs'
    code generation (``_compile.compile_inner``) plus the backward graphs, which AOTAutograd
    compiles lazily at their first backward (``bw_compiler``), from
    `torch._dynamo.utils.compilation_time_metrics`; 0 when nothing was compiled."""
    from torch._dynamo.utils import compilation_time_metrics as times

    backward = sum(sum(v) for k, v in times.items() if k.endswith("bw_compiler"))
    return float(sum(times.get("_compile.compile_inner", ())) + backward)
