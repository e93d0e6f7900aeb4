"""8-bit AdamW: bitsandbytes' block-wise quantized AdamW with our exact state-memory formula.

The update rule is bitsandbytes' (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"): AdamW whose moments m (signed dynamic map) and v (unsigned dynamic map) are
stored as uint8 codes with one fp32 absmax per block of 256 entries, dequantized for the update
and re-quantized after it. Tensors smaller than `min_8bit_size` keep fp32 moments.

This is the one file in optimizers/ that imports bitsandbytes; the registry imports it only when
"adamw_8bit" is asked for, so the rest of the package works without it.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from optimizers._owners import DEFAULT_BUCKET_BYTES, OwnerPlaced
from optimizers._sharded import is_dtensor
from optimizers._streams import legacy_stream, ordered_on
from optimizers.writer import needs_writer, written

try:
    import bitsandbytes as bnb
    from bitsandbytes.utils import sync_gpu
except ImportError as err:  # the registry imports this module lazily, so only users of adamw_8bit see this
    raise ImportError(
        "optimizer 'adamw_8bit' needs bitsandbytes (>= 0.45): pip install bitsandbytes"
    ) from err

__all__ = ["AdamW8bit"]

# bitsandbytes' block-wise 8-bit state: one fp32 absmax per block of this many entries.
_BLOCKSIZE = 256
# Each 8-bit moment refers to a 256-entry fp32 quantization map (qmap1, qmap2), one per optimizer.
_QMAP_ENTRIES = 256


class AdamW8bit(OwnerPlaced, bnb.optim.AdamW8bit):
    r"""bitsandbytes.optim.AdamW8bit plus `state_bytes` and a per-group `min_8bit_size`.

    Update (per step k, decoupled weight decay lambda, as torch's AdamW up to the 8-bit
    round trip of m and v)::

        m <- beta1 m + (1 - beta1) G,   v <- beta2 v + (1 - beta2) G^2
        p <- p (1 - eta lambda) - eta / (1 - beta1^k) m / (sqrt(v / (1 - beta2^k)) + eps)

    State keys are bitsandbytes' own (``step`` int, ``state1`` = exp_avg, ``state2`` =
    exp_avg_sq, ``absmax1``/``absmax2``, ``qmap1``/``qmap2``); state_dict() nests the quantized
    tensors under one key, and torch.load(weights_only=True) restores it. Under Accelerate the
    class is used unchanged.

    Args:
        params: Parameters or param groups (torch format); a group may set ``min_8bit_size``.
        lr: Learning rate eta.
        betas: (beta1, beta2).
        eps: epsilon.
        weight_decay: Decoupled weight decay lambda (bitsandbytes' default 1e-2).
        min_8bit_size: Tensors with fewer entries keep fp32 moments (bitsandbytes default 4096).
        **kwargs: Passed to bitsandbytes.optim.AdamW8bit (e.g. ``is_paged``).
    """

    ELEMENTWISE: ClassVar[bool] = False
    """Block-wise 8-bit moments are not element-wise: under FSDP2 every weight steps whole, on its
    owner rank, which alone holds its state (the registry's ``fsdp2_whole_state`` reads this)."""

    RESET_KEYS: ClassVar[tuple[str, ...]] = ("step", "state1", "state2", "absmax1", "absmax2")
    """A momentum reset zeroes the codes and their scales (a zero scale reads exactly 0), not the
    shared quantile maps (`optimizers.momentum_reset`)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        min_8bit_size: int = 4096,
        whole_matrix: str = "owner",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        **kwargs: Any,
    ) -> None:
        self._init_owners(whole_matrix, bucket_bytes)
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            min_8bit_size=min_8bit_size,
            **kwargs,
        )
        # Recorded per group so state_bytes(shape, group, dtype) sees the value actually used.
        for group in self.param_groups:
            group.setdefault("min_8bit_size", min_8bit_size)

    def get_config(self, gindex: int, pindex: int, group: dict[str, Any]) -> dict[str, Any]:
        """bitsandbytes' per-parameter config, with the group's ``min_8bit_size`` taking effect."""
        config = super().get_config(gindex, pindex, group)
        config["min_8bit_size"] = group.get("min_8bit_size", config["min_8bit_size"])
        return config

    def _whole_step_params(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """Every sharded (DTensor) weight: 8-bit blocks are not element-wise."""
        return [(p, g) for g in self.param_groups for p in g["params"] if is_dtensor(p)]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """bitsandbytes' update of every parameter with a gradient, placed by
        `OwnerPlaced._placed_step` (the closure, then one parameter at a time, `_bnb_one`).

        bitsandbytes' kernels take plain tensors, and its block-wise quantisation is not
        element-wise, so under FSDP2 a DTensor weight steps as the whole tensor (the same blocks,
        hence the same numbers, as a single process). ``whole_matrix="owner"`` (default): once, on
        the weight's owner rank, which receives the row shards of W and G, holds the 8-bit state and
        returns every rank its rows (optimizers/_owners.py), so each rank holds about 1/N of the
        state. ``"gather"``: every rank all-gathers W and G and steps it, keeping its own rows; the
        state is then whole on every rank. A zero gradient steps like any other, as in
        bitsandbytes' own step.
        """
        if not self.initialized:  # bitsandbytes' once-per-optimizer set-up of its own step
            self.check_overrides()
            self.to_gpu()
            self.initialized = True
        params = self._flat_params()
        # bitsandbytes reads a parameter's config by (group index, position in the group).
        where = [(gi, pi) for gi, g in enumerate(self.param_groups) for pi in range(len(g["params"]))]

        def step_one(
            w: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any], i: int
        ) -> None:
            if w is params[i] and needs_writer(w):
                # A weight stored in fewer bits (bf16, INT8) steps as its fp32 value (bitsandbytes'
                # kernel writes its parameter in place), written back once through the writer.
                with written(w) as value:
                    self._bnb_one(value, g, state, group, *where[i])
            else:  # the parameter itself, or the whole tensor (or fp32 value) standing for it
                self._bnb_one(w, g, state, group, *where[i])

        return self._placed_step(
            closure, steps_whole=lambda group, p: True, step_one=step_one, skip_zero=False
        )

    def _bnb_one(
        self,
        weight: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        gindex: int,
        pindex: int,
    ) -> None:
        """bitsandbytes' step of one plain tensor `weight` with gradient `grad` and the parameter's
        `state` (allocated on its first step): `weight` is the parameter itself, or a whole tensor
        or fp32 value standing for it, which takes the parameter's state dict for the step.

        bitsandbytes' own ``Optimizer8bit.step`` calls ``torch.cuda.synchronize()`` after every
        parameter (``sync_gpu``): a host-device synchronisation per parameter that drains the
        launch queue. Its kernels launch on the legacy default stream, so what orders them is
        the stream, not the host: here the state allocation and ``update_step``'s kernels run on
        that stream, ordered both ways with the caller's stream (`optimizers._streams.ordered_on`),
        and nothing synchronises the host. Paged state is prefetched asynchronously through
        unified memory, which does need bitsandbytes' synchronisation: ``is_paged`` steps as its
        loop does.
        """
        stand_in = self.state.get(weight) is not state
        if stand_in:
            # bitsandbytes steps ``p`` by ``p.grad`` and ``self.state[p]``, and steps a gradient of
            # its weight's dtype (a rounded weight's fp32 value takes an fp32 copy of its gradient).
            weight.grad = grad if grad.dtype == weight.dtype else grad.to(weight.dtype)
            self.state[weight] = state
        try:
            if self.is_paged:
                if not state:
                    self.init_state(group, weight, gindex, pindex)
                self.prefetch_state(weight)
                self.update_step(group, weight, gindex, pindex)
                sync_gpu(weight)
                return
            device = weight.device
            with ordered_on(legacy_stream(device), device, used=[weight.grad]):
                if not state:
                    self.init_state(group, weight, gindex, pindex)
                self.update_step(group, weight, gindex, pindex)
        finally:
            if stand_in:  # state and param_groups stay keyed by the real parameters
                del self.state[weight]
                weight.grad = None

    def load_state_dict(self, state_dict: dict[str, Any], move_to_device: bool = True) -> None:
        """bitsandbytes' load, then the quantile maps shared again.

        bitsandbytes moves each parameter's ``qmap1``/``qmap2`` to the parameter's device one by
        one, so after loading a checkpoint read onto the CPU (or saved by DCP, which keys every
        tensor apart) each 8-bit parameter holds its own copies: 2 x 4 x 256 bytes more per
        parameter than the one pair the optimizer held before (`shared_state_bytes`). Maps equal
        in value on the same device become one tensor again (the first loaded), which is also
        the map that parameters initialised later refer to (``name2qmap``).
        """
        super().load_state_dict(state_dict, move_to_device=move_to_device)
        for key, name in (("qmap1", "dynamic"), ("qmap2", "udynamic")):
            shared: dict[torch.device, torch.Tensor] = {}
            for st in self.state.values():
                qmap = st.get(key) if isinstance(st, dict) else None
                if not torch.is_tensor(qmap):
                    continue
                first = shared.setdefault(qmap.device, qmap)
                if first is not qmap and torch.equal(first, qmap):
                    st[key] = first
            if len(shared) == 1:
                self.name2qmap[name] = next(iter(shared.values()))

    @classmethod
    def state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Exact bytes of the state tensors that belong to one parameter after >= 1 step (any dtype).

        With numel = prod(shape) and B = ceil(numel / 256):

        - numel >= min_8bit_size (default 4096): ``2 * numel + 2 * 4 * B`` (uint8 state1/state2,
          fp32 absmax1/absmax2); the fp32 ``qmap1``/``qmap2`` its state also refers to are the
          optimizer's, shared by every 8-bit parameter (`shared_state_bytes`);
        - otherwise: ``2 * 4 * numel`` (fp32 state1/state2).

        ``step`` is a python int (0 bytes). `group` keys read: ``min_8bit_size``.
        """
        numel = math.prod(shape)
        if numel >= group.get("min_8bit_size", 4096):
            blocks = -(-numel // _BLOCKSIZE)
            return 2 * numel + 2 * 4 * blocks
        return 2 * 4 * numel

    @classmethod
    def shared_state_bytes(cls, shape: tuple[int, ...], group: dict[str, Any], dtype: torch.dtype) -> int:
        """Bytes of the state one parameter refers to that the optimizer holds once for all of them.

        An 8-bit parameter's ``qmap1``/``qmap2`` are the same two 256-entry fp32 tensors for every
        parameter (bitsandbytes keeps one map per kind and device): ``2 * 4 * 256`` when numel >=
        min_8bit_size, else 0. The optimizer's total is the largest of these over its parameters
        (2048 bytes once any parameter is 8-bit), not their sum.
        """
        return 2 * 4 * _QMAP_ENTRIES if math.prod(shape) >= group.get("min_8bit_size", 4096) else 0
