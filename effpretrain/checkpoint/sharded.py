"""Sharded checkpoints of FSDP2 runs, with torch.distributed.checkpoint (DCP).

`save_sharded` writes the model's and the optimizer's tensors into ``step-N/dcp/`` with every rank
writing only its own shards (one ``__<rank>_0.distcp`` file each, plus rank 0's ``.metadata``), so
no rank ever holds a full model or optimizer state; state that lives whole on one owner rank
(projected low-rank state, most of the 8-bit methods' state: optimizers/_owners.py) is written
by its owner, and state replicated on every rank (scalars) is written once. What is not a tensor (step
counters, param groups, the restart counters) goes into ``trainer.pt`` as a "skeleton" whose
tensor leaves are placeholders naming their DCP key, shape, strides and whether they were
sharded. Per-parameter optimizer state is keyed by the parameter's name
(``optim/state/<name>/<key>``), not by torch's position index, and mapped back to this
optimizer's indices on load. `load_sharded` allocates each tensor as it was (a DTensor laid out
like its parameter's rows, or a plain tensor with the saved strides), lets DCP fill it in place (each rank
reads only its shards) and hands the rebuilt state dict to the optimizer. `read_model_state` reads
the model back whole in a single process (export, eval). On several machines the checkpoint
folder must be on a file system every rank can reach.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from effpretrain.checkpoint.commit import os_error_of, unwrap_dcp
from effpretrain.checkpoint.weights import load_model_weights, without_aliases
from optimizers._sharded import local, row_sharded_like

_PLACEHOLDER = "__dcp__"


def _split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """`obj` with every tensor leaf moved into `tensors` (key `path`) and replaced by a placeholder."""
    if torch.is_tensor(obj):
        sharded = isinstance(obj, DTensor)
        tensors[path] = obj
        return {
            _PLACEHOLDER: path,
            "sharded": sharded,
            "dtype": str(obj.dtype).removeprefix("torch."),
            "shape": list(obj.shape),
            "stride": None if sharded else list(obj.stride()),
        }
    if isinstance(obj, dict):
        return {k: _split(v, f"{path}/{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_split(v, f"{path}/{i}", tensors) for i, v in enumerate(obj)]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _is_placeholder(obj: Any) -> bool:
    return isinstance(obj, dict) and _PLACEHOLDER in obj


def _fill(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `_split`: placeholders replaced by `tensors[key]`."""
    if _is_placeholder(obj):
        return tensors[obj[_PLACEHOLDER]]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_fill(v, tensors) for v in obj]
        return out if isinstance(obj, list) else tuple(out)
    return obj


def _placeholders(obj: Any) -> list[dict[str, Any]]:
    if _is_placeholder(obj):
        return [obj]
    if isinstance(obj, dict):
        return [p for v in obj.values() for p in _placeholders(v)]
    if isinstance(obj, (list, tuple)):
        return [p for v in obj for p in _placeholders(v)]
    return []


def _param_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    """The fully qualified name of every parameter `opt` steps, param group by param group.

    A sharded module is first resharded: after a forward without backward (an evaluation) the root
    keeps its gathered parameters registered, while the optimizer steps the sharded ones.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    names = {id(p): n for n, p in model.named_parameters()}
    try:
        return [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
    except KeyError:
        raise ValueError("the optimizer steps a parameter that is not the model's") from None


def _keyed_by_name(sd: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """`opt.state_dict()` with its parameter indices (torch numbers the parameters 0, 1, ... in
    param-group order) replaced by the parameters' names, in ``state`` and in ``param_groups``."""
    flat = [n for group in names for n in group]
    out = dict(sd)
    out["state"] = {flat[k] if isinstance(k, int) else k: v for k, v in sd["state"].items()}
    out["param_groups"] = [{**g, "params": [flat[i] for i in g["params"]]} for g in sd["param_groups"]]
    return out


def _keyed_by_index(sd: dict[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """Inverse of `_keyed_by_name` for this optimizer: each name becomes the index of that same
    parameter here, whatever order it was saved in. ValueError unless every param group holds the
    same parameters as the saved one."""
    if len(sd["param_groups"]) != len(names):
        raise ValueError(f"{len(sd['param_groups'])} param groups in the saved optimizer, {len(names)} here")
    index = {n: i for i, n in enumerate(n for group in names for n in group)}
    groups = []
    for g, (saved, mine) in enumerate(zip(sd["param_groups"], names)):
        if sorted(saved["params"]) != sorted(mine):
            odd = sorted(set(saved["params"]) ^ set(mine))
            raise ValueError(
                f"param group {g} holds {len(saved['params'])} parameters in the checkpoint, {len(mine)} here"
                + (f" ({odd[0]} is in only one)" if odd else "")
            )
        groups.append({**saved, "params": [index[n] for n in mine]})
    out = dict(sd)
    out["state"] = {index.get(k, k): v for k, v in sd["state"].items()}
    out["param_groups"] = groups
    return out


def _holds_state(opt: torch.optim.Optimizer, p: torch.Tensor) -> bool:
    """Whether this rank holds `p`'s state: False only where an owner rank holds it
    (optimizers/_owners.py), True for every optimizer without owner ranks."""
    o: Any = opt
    while o is not None:
        if hasattr(o, "holds_state"):
            return bool(o.holds_state(p))
        o = getattr(o, "optimizer", None)
    return True


def save_sharded(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Writes the model's and optimizer's tensors to `folder` with DCP (a collective: every rank).

    The optimizer state is keyed by parameter name (``optim/state/<name>/<key>``), not by torch's
    position index, so it names what it belongs to. State that lives on one owner rank is written
    by that rank alone. Returns the optimizer state dict's skeleton, every rank's parameters'
    entries merged (identical on every rank), for ``trainer.pt``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tensors: dict[str, torch.Tensor] = {}
    by_name = _keyed_by_name(opt.state_dict(), _param_names(model, opt))
    skeleton = _split(by_name, "optim", tensors)
    # A tied matrix (the head that is the embedding) is written once, as in a whole checkpoint.
    dcp.save(
        {"model": without_aliases(model.state_dict()), "optim": tensors},
        checkpoint_id=str(folder),
        storage_writer=_writer(folder),
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, skeleton["state"])
        merged: dict[str, Any] = {}
        for state in every:
            for name, entry in state.items():  # an owner's entries; sharded and replicated ones agree
                merged.setdefault(name, {}).update(entry)
        skeleton["state"] = {k: merged[k] for k in sorted(merged, key=_flat_order(by_name))}
    return skeleton


def _writer(folder: Path) -> Any:
    """DCP's file system writer (files synced), whose failed write raises the OS's error.

    A rank's write failure reaches every rank pickled inside DCP's ``CheckpointException``, and
    pickling drops the ``__context__`` that holds the OSError under torch's zip-writer
    RuntimeError; raising the OSError itself on the failing rank keeps its errno (an OSError
    pickles with it), so every rank names the same cause (`commit.write_error_cause`)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class _Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            try:
                return super().write_data(plan, planner)
            except Exception as e:
                os_err = os_error_of(e)
                if os_err is None or os_err is e:
                    raise
                raise OSError(os_err.errno, os.strerror(os_err.errno), os_err.filename) from e

    return _Writer(str(folder), sync_files=True)


def _flat_order(by_name: dict[str, Any]) -> Any:
    """Sort key: parameters in the optimizer's order (as torch's state dict lists them)."""
    order = {n: i for i, n in enumerate(n for g in by_name["param_groups"] for n in g["params"])}
    return lambda k: order.get(k, len(order))


def load_sharded(
    folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, skeleton: dict[str, Any]
) -> None:
    """Reads a `save_sharded` checkpoint into the sharded model and the optimizer (every rank).

    A rank reads the state of the parameters it holds state for (all of them, except where an
    owner rank holds a parameter's whole state: then only its owner reads it).

    Raises ValueError naming the first tensor or parameter that does not fit this model or
    optimizer (ConfigError, a ValueError, if the model's weights do not match).
    """
    import torch.distributed.checkpoint as dcp

    names = _param_names(model, opt)
    params = dict(model.named_parameters())
    skeleton = dict(skeleton)
    skeleton["state"] = {
        k: v for k, v in skeleton["state"].items() if k not in params or _holds_state(opt, params[k])
    }
    tensors: dict[str, torch.Tensor] = {}
    for ph in _placeholders(skeleton):
        key, dtype = ph[_PLACEHOLDER], getattr(torch, ph["dtype"])
        if ph["sharded"]:
            # Sharded like its parameter: its shape, or its rows (8-bit moments' per-row scales).
            p = params.get(key.split("/")[2])  # optim/state/<param name>/<state key>
            if not isinstance(p, DTensor) or not ph["shape"] or ph["shape"][0] != p.shape[0]:
                raise ValueError(f"sharded state {key} {ph['shape']} does not fit its parameter")
            rows = local(p)
            mine = torch.zeros((rows.shape[0], *ph["shape"][1:]), dtype=dtype, device=rows.device)
            tensors[key] = row_sharded_like(p, mine, ph["shape"])
        else:
            tensors[key] = torch.empty_strided(ph["shape"], ph["stride"], dtype=dtype)
    state = {"model": without_aliases(model.state_dict()), "optim": tensors}
    dcp.load(state, checkpoint_id=str(folder))
    load_model_weights(model, state["model"], folder)
    opt.load_state_dict(_keyed_by_index(_fill(skeleton, tensors), names))


def dcp_error(e: BaseException) -> str:
    """One line for an error out of DCP: the first failing rank's own exception, not the wrapper."""
    e = unwrap_dcp(e)
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return msg[:160]


def read_model_state(folder: Path) -> dict[str, torch.Tensor]:
    """The whole model state dict of a `save_sharded` checkpoint, read in one process (CPU)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    out = {
        key.removeprefix("model."): torch.empty(tuple(md.size), dtype=md.properties.dtype)
        for key, md in meta.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    loaded = {"model": out}
    with warnings.catch_warnings():
        # DCP warns that no process group exists: reading in one process is the point here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(loaded, checkpoint_id=str(folder), no_dist=True)
    return loaded["model"]
