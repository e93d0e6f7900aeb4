"""Owner ranks: whole-matrix optimizer math on FSDP2-sharded parameters, once per matrix.

Some optimizer steps need a parameter's whole matrix, which FSDP2 splits by rows over the ranks:
a projection basis is computed from the whole gradient, Fira's and APOLLO's norms are over the
whole matrix, 8-bit moments are quantised in blocks of the flattened tensor (unless each row
is whole blocks: `BlockwiseMoments8bit.steps_shards`), and an orthogonalisation (Muon, SWAN)
acts on the whole matrix. Gathering every such matrix on every rank (the "gather" path) repeats
the same math N times and keeps the state whole on every rank, so per-rank optimizer memory stops
shrinking with N. Here each such parameter has one owner rank instead:

1. Placement (`assign_owners`), once, from the global shapes: parameters in decreasing order of
   cost (``m n k`` for a projected matrix, whose basis costs that, ``numel`` for a dense block
   step; `whole_cost`) each go to the least cost-loaded rank among those whose optimizer state
   would stay within ``total / N + largest single state``. The least state-loaded rank always
   qualifies (it holds at most ``(total - s) / N`` before a parameter of state ``s`` is added:
   Graham's list-scheduling argument), so no rank ever holds more than that bound, and among the
   ranks that keep it the compute is balanced.
2. Each step, per bucket of parameters (`OwnerRanks.buckets`, at most ``bucket_bytes`` of whole
   W and G per owner, at least one parameter): one all-to-all sends every rank's row shard of
   the weight W and the gradient G to the owner (`OwnerRanks.gather`), the owner runs the
   single-process step on the whole tensors and keeps that parameter's state, and one all-to-all
   returns to each rank its rows of the new W (`OwnerRanks.scatter`).

The whole W travels (not only G) so that the owner's in-place update, weight decay and fused
``addmm_`` included, is bitwise the single-process one; each rank then keeps exactly the rows a
single process would have written. Per step and projected m x n weight with itemsize s, the
owner receives ``2 (N - 1) / N m n s`` bytes and every other rank ``m n s / N``: per rank about
``3 (N - 1) / N^2`` of the gather path's ``2 (N - 1) / N`` per matrix. Transient memory: on the
owner the whole W and G of its parameters in the bucket plus the receive buffer of the same size.

Layout: FSDP2's, a dim-0 ``Shard`` over a 1-D device mesh; rank i holds rows
``[i c, min((i + 1) c, m))`` with ``c = ceil(m / N)`` (torch.chunk's split, `shard_rows`).
`COMM` (optimizers/_sharded.py) counts the collectives and the bytes each rank sends and receives
through them, as it counts the gather path's all-gathers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from optimizers._sharded import COMM, is_dtensor, local, nonzero_flags, whole, write_whole_
from optimizers.precision import full_fp32
from optimizers.writer import needs_writer, stepping, value_fp32, written

DEFAULT_BUCKET_BYTES = 1 << 26
"""Bytes of whole W and G one owner gathers per bucket (64 MiB; a larger parameter goes alone)."""

WHOLE_MATRIX_PATHS: tuple[str, ...] = ("owner", "gather")
"""How a sharded parameter's whole-matrix step runs: on its owner rank, or gathered on every rank."""


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows of a `rows`-row tensor on each of `world` ranks under FSDP2 (torch.chunk's split:
    ceil(rows / world) each until the rows run out, then 0)."""
    c = -(-rows // world) if rows else 0
    return [max(0, min(c, rows - i * c)) for i in range(world)]


def whole_cost(shape: Sequence[int], group: dict[str, Any]) -> int:
    """Compute cost of one whole-matrix step: ``m n k`` (k = min(r, m, n)) for a projected m x n
    matrix (a group with ``rank``; its basis and projections cost that), ``numel`` otherwise."""
    numel = math.prod(shape)
    projected = group.get("project", group.get("rank") is not None)
    if projected and len(shape) == 2:
        return numel * min(int(group["rank"]), *shape)
    return numel


def assign_owners(items: Sequence[tuple[int, int]], world: int) -> list[int]:
    """Owner rank of each item ``(cost, state_bytes)``, in the items' order (see module docstring).

    Items go in order of decreasing (cost, state bytes), ties in their given order, each to the
    least cost-loaded rank (ties: the lowest rank) among those where it keeps the rank's state
    within ``sum(state) / world + max(state)``. Items with equal (cost, state) are interchangeable,
    so every rank's totals depend only on the multiset of items, not on their order.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not items:
        return []
    states = [s for _, s in items]
    bound = sum(states) / world + max(states)
    cost_load, state_load = [0] * world, [0] * world
    owners = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-items[i][0], -items[i][1], i)):
        cost, state = items[i]
        fits = [r for r in range(world) if state_load[r] + state <= bound]
        r = min(fits, key=lambda r: (cost_load[r], r))
        owners[i] = r
        cost_load[r] += cost
        state_load[r] += state
    return owners


class OwnerPlaced:
    """What an optimizer needs to step its sharded whole-matrix weights on owner ranks: the
    ``whole_matrix`` choice, the placement (made on first use from the global shapes and the
    class's ``state_bytes`` formula) and `holds_state`. A class lists its whole-matrix weights in
    `_whole_step_params` and calls `_init_owners` from its constructor. An element-wise class
    (every step on the local shard: SPAM, Stable-SPAM, LORO) does neither and keeps the defaults:
    it uses the driver (`_placed_step`) for the closure, the placement and the dummy step only."""

    whole_matrix: str = "owner"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    _owners: OwnerRanks | None = None

    def _init_owners(self, whole_matrix: str, bucket_bytes: int) -> None:
        if whole_matrix not in WHOLE_MATRIX_PATHS:
            raise ValueError(f"whole_matrix must be one of {WHOLE_MATRIX_PATHS}, got {whole_matrix!r}")
        self.whole_matrix = whole_matrix
        self.bucket_bytes = int(bucket_bytes)
        self._owners = None

    def _whole_step_params(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """(parameter, group) of the sharded weights whose step needs the whole tensor, in order
        (none for an element-wise class)."""
        return []

    def _flat_params(self) -> list[torch.Tensor]:
        """The optimizer's parameters in order: ``_flat_params()[index]`` is the parameter behind
        `_placed_step`'s `step_one(..., index)`, for a rule that needs more than its local tensors
        (an FSDP2 shard's process group for whole-tensor statistics, the writer's row offsets)."""
        return [q for group in self.param_groups for q in group["params"]]  # type: ignore[attr-defined]

    def owner_ranks(self) -> OwnerRanks | None:
        """The owner placement of the sharded whole-matrix weights (None when there are none, or
        with ``whole_matrix="gather"``)."""
        if self.whole_matrix != "owner":
            return None
        if self._owners is None:
            items = self._whole_step_params()
            if not items:
                return None
            self._owners = OwnerRanks(
                [p for p, _ in items],
                [whole_cost(tuple(p.shape), g) for p, g in items],
                [self.state_bytes(tuple(p.shape), g, p.dtype) for p, g in items],  # type: ignore[attr-defined]
                self.bucket_bytes,
            )
        return self._owners

    def holds_state(self, p: torch.Tensor) -> bool:
        """Whether this process holds `p`'s state: False only for a weight another rank owns."""
        owners = self.owner_ranks()
        return owners is None or owners.owns(p)

    def _placed_step(
        self,
        closure: Callable[[], Any] | None,
        *,
        steps_whole: Callable[[dict[str, Any], torch.Tensor], bool],
        step_one: Callable[[torch.Tensor, torch.Tensor, dict[str, Any], dict[str, Any], int], None],
        init_state: Callable[[torch.Tensor, dict[str, Any], dict[str, Any], int], None] | None = None,
        skip_zero: bool = True,
        fp32_math: bool = False,
    ) -> Any:
        """The one placement driver of a ``step()``: the closure, then every parameter with a
        gradient stepped where it belongs.

        - a plain parameter, or an FSDP2 shard whose rule is element-wise: on this rank's local
          tensors (its state sharded like the parameter);
        - a sharded weight whose step needs the whole tensor (``steps_whole(group, p)``):
          ``whole_matrix="owner"`` once, on its owner rank (`OwnerRanks.step_each`, a collective),
          ``"gather"`` on every rank's gathered copy, each keeping its rows.

        With `skip_zero`, a parameter whose whole gradient is zero (a checkpoint loader's dummy
        step; `nonzero_flags`, one decision on every rank) only gets its state allocated
        (`init_state`, whole-shaped where it steps whole; on the owner alone), and nothing moves.
        `step_one(weight, grad, state, group, index)` is the method's rule on plain tensors;
        `index` is the parameter's position in the optimizer (seeds per parameter).

        With `fp32_math`, everything after the closure runs under `optimizers.precision.full_fp32`:
        the method's bases, projections, orthogonalisation and norms at IEEE fp32 whatever the
        process's TF32 setting (docs/gpu.md, G9), while the closure's model keeps the run's.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with full_fp32() if fp32_math else contextlib.nullcontext():
            self._step_placed(steps_whole, step_one, init_state, skip_zero)
        return loss

    def _step_placed(
        self,
        steps_whole: Callable[[dict[str, Any], torch.Tensor], bool],
        step_one: Callable[[torch.Tensor, torch.Tensor, dict[str, Any], dict[str, Any], int], None],
        init_state: Callable[[torch.Tensor, dict[str, Any], dict[str, Any], int], None] | None,
        skip_zero: bool,
    ) -> None:
        """`_placed_step` after its closure: every parameter with a gradient, where it belongs."""
        entries = self._entries_with_grad()
        live = (
            nonzero_flags([q.grad for _, q, _ in entries]) if skip_zero and entries else [True] * len(entries)
        )
        owned: list[tuple[dict[str, Any], torch.Tensor, int]] = []
        for (group, q, idx), nonzero in zip(entries, live):
            whole_step = is_dtensor(q) and steps_whole(group, q)
            if whole_step and self.whole_matrix == "owner":
                # No state entry on a rank that does not own `q` (not even an empty one).
                if nonzero:
                    owned.append((group, q, idx))
                elif not self.state.get(q) and init_state is not None and self.holds_state(q):  # type: ignore[attr-defined]
                    init_state(whole_shaped(q), group, self.state[q], idx)  # type: ignore[attr-defined]
                continue
            state = self.state[q]  # type: ignore[attr-defined]
            if not state and init_state is not None:
                init_state(whole_shaped(q) if whole_step else q, group, state, idx)
            if not nonzero:
                continue
            if whole_step:  # "gather": the whole W and G on every rank, each keeps its rows
                weight = whole(q)
                step_one(weight, whole(q.grad), state, group, idx)
                write_whole_(q, weight)
            else:
                with stepping(q):  # the rule's write of the shard rounds as q's (`optimizers.writer`)
                    step_one(local(q), local(q.grad), state, group, idx)
        if owned:
            self._owner_steps(owned, step_one, init_state)

    def _entries_with_grad(self) -> list[tuple[dict[str, Any], torch.Tensor, int]]:
        """(group, parameter, index) of every parameter with a gradient; sparse ones refused."""
        entries, index = [], 0
        for group in self.param_groups:  # type: ignore[attr-defined]
            for q in group["params"]:
                if q.grad is not None:
                    if q.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                    entries.append((group, q, index))
                index += 1
        return entries

    def _owner_steps(
        self,
        entries: list[tuple[dict[str, Any], torch.Tensor, int]],
        step_one: Callable[[torch.Tensor, torch.Tensor, dict[str, Any], dict[str, Any], int], None],
        init_state: Callable[[torch.Tensor, dict[str, Any], dict[str, Any], int], None] | None,
    ) -> None:
        """The whole-tensor steps of sharded weights, each once on its owner rank (a collective:
        every rank calls it with the same `entries`)."""
        owners = self.owner_ranks()
        assert owners is not None
        where = {id(q): (group, idx) for group, q, idx in entries}

        def step(q: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> None:
            group, idx = where[id(q)]
            state = self.state[q]  # type: ignore[attr-defined]
            if not state and init_state is not None:
                # Whole-shaped plain tensors, in the parameter's dtype: a weight stored in fewer
                # bits travels as its fp32 value (`_value`), its state stays in its own dtype.
                like = weight if weight.dtype == q.dtype else whole_shaped(q).to(weight.device)
                init_state(like, group, state, idx)
            step_one(weight, grad, state, group, idx)

        owners.step_each([q for _, q, _ in entries], step)


def whole_shaped(p: torch.Tensor) -> torch.Tensor:
    """A plain stand-in with the whole shape, dtype and local device of DTensor `p` (no storage),
    for allocating whole-tensor state with ``zeros_like``."""
    return torch.empty((), dtype=p.dtype, device=local(p).device).expand(p.shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (any dtype)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class OwnerRanks:
    """The owner placement of one optimizer's whole-matrix parameters, and their exchange.

    Args:
        params: the FSDP2 (DTensor, dim-0 ``Shard`` on a 1-D mesh) parameters that step whole, in
            the optimizer's order.
        costs: each one's `whole_cost`.
        states: each one's optimizer-state bytes (the method's formula).
        bucket_bytes: the most whole W and G bytes one owner gathers per bucket.

    Raises:
        ValueError: a parameter that is not a dim-0 row shard over one 1-D mesh.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        costs: Sequence[int],
        states: Sequence[int],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        from torch.distributed.tensor import Shard

        if not params:
            raise ValueError("OwnerRanks needs at least one parameter")
        mesh = params[0].device_mesh
        for p in params:
            if p.device_mesh is not mesh and p.device_mesh != mesh:
                raise ValueError("owner-rank steps need every parameter on one device mesh")
            if mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
                raise ValueError(
                    f"owner-rank steps need FSDP2's dim-0 row shards on a 1-D mesh, got "
                    f"{tuple(p.placements)} on a {mesh.ndim}-D mesh (use whole_matrix='gather')"
                )
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        self.bucket_bytes = int(bucket_bytes)
        owners = assign_owners(list(zip(costs, states)), self.world)
        self._owner = {id(p): o for p, o in zip(params, owners)}
        self._order = {id(p): i for i, p in enumerate(params)}

    def owner(self, p: torch.Tensor) -> int:
        """The rank that steps `p` and holds its state."""
        return self._owner[id(p)]

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank steps `p` (True for a parameter outside the placement)."""
        return self._owner.get(id(p), self.rank) == self.rank

    def buckets(self, params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """`params` in placement order, split so that no owner gathers more than ``bucket_bytes``
        of whole W and G per bucket (a parameter larger than that goes alone)."""
        out: list[list[torch.Tensor]] = []
        load: dict[int, int] = {}
        for p in sorted(params, key=lambda p: self._order[id(p)]):
            size = 2 * p.numel() * p.dtype.itemsize
            o = self.owner(p)
            if not out or (load.get(o, 0) and load[o] + size > self.bucket_bytes):
                out.append([])
                load = {}
            out[-1].append(p)
            load[o] = load.get(o, 0) + size
        return out

    def step_each(
        self, params: Sequence[torch.Tensor], step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    ) -> None:
        """Bucket by bucket: `gather`, ``step(p, W, G)`` on each parameter this rank owns (updating
        the whole W in place), `scatter` (a collective: every rank calls it with the same `params`)."""
        for bucket in self.buckets(params):
            wholes = self.gather(bucket)
            for p, (weight, grad) in wholes.items():
                step(p, weight, grad)
            self.scatter(bucket, {p: weight for p, (weight, _) in wholes.items()})

    def _rows(self, p: torch.Tensor) -> list[int]:
        return shard_rows(p.shape[0], self.world)

    def _exchange(
        self, send: list[torch.Tensor], recv_sizes: list[int], device: torch.device
    ) -> torch.Tensor:
        """One all-to-all (several ranks): `send[d]` (uint8) goes to rank d; returns what came in,
        by source rank."""
        import torch.distributed as dist

        sizes = [t.numel() for t in send]
        flat = torch.cat(send) if send else torch.empty(0, dtype=torch.uint8, device=device)
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(out, flat, recv_sizes, sizes, group=self.group)
        COMM.collectives += 1
        COMM.bytes_sent += sum(sizes) - sizes[self.rank]
        COMM.bytes_received += sum(recv_sizes) - recv_sizes[self.rank]
        return out

    def gather(self, bucket: Sequence[torch.Tensor]) -> dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Whole (W, G) of the parameters in `bucket` this rank owns, from every rank's row shards
        (a collective: every rank calls it with the same bucket). On one rank the local tensors
        are the whole ones: no copy."""
        if self.world == 1:
            return {p: (_value(p), local(p.grad)) for p in bucket}
        device = local(bucket[0]).device
        send: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        for p in bucket:
            w, g = _value(p), local(p.grad)
            if w.shape[0] != self._rows(p)[self.rank] or g.shape != w.shape:
                raise RuntimeError(
                    f"a {tuple(p.shape)} parameter's local rows {tuple(w.shape)} (gradient {tuple(g.shape)}) "
                    f"are not rank {self.rank}'s torch.chunk rows {self._rows(p)[self.rank]}"
                )
            send[self.owner(p)] += [_bytes(w), _bytes(g)]
        mine = [p for p in bucket if self.owner(p) == self.rank]

        def rows_of(t: torch.Tensor, s: int) -> int:  # bytes of rank s's rows of whole t
            return shard_rows(t.shape[0], self.world)[s] * _row_bytes(t)

        out = {
            p: (
                torch.empty(p.shape, dtype=_value_dtype(p), device=device),
                torch.empty(p.grad.shape, dtype=p.grad.dtype, device=device),
            )
            for p in mine
        }
        recv = [sum(rows_of(w, s) + rows_of(g, s) for w, g in out.values()) for s in range(self.world)]
        data = self._exchange([_cat(parts, device) for parts in send], recv, device)
        offset = 0
        for s in range(self.world):
            for p in mine:
                for full in out[p]:
                    row = _row_bytes(full)
                    start, n = sum(shard_rows(full.shape[0], self.world)[:s]) * row, rows_of(full, s)
                    _bytes_view(full)[start : start + n].copy_(data[offset : offset + n])
                    offset += n
        return out

    def scatter(self, bucket: Sequence[torch.Tensor], new: dict[torch.Tensor, torch.Tensor]) -> None:
        """Every rank's rows of the whole new W that the owners computed (`new`, keyed by the
        parameter, on the owner) written into each parameter's local shard (a collective)."""
        if self.world == 1:
            for p in bucket:
                t = local(p)
                if needs_writer(p) or (new[p] is not t and new[p].data_ptr() != t.data_ptr()):
                    with written(p) as w:  # its rows, rounded once where stored in fewer bits
                        w.copy_(new[p])
            return
        device = local(bucket[0]).device
        send: list[list[torch.Tensor]] = [[] for _ in range(self.world)]
        for p in bucket:
            if self.owner(p) != self.rank:
                continue
            rows, flat, row_bytes = self._rows(p), _bytes(new[p]), _row_bytes(new[p])
            for d in range(self.world):
                start = sum(rows[:d]) * row_bytes
                send[d].append(flat[start : start + rows[d] * row_bytes])
        recv = [0] * self.world
        for p in bucket:
            recv[self.owner(p)] += local(p).numel() * _value_dtype(p).itemsize
        data = self._exchange([_cat(parts, device) for parts in send], recv, device)
        starts = [sum(recv[:s]) for s in range(self.world)]
        for p in bucket:
            o = self.owner(p)
            shard = local(p)
            n = shard.numel() * _value_dtype(p).itemsize
            if n and needs_writer(p):  # its rows in fp32, rounded once into its storage
                rows = torch.empty(shard.shape, dtype=torch.float32, device=device)
                _bytes_view(rows).copy_(data[starts[o] : starts[o] + n])
                with written(p) as w:
                    w.copy_(rows)
            elif n:
                _bytes_view(shard).copy_(data[starts[o] : starts[o] + n])
            starts[o] += n


def _value(p: torch.Tensor) -> torch.Tensor:
    """What travels to an owner as `p`'s rows: the local shard itself, or, for a weight stored in
    fewer bits (bf16, INT8: `needs_writer`), its fp32 value (the owner steps fp32; each rank
    rounds its own rows back, with the noise of their offsets)."""
    return value_fp32(p) if needs_writer(p) else local(p)


def _value_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if needs_writer(p) else p.dtype


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one dim-0 row of `t`."""
    return math.prod(t.shape[1:]) * t.dtype.itemsize


def _cat(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's own storage as a flat uint8 view (writes reach `t`)."""
    if not t.is_contiguous():
        raise ValueError("owner exchange writes into contiguous tensors only")
    return t.reshape(-1).view(torch.uint8)


__all__ = [
    "COMM",
    "DEFAULT_BUCKET_BYTES",
    "WHOLE_MATRIX_PATHS",
    "OwnerPlaced",
    "OwnerRanks",
    "assign_owners",
    "shard_rows",
    "whole_cost",
]
