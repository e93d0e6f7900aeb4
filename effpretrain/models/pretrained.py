"""Starting a run from an existing model's weights (`model.init`): a folder with ``config.json``
and safetensors weights (one ``model.safetensors``, or shards named by
``model.safetensors.index.json``), or a hub id where the network is reachable.

Everything about the source is checked before a byte of weights is read, each failure one line
(`effpretrain.errors.ConfigError`): the folder holds weights in safetensors, the config is a
supported architecture that needs no remote code, every file is whole (a truncated file is
caught by its header's offsets against its size), and the tensors are exactly the model's by
name and shape.

The reader is our own, on the safetensors layout (an 8-byte little-endian header length, a JSON
header naming each tensor's dtype, shape and byte range, then the bytes): it reads a tensor, or a
range of its rows, straight into the destination when the dtypes agree, and otherwise through
one buffer of the file's dtype. So loading never holds the model twice:

- `load_pretrained` (one process, and each DDP rank): the model is created on the meta device
  and allocated unit by unit (a decoder layer, the embedding, the final norm, the head), each
  unit's tensors read, then ``after_layer`` run on it (the cast to bf16, INT8 quantization). Peak:
  the units done, the unit being read (in fp32) and one tensor's buffer.
- `load_shards_` (FSDP2): the meta model is sharded first, then each rank allocates only its
  shards and reads only its rows of each tensor (FSDP2 splits dim 0 as ``torch.chunk`` does).
  Peak per rank: its shards plus one tensor's rows (`LoadReport` records it, measured by the
  project's tensor accounting).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from effpretrain.errors import ConfigError
from effpretrain.models.llama import _first_line, load_hf_config, model_class, resolve_init, shape_of
from effpretrain.models.materialize import AfterLayer, _allocate, _recompute_non_persistent, _slots, _units
from optimizers._owners import shard_rows
from optimizers._sharded import local

__all__ = [
    "LoadReport",
    "PretrainedWeights",
    "load_pretrained",
    "load_shards_",
    "meta_model",
    "open_pretrained",
]

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"

#: safetensors' dtype names.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
#: A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the tensor's data in `file`


@dataclass
class LoadReport:
    """What a load read and held: tensors and bytes read from the files, the bytes of the
    model's tensors it filled (a rank's shards under FSDP2), and the peak bytes the build held
    (the caller measures it with the tensor accounting, `effpretrain.memory.accounting`: the
    trainer does)."""

    source: str
    tensors: int = 0
    bytes_read: int = 0
    filled_bytes: int = 0
    peak_bytes: int = 0
    largest_read_bytes: int = 0

    def record(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _read_header(file: Path) -> dict[str, _Entry]:
    """The tensors of one safetensors file, checked against its size (a truncated file fails
    here, before anything is read)."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(
                    f"model.init: {file.name} is truncated or not a safetensors file ({size} bytes)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ConfigError(
                    f"model.init: {file.name} is truncated or not a safetensors file "
                    f"(header of {n} bytes, file of {size})"
                )
            header = json.loads(f.read(n))
    except OSError as e:
        raise ConfigError(f"model.init: cannot read {file}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ConfigError(f"model.init: {file.name} has no readable safetensors header") from None
    if not isinstance(header, dict):
        raise ConfigError(f"model.init: {file.name} has no readable safetensors header")
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"model.init: {file.name}: tensor {name} has an unreadable header entry"
            ) from None
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize:
            raise ConfigError(f"model.init: {file.name}: tensor {name}'s byte range does not match its shape")
        if 8 + n + end > size:
            raise ConfigError(
                f"model.init: {file.name} is truncated ({size} bytes; tensor {name} ends at byte {8 + n + end})"
            )
        entries[name] = _Entry(file, dtype, shape, 8 + n + begin)
    return entries


class PretrainedWeights:
    """The tensors of a model folder's safetensors files, by name (`open_pretrained`)."""

    def __init__(self, folder: Path, source: str, entries: dict[str, _Entry]) -> None:
        self.folder, self.source, self.entries = folder, source, entries
        self.report: LoadReport | None = None  # the last load's (`load_pretrained`, `load_shards_`)

    def read_into(self, name: str, dest: torch.Tensor, rows: tuple[int, int] | None = None) -> int:
        """Reads tensor `name` (or its rows [a, b)) into `dest`, which has that shape; returns the
        bytes read. Straight into `dest` when it is a contiguous CPU tensor of the file's dtype,
        else through one buffer of the file's dtype, then copied (cast, moved)."""
        e = self.entries[name]
        a, b = rows if rows is not None else (0, e.shape[0] if e.shape else 1)
        row_bytes = e.dtype.itemsize
        for s in e.shape[1:]:
            row_bytes *= s
        count = (b - a) * row_bytes
        direct = dest.device.type == "cpu" and dest.dtype == e.dtype and dest.is_contiguous()
        buf = dest if direct else torch.empty(dest.shape, dtype=e.dtype)
        if buf.numel() * e.dtype.itemsize != count:
            raise RuntimeError(f"read_into: {name}: a destination of {tuple(dest.shape)} for {count} bytes")
        if count:
            view = memoryview(buf.detach().reshape(-1).view(torch.uint8).numpy())  # a parameter too
            with open(e.file, "rb") as f:
                f.seek(e.start + a * row_bytes)
                got = 0
                while got < count:  # one read stops at about 2 GiB on Linux: loop until whole
                    n = f.readinto(view[got:])
                    if not n:
                        raise ConfigError(f"model.init: {e.file.name}: tensor {name} is truncated")
                    got += n
        if not direct:
            dest.copy_(buf)
        return count

    def check_against(self, model: nn.Module) -> None:
        """ConfigError unless the files hold exactly the model's parameters and persistent
        buffers, by name and shape (a tied head is the embedding's tensor: the file may omit it)."""
        want: dict[str, tuple[int, ...]] = {}
        for name, slots in _slots(model).items():
            mod, attr, is_param = slots[0]
            t = mod._parameters[attr] if is_param else mod._buffers[attr]
            want[name] = tuple(t.shape)
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - want.keys()
        extra = sorted(k for k in self.entries if k not in want and k not in tied and not _recomputed(k))
        missing = sorted(k for k in want if k not in self.entries)
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise ConfigError(
                f"model.init: {self.source} lacks tensors of the model: {', '.join(missing[:3])}{more}"
            )
        if extra:
            more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
            raise ConfigError(
                f"model.init: {self.source} holds tensors the model does not have: {', '.join(extra[:3])}{more}"
            )
        for name, shape in want.items():
            if self.entries[name].shape != shape:
                raise ConfigError(
                    f"model.init: {name} has shape {list(self.entries[name].shape)} in {self.source} "
                    f"but {list(shape)} in the model its config.json describes"
                )


def _recomputed(name: str) -> bool:
    """Tensors older checkpoints carry that the model recomputes (RoPE's inverse frequencies)."""
    return name.endswith("rotary_emb.inv_freq")


def open_pretrained(source: str) -> tuple[PretrainedWeights, Any]:
    """The weights and the transformers config of `model.init`, every check done (module
    docstring); nothing of the weights is read yet."""
    folder = resolve_init(source)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.init: {source}: no config.json in this folder")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"model.init: {source}: config.json is unreadable ({_first_line(e)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"model.init: {source}: config.json is not a mapping")
    if raw.get("auto_map"):
        raise ConfigError(
            f"model.init: {source} needs trust_remote_code (its config.json maps to custom code); "
            "effpretrain runs only transformers' own LLaMA-family classes"
        )
    try:
        hf_config = load_hf_config(str(folder))
        shape_of(hf_config)
    except ValueError as e:
        raise ConfigError(f"model.init: {e}") from None
    files = _weight_files(folder, source)
    entries: dict[str, _Entry] = {}
    for file in files:
        for name, entry in _read_header(file).items():
            if name in entries:
                raise ConfigError(
                    f"model.init: tensor {name} is in both {entries[name].file.name} and {file.name}"
                )
            entries[name] = entry
    return PretrainedWeights(folder, source, entries), hf_config


def _weight_files(folder: Path, source: str) -> list[Path]:
    """The safetensors files: the index's (each must exist), or the single file."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"model.init: {source}: {INDEX} is unreadable") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ConfigError(f"model.init: {source}: {INDEX} names {missing[0]}, which is not in the folder")
        return [folder / n for n in names]
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = f" (it has {others[0]}: save it with safe_serialization=True)" if others else ""
    raise ConfigError(f"model.init: {source}: no safetensors weights in this folder{hint}")


def meta_model(hf_config: Any) -> nn.Module:
    """The model of `hf_config` on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return model_class(hf_config)(hf_config)


@torch.no_grad()
def load_pretrained(
    hf_config: Any, weights: PretrainedWeights, after_layer: AfterLayer | None = None
) -> tuple[nn.Module, LoadReport]:
    """The model of `hf_config` with the weights of `weights`, in fp32, built on the meta device
    and filled unit by unit on the CPU, ``after_layer(name, unit)`` run on each unit once read
    (module docstring)."""
    model = meta_model(hf_config)
    weights.check_against(model)
    report = LoadReport(weights.source)
    slots = _slots(model)
    unit_of = _units(model, list(slots))
    order: dict[str, list[str]] = {}
    for name in slots:
        order.setdefault(unit_of[name], []).append(name)
    for unit, names in order.items():
        for name in names:  # allocated on the CPU in every slot of the meta tensor (ties kept)
            _note(report, weights.read_into(name, _allocate(slots[name])))
        if after_layer is not None:
            after_layer(unit, model.get_submodule(unit))
    _recompute_non_persistent(model)
    report.filled_bytes = _held_bytes(model)
    return model, report


@torch.no_grad()
def load_shards_(model: nn.Module, weights: PretrainedWeights, device: torch.device | str) -> LoadReport:
    """Fills a meta model that FSDP2 has sharded (`effpretrain.fsdp.apply_fsdp2`): this rank
    allocates its shards on `device` and reads only its rows of each tensor; the report's
    `filled_bytes` are this rank's shards."""

    weights.check_against(model)
    report = LoadReport(weights.source)
    model.to_empty(device=device)
    for name, slots in _slots(model).items():
        mod, attr, is_param = slots[0]
        t = mod._parameters[attr] if is_param else mod._buffers[attr]
        dest = local(t)
        rows = None
        if dest is not t:  # a DTensor, split on dim 0 over the mesh
            counts = shard_rows(t.shape[0], t.device_mesh.size())
            r = t.device_mesh.get_local_rank()
            start = sum(counts[:r])
            rows = (start, start + counts[r])
            if dest.shape[0] != counts[r]:
                raise RuntimeError(
                    f"load_shards_: {name}'s local shard has {dest.shape[0]} rows, not {counts[r]}"
                )
        _note(report, weights.read_into(name, dest, rows))
    _recompute_non_persistent(model, device)  # beside the shards (RoPE's inv_freq on the GPU)
    report.filled_bytes = _held_bytes(model)
    return report


def _note(report: LoadReport, nbytes: int) -> None:
    report.tensors += 1
    report.bytes_read += nbytes
    report.largest_read_bytes = max(report.largest_read_bytes, nbytes)


def _held_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers on this process (a DTensor's local shard),
    each tensor once (a tied matrix is one)."""
    tensors = {id(t): local(t) for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())
