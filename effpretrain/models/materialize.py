"""Building a model without holding it twice: created on the meta device, then materialized one
layer at a time with the values the ordinary build gives, bit for bit.

The ordinary build, ``cls(config)`` after ``torch.manual_seed(seed)``, writes most parameters
twice: torch's constructors draw their default init (nn.Linear's kaiming_uniform_, nn.Embedding's
normal_), then transformers' ``post_init`` runs ``_init_weights`` on every module (normal_, zeros,
ones, RoPE's inv_freq) and that last write is the value kept. Every draw advances the one CPU
generator, so layer k's values depend on how many numbers everything before it drew, and in what
order (the constructors of all layers first, then ``post_init`` layer by layer, the untied head's
constructor and ``post_init`` last).

`record_init` runs that build once under a `FakeTensorMode` (no storage, no number drawn) and keeps
every operator that draws random numbers or writes a tensor in place, in order. `materialize_`
replays the record on the meta model from the generator's current state:

- A write that a later whole-tensor write to the same tensor overwrites is dead. A dead write that
  draws runs on a scratch tensor of the same sizes, strides and dtype on the CPU, freed at once:
  the same operator on the same sizes draws the same numbers, so the generator advances exactly
  as in the ordinary build. A dead write that draws nothing is skipped.
- A live write runs on the parameter (or persistent buffer), which is allocated on the CPU at its
  first live write; that write must cover the whole tensor (nothing reads uninitialised memory).
- A unit (a decoder layer, or a module outside the layers: the embedding, the final norm, the
  head) is final after its tensors' last live write; ``after_layer(name, module)`` runs then,
  before the next unit is allocated: where a cast (bf16) or a quantization of the layer goes.
- Non-persistent buffers (RoPE's inv_freq, original_inv_freq) are recomputed by the model's own
  ``_init_weights`` on their module (no draw), as ``post_init`` last computed them.

Memory: the units already final, the unit being written, and at most one scratch tensor (the
constructors' draws, all dead, come before any live write except the untied head's, whose scratch
is the head's size). With ``after_layer`` shrinking each unit (to bf16, later to int8), a build
holds the final bytes plus one unit in fp32 (or one scratch tensor, if larger), where building
whole and converting holds the fp32 model.

Factorization surgery (`effpretrain.models.apply_factorization`) runs on the built model, as
before; it draws from the global generator outside the build's fork, module by module in layer
order. Done per layer it would compose the same way: in ``after_layer`` of a decoder layer, swap
the outer generator state in, run that layer's surgery, swap it out again; the surgery's draws
then come in the same order, so the values are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

#: Called once per unit when its tensors hold their final values: (the unit's module name, the
#: module). It may replace or convert the unit's parameters (``module.to(dtype)`` keeps ties).
AfterLayer = Callable[[str, nn.Module], None]

#: In-place operators that overwrite every element without reading it (with scalar arguments).
_FULL_WRITES = frozenset(
    {
        "uniform_",
        "normal_",
        "random_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "bernoulli_",
        "fill_",
        "zero_",
    }
)
#: Views that alias the whole tensor: a write through them is a write to the tensor itself.
_WHOLE_ALIASES = frozenset({"detach", "alias"})


def _draws(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _writes_first_arg(func: Any) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


def _tensors(*xs: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(xs) if isinstance(t, torch.Tensor)]


class _Recorder(TorchDispatchMode):
    """Keeps the draws and in-place writes, in order, and which tensor each view came from."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict]] = []
        # id(view) -> (view, its base, the view operator, its other arguments); the view is kept
        # so that its id is not reused while the record lives.
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor, Any, tuple, dict]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            self.views[id(out)] = (out, args[0], func, args[1:], kwargs)
        elif _draws(func) or _writes_first_arg(func):
            self.ops.append((func, args, kwargs))
        return out


@dataclass
class _Write:
    """One recorded operator, resolved: the final tensor it writes (or None), through which views."""

    func: Any
    args: tuple
    kwargs: dict
    target: str | None  # the final tensor's name; None: a tensor the built model does not keep
    chain: list[tuple[Any, tuple, dict]]  # views from the tensor to what the operator wrote
    meta: torch.Tensor | None  # what the operator wrote (its sizes, strides, dtype)
    live: bool = False

    @property
    def draws(self) -> bool:
        return _draws(self.func)

    @property
    def full(self) -> bool:
        return (
            self.target is not None
            and not self.chain
            and self.func.overloadpacket.__name__ in _FULL_WRITES
            and not _tensors(self.args[1:], self.kwargs)
        )


@dataclass
class InitRecord:
    """The ordinary build's writes, in order (`record_init`), and the flags post_init left."""

    writes: list[_Write]
    initialized: set[str] = field(default_factory=set)  # modules flagged ``_is_hf_initialized``


def record_init(cls: type, config: Any) -> InitRecord:
    """Records what ``cls(config)`` draws and writes, building it on fake tensors: no storage is
    allocated and the generator does not move. A `FakeTensorMode` reports the CPU as the device,
    so transformers runs ``post_init``'s initialisation (on the meta device it skips it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    rec = _Recorder()
    state = torch.get_rng_state()
    with FakeTensorMode(), rec:
        fake = cls(config)
    if not torch.equal(state, torch.get_rng_state()):
        raise RuntimeError("record_init: building on fake tensors moved the generator")
    finals = _final_names(fake)
    writes = []
    for func, args, kwargs in rec.ops:
        meta = args[0] if args and isinstance(args[0], torch.Tensor) and _writes_first_arg(func) else None
        root, chain = meta, []
        # A parameter is itself a view (detach) of the tensor its constructor made: stop at it.
        while root is not None and id(root) not in finals and id(root) in rec.views:
            _, base, vfunc, vargs, vkw = rec.views[id(root)]
            if vfunc.overloadpacket.__name__ not in _WHOLE_ALIASES:
                chain.insert(0, (vfunc, vargs, vkw))
            root = base
        target = finals.get(id(root)) if root is not None else None
        writes.append(_Write(func, args, kwargs, target, chain if target else [], meta))
    killed: set[str] = set()
    for w in reversed(writes):
        w.live = w.target is not None and w.target not in killed
        if w.full:
            killed.add(w.target)
    initialized = {n for n, m in fake.named_modules() if getattr(m, "_is_hf_initialized", False)}
    return InitRecord(writes, initialized)


def _final_names(model: nn.Module) -> dict[int, str]:
    """id -> name of every parameter and persistent buffer the model keeps (a tied one by its
    first name); non-persistent buffers are recomputed, not replayed."""
    out: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), name)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                out.setdefault(id(b), f"{mod_name}.{b_name}" if mod_name else b_name)
    return out


def _units(model: nn.Module, names: list[str]) -> dict[str, str]:
    """tensor name -> its unit's module name: the decoder layer holding it, else its module."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [n for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    out = {}
    for name in names:
        layer = next((ln for ln in layers if name.startswith(ln + ".")), None)
        out[name] = layer if layer is not None else name.rpartition(".")[0]
    return out


def _slots(model: nn.Module) -> dict[str, list[tuple[nn.Module, str, bool]]]:
    """tensor name (its first) -> every (module, attribute, is_parameter) holding it."""
    first: dict[int, str] = {}
    out: dict[str, list[tuple[nn.Module, str, bool]]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        held = [(a, t, True) for a, t in mod._parameters.items()]
        held += [(a, t, False) for a, t in mod._buffers.items() if a not in mod._non_persistent_buffers_set]
        for attr, t, is_param in held:
            if t is not None:
                out.setdefault(first.setdefault(id(t), prefix + attr), []).append((mod, attr, is_param))
    return out


def _scratch(meta: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device="cpu")


@torch.no_grad()
def materialize_(model: nn.Module, record: InitRecord, after_layer: AfterLayer | None = None) -> nn.Module:
    """Gives the meta `model` its initial values on the CPU, unit by unit, drawing from the
    global CPU generator's current state (seed it first): the values ``cls(config)`` gives from
    that state, where `record` is ``record_init(cls, config)`` (see the module's docstring).

    Raises:
        RuntimeError: the record cannot be replayed: a live write reads another tensor (a copy
            from a computed value), or a tensor's first live write does not cover it, or a
            tensor has no recorded initialisation, or the record does not match the model.
    """
    slots = _slots(model)
    targets = {w.target for w in record.writes if w.target is not None}
    if targets - slots.keys():
        raise RuntimeError(
            f"materialize_: the record writes tensors the model lacks: {sorted(targets - slots.keys())}"
        )
    missing = sorted(n for n in slots if not any(w.live and w.target == n for w in record.writes))
    if missing:
        raise RuntimeError(f"materialize_: no initialisation recorded for {', '.join(missing)}")
    unit_of = _units(model, list(slots))
    last: dict[str, int] = {}  # unit -> index of its last live write
    for i, w in enumerate(record.writes):
        if w.live:
            last[unit_of[w.target]] = i
    done_at: dict[int, list[str]] = {}
    for unit, i in last.items():
        done_at.setdefault(i, []).append(unit)

    real: dict[str, torch.Tensor] = {}
    for i, w in enumerate(record.writes):
        if w.live:
            if _tensors(w.args[1:], w.kwargs):
                raise RuntimeError(
                    f"materialize_: {w.func} writes {w.target} from another tensor; cannot replay it"
                )
            t = real.get(w.target)
            if t is None:
                if not w.full:
                    raise RuntimeError(
                        f"materialize_: the first write of {w.target} ({w.func}) does not cover it"
                    )
                t = real[w.target] = _allocate(slots[w.target])
            for vfunc, vargs, vkw in w.chain:
                t = vfunc(t, *vargs, **vkw)
            w.func(t, *w.args[1:], **w.kwargs)
        elif w.draws:
            rest = w.args[1:] if w.meta is not None else w.args
            if _tensors(rest, w.kwargs):
                raise RuntimeError(f"materialize_: {w.func} draws from a tensor's values; cannot replay it")
            if w.meta is not None:
                w.func(_scratch(w.meta), *rest, **w.kwargs)
            else:  # a factory (torch.randn) as it was called, on the CPU as the fake build reported
                w.func(*rest, **w.kwargs)
        for unit in done_at.get(i, ()):
            for name in [n for n in real if unit_of[n] == unit]:
                del real[name]  # the unit's tensors are the model's alone: after_layer may replace them
            if after_layer is not None:
                after_layer(unit, model.get_submodule(unit))
    _recompute_non_persistent(model)
    for name, mod in model.named_modules():
        if name in record.initialized:
            mod._is_hf_initialized = True
    return model


def _allocate(slots: list[tuple[nn.Module, str, bool]]) -> torch.Tensor:
    """An uninitialised CPU tensor of the meta tensor's sizes, strides and dtype, put in every
    slot that held the meta tensor (a tied matrix stays one parameter)."""
    mod, attr, is_param = slots[0]
    meta = mod._parameters[attr] if is_param else mod._buffers[attr]
    t = _scratch(meta)
    if is_param:
        t = nn.Parameter(t, requires_grad=meta.requires_grad)
    for m, a, p in slots:
        (m._parameters if p else m._buffers)[a] = t
    return t


def _recompute_non_persistent(model: nn.Module, device: torch.device | str = "cpu") -> None:
    """Each non-persistent buffer, on `device`, computed by the ``_init_weights`` of the nearest
    transformers model holding its module, as ``post_init`` last wrote it (RoPE's inv_freq from
    the config)."""
    from transformers import PreTrainedModel

    for name, mod in model.named_modules():
        owned = [
            b for b in mod._buffers if b in mod._non_persistent_buffers_set and mod._buffers[b] is not None
        ]
        if not owned:
            continue
        if any(True for _ in mod.parameters(recurse=False)):
            raise RuntimeError(f"materialize_: {name} holds parameters and non-persistent buffers")
        for b in owned:
            meta = mod._buffers[b]
            mod._buffers[b] = torch.full(meta.shape, float("nan"), dtype=meta.dtype, device=device)
        parts = name.split(".")
        owner = next(
            model.get_submodule(".".join(parts[:k]))
            for k in range(len(parts) - 1, -1, -1)
            if isinstance(model.get_submodule(".".join(parts[:k])), PreTrainedModel)
        )
        with torch.random.fork_rng(devices=[]):
            owner._init_weights(mod)
        for b in owned:
            if mod._buffers[b].is_floating_point() and mod._buffers[b].isnan().any():
                raise RuntimeError(
                    f"materialize_: {owner.__class__.__name__}._init_weights left {name}.{b} unset"
                )


def build_layerwise(cls: type, config: Any, seed: int, after_layer: AfterLayer | None = None) -> nn.Module:
    """``cls(config)`` as built after ``torch.manual_seed(seed)``, materialized unit by unit
    (`materialize_`), with ``after_layer`` run on each unit once it is final; the global
    generator's state is left as it was."""
    record = record_init(cls, config)
    with torch.device("meta"):
        model = cls(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        materialize_(model, record, after_layer)
    return model
