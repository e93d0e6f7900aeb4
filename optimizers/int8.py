"""INT8 weights: a linear layer's weight stored as int8 codes with per-group fp32 scales.

`Int8Weight` is a tensor subclass that stands for the (m, n) matrix it encodes: its dtype is the
dtype it computes in (fp32 on CPU, where bf16 matmuls are slow; the run's compute dtype on a GPU),
its storage is ``codes`` (int8, (m, n)) and ``scales`` (fp32, (m, ceil(n / group))), laid out and
rounded as `optimizers.rounding` says (``m n + 4 m ceil(n / g)`` bytes). It is a leaf parameter
like any other: the model calls ``F.linear(x, W)`` and gets x W^T with W dequantized for that one
product (`_Int8Linear`: one (m, n) temporary in the forward and one in the backward, freed after
the product); its gradient is a plain (m, n) tensor of its dtype, which every optimizer reads as
usual. Any other read (``W.norm()``, ``W.to(...)``, ``torch.zeros_like(W)``) sees the dequantized
values, as a plain tensor.

Writes are different: an in-place operation on an `Int8Weight` is an error. Its new value reaches
the codes only through the one writer (`optimizers.writer.written`), which dequantizes it once,
lets the method's rule update the fp32 value, and rounds it back once (stochastically with the
counter-based noise, or to nearest). So no update can bypass the rounding, and none rounds twice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from optimizers import rounding

__all__ = ["Int8Weight", "is_int8"]


def is_int8(t: Any) -> bool:
    """Whether `t` (or a DTensor's local shard) is an `Int8Weight`."""
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return isinstance(t, Int8Weight)


class Int8Weight(torch.Tensor):
    """An (m, n) weight as int8 codes and per-group scales (module docstring).

    Args:
        codes: int8, (m, n).
        scales: fp32, (m, ceil(n / group)).
        group: columns per scale group.
        dtype: the dtype it computes in (dequantizes to).
        requires_grad: a trainable weight.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    group: int

    @staticmethod
    def __new__(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        group: int,
        dtype: torch.dtype = torch.float32,
        requires_grad: bool = False,
    ) -> Int8Weight:
        return torch.Tensor._make_wrapper_subclass(
            cls, codes.shape, dtype=dtype, device=codes.device, requires_grad=requires_grad
        )

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        group: int,
        dtype: torch.dtype = torch.float32,
        requires_grad: bool = False,
    ) -> None:
        if codes.dtype != torch.int8 or codes.ndim != 2:
            raise ValueError(
                f"Int8Weight codes must be a 2-D int8 tensor, got {codes.dtype} {tuple(codes.shape)}"
            )
        want = (codes.shape[0], rounding.int8_groups(codes.shape[1], group))
        if scales.dtype != torch.float32 or tuple(scales.shape) != want:
            raise ValueError(
                f"Int8Weight scales must be fp32 {want}, got {scales.dtype} {tuple(scales.shape)}"
            )
        self.codes, self.scales, self.group = codes, scales, int(group)

    @classmethod
    def quantize(
        cls,
        w: torch.Tensor,
        group: int = 128,
        dtype: torch.dtype | None = None,
        u: torch.Tensor | None = None,
    ) -> Int8Weight:
        """`w` (m, n) as codes and scales, rounded to nearest (or stochastically with `u`)."""
        m, n = w.shape
        codes = torch.empty(m, n, dtype=torch.int8, device=w.device)
        scales = torch.empty(m, rounding.int8_groups(n, group), dtype=torch.float32, device=w.device)
        rounding.quantize_int8_(codes, scales, w.detach(), group, u)
        return cls(codes, scales, group, dtype or w.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values, as a plain tensor of `dtype` (default: this weight's dtype)."""
        return rounding.dequantize_int8(self.codes, self.scales, self.group, dtype or self.dtype)

    def store_(self, x: torch.Tensor, u: torch.Tensor | None) -> None:
        """Writes fp32 `x` into the codes and scales (stochastically with uniforms `u`)."""
        rounding.quantize_int8_(self.codes, self.scales, x, self.group, u)

    def nbytes_stored(self) -> int:
        """Bytes this weight holds: codes and scales."""
        return self.codes.nbytes + self.scales.nbytes

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Int8Weight(shape={tuple(self.shape)}, group={self.group}, dtype={self.dtype})"

    # -- torch's subclass protocol --------------------------------------------------------------
    def __tensor_flatten__(self) -> tuple[list[str], tuple[int, torch.dtype]]:
        return ["codes", "scales"], (self.group, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size: Any, outer_stride: Any) -> Int8Weight:
        return Int8Weight(inner["codes"], inner["scales"], meta[0], meta[1])

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], Int8Weight):
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return _Int8Linear.apply(args[0], args[1], bias)
        if func is F.embedding and len(args) >= 2 and isinstance(args[1], Int8Weight):
            ids, w, padding_idx, max_norm, _, by_freq, sparse = _embedding_args(*args, **kwargs)
            if max_norm is not None or by_freq or sparse:
                raise NotImplementedError("an INT8 embedding supports plain lookups only")
            if padding_idx is not None and padding_idx < 0:
                padding_idx += w.shape[0]
            return _Int8Embedding.apply(ids, w, padding_idx)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            w = args[0]
            return _carry(w, Int8Weight(w.codes, w.scales, w.group, w.dtype))
        # Row views and row blocks (FSDP2 shards a weight by rows; a group never straddles two).
        if func is aten.slice.Tensor and _arg(args, kwargs, 1, "dim", 0) == 0:
            w = args[0]
            start, end = _arg(args, kwargs, 2, "start", None), _arg(args, kwargs, 3, "end", None)
            step = _arg(args, kwargs, 4, "step", 1)
            rows = slice(start, end, step)
            return Int8Weight(w.codes[rows], w.scales[rows], w.group, w.dtype)
        if (
            func in (aten.split.Tensor, aten.split_with_sizes.default)
            and _arg(args, kwargs, 2, "dim", 0) == 0
        ):
            w, sizes = args[0], args[1]
            codes, scales = func(w.codes, sizes, 0), func(w.scales, sizes, 0)
            return [Int8Weight(c, sc, w.group, w.dtype) for c, sc in zip(codes, scales)]
        if func is aten.new_zeros.default:
            w, size = args[0], tuple(args[1])
            if len(size) != 2 or size[1] != w.shape[1]:
                raise RuntimeError(f"an INT8 weight's new_zeros keeps its columns: {size}")
            codes = torch.zeros(size, dtype=torch.int8, device=w.device)
            scales = torch.ones(size[0], w.scales.shape[1], dtype=torch.float32, device=w.device)
            return Int8Weight(codes, scales, w.group, w.dtype)
        if func is aten.as_strided.default and tuple(args[1]) == tuple(args[0].shape):
            w = args[0]
            if _arg(args, kwargs, 3, "storage_offset", 0) in (0, None):
                return Int8Weight(w.codes, w.scales, w.group, w.dtype)
        if func is aten._to_copy.default and set(kwargs) <= {"dtype", "device", "non_blocking", "layout"}:
            # .to(device) moves the codes and scales; .to(dtype) changes the dtype it computes in.
            w = args[0]
            device, dtype = kwargs.get("device") or w.device, kwargs.get("dtype") or w.dtype
            if dtype.is_floating_point:
                move = {"device": device, "non_blocking": bool(kwargs.get("non_blocking"))}
                return _carry(w, Int8Weight(w.codes.to(**move), w.scales.to(**move), w.group, dtype))
        if func is aten.view.default and list(args[1]) == [-1]:
            return _Int8Flat(args[0])  # FSDP2's flat handle of a shard: kept, never computed with
        if func is torch.ops.aten.copy_.default and isinstance(args[1], Int8Weight):
            # Quantized into quantized (a checkpoint's codes, a shard's rows): exact, not an update.
            dst, src = args[0], args[1]
            if src is not dst:
                if src.group != dst.group:
                    raise RuntimeError(f"INT8 groups differ: {src.group} into {dst.group}")
                dst.codes.copy_(src.codes)
                dst.scales.copy_(src.scales)
            return dst
        if func._schema.is_mutable:
            raise RuntimeError(
                f"{func} would write an INT8 weight in place: its updates go through "
                "optimizers.writer.written (one rounding per step)"
            )

        def plain(t: Any) -> Any:
            return t.dequantize() if isinstance(t, Int8Weight) else t

        return func(*pytree.tree_map(plain, args), **pytree.tree_map(plain, kwargs))

    # -- FSDP2's all-gather extension: the shards' codes and scales travel, not fp32 rows ----------
    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        return (self.codes, self.scales), None

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[Int8Weight, tuple[torch.Tensor, ...]] | None:
        codes, scales = all_gather_outputs
        codes = codes.view(-1, self.codes.shape[1])
        scales = scales.view(-1, self.scales.shape[1])
        if out is not None:  # the unsharded weight's codes and scales are these buffers, refilled
            return None
        return Int8Weight(codes, scales, self.group, param_dtype or self.dtype), (codes, scales)


def _carry(old: Int8Weight, new: Int8Weight) -> Int8Weight:
    """`new` with `old`'s other attributes (the writer's rounding plan): `Module.to` swaps a
    parameter's contents, __dict__ included, with the copy it makes (`torch.utils.swap_tensors`)."""
    for k, v in old.__dict__.items():
        if k not in ("codes", "scales", "group"):
            new.__dict__.setdefault(k, v)
    return new


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any) -> Any:
    """An operator's argument `i` (or `name`)."""
    return args[i] if len(args) > i else kwargs.get(name, default)


class _Int8Flat(torch.Tensor):
    """A flat (numel,) handle of an `Int8Weight`, which FSDP2 keeps for each shard but, with the
    all-gather extension, never computes with: any operation on it is an error."""

    @staticmethod
    def __new__(cls, w: Int8Weight) -> _Int8Flat:
        return torch.Tensor._make_wrapper_subclass(cls, (w.numel(),), dtype=w.dtype, device=w.device)

    def __init__(self, w: Int8Weight) -> None:
        self.weight = w

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise RuntimeError(f"{func} on the flat handle of an INT8 weight")


class _Int8Linear(torch.autograd.Function):
    """y = x W^T + b with W an `Int8Weight`, dequantized once in the forward and once in the
    backward (saved for backward: x, as a dense linear layer saves it; not W's dequantized copy)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: Int8Weight, b: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.w, ctx.has_bias = w, b is not None
        return F.linear(x, w.dequantize(x.dtype), b)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        w = ctx.w
        gx = gy @ w.dequantize(gy.dtype) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])).to(w.dtype)
        gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _embedding_args(
    input: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> tuple:
    """F.embedding's arguments, by position or by name."""
    return input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse


class _Int8Embedding(torch.autograd.Function):
    """rows = W[ids] with W an `Int8Weight`: only the looked-up rows are dequantized (ids.numel()
    x n); the gradient is W's shape, dense, as a dense embedding's (the rows' sums at their ids)."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, w: Int8Weight, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.w, ctx.padding_idx = w, padding_idx
        flat = ids.reshape(-1)
        rows = rounding.dequantize_int8(w.codes[flat], w.scales[flat], w.group, w.dtype)
        return rows.reshape(*ids.shape, w.shape[1])

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (ids,) = ctx.saved_tensors
        w = ctx.w
        gw = torch.zeros(w.shape, dtype=w.dtype, device=gy.device)
        flat = ids.reshape(-1)
        g = gy.reshape(-1, w.shape[1]).to(w.dtype)
        if ctx.padding_idx is not None:
            g = g.masked_fill((flat == ctx.padding_idx).unsqueeze(1), 0)
        gw.index_add_(0, flat, g)
        return None, gw, None
