"""Per-parameter optimizer updates inside backward (``train.update_in_backward: true``).

Normally every gradient lives from its backward until ``optimizer.step()``: all of them at once
(2 s_g P bytes at the peak of a step, s_g the gradient itemsize, P the trainable count). Here each
parameter (or step unit, see below) is updated in a post-accumulate-grad hook as soon as its
gradient is final, and the gradient is freed at once, so that only the accumulators of an
accumulating step and the gradients in flight remain. The optimizer is the run's own (same
classes, same state, same checkpoints); the hook steps it with only that unit's gradients set.

One optimizer step of K micro-batches (`InBackward.begin_micro` before each backward):

* micro-batches 1 .. K-1: each parameter's gradient G_k moves into an accumulator and
  ``p.grad`` is freed. The accumulator is low rank, R = sum_k proj(G_k) (r x max(m, n)), for a
  projected matrix whose method reads G only through R and whose basis will not refresh at this
  step (`ProjectedAdam.accumulation_basis`), when clipping is off (see Clipping); otherwise it is
  the full sum of the G_k (embeddings, head, norms, factors of a factorized model, Fira's and
  APOLLO's matrices, every projected matrix at a refresh step: the bounded spike the estimator
  counts, and every matrix when clipping is on).
  With ``refresh_ahead`` (``train.in_backward_refresh=first_micro``) a projected matrix whose
  refresh is due takes its new basis from micro-batch 1's gradient, in that hook
  (`ProjectedAdam.refresh_basis_ahead`), and keeps a low-rank accumulator at the refresh too.
* micro-batch K: the final gradient is G = acc + G_K, or back(R) + G_K for a low-rank accumulator
  (the step projects it again: proj(back(R) + G_K) = R + proj(G_K) up to rounding, as
  P^T P = I); it is all-reduced when a reduction is given (DDP), clipped (below), its squared
  norm recorded, and its unit steps; then every gradient of the unit is freed.

Step units: one parameter, except the (B, A) pairs of a group with ``factor_pairs`` (LORO's exact
Riemannian step needs both factors at once): a pair steps when both gradients are final.

Clipping (exact global-norm clipping needs every gradient before any update, which in-backward
updates cannot wait for): step t's gradients are multiplied by
c_t = min(1, max_norm / (||G_{t-1}|| + 1e-6)), the coefficient of torch's clip_grad_norm_ rule
applied with the previous step's global norm (fp64 sum of squares, rounded to fp32 as
`fsdp.clip_grad_norm_`); the first step of a run is not clipped (c_1 = 1). The previous norm is
saved in checkpoints, so a resumed run clips as the uninterrupted one. The logged gradient norm is
this step's true global norm ||G_t|| (before clipping), the same number the normal path logs.
Low-rank accumulators are used only with clipping off (``max_norm`` 0, GaLore's and the
benchmark's own setting): the norm of a sum kept as R = sum_k proj(G_k) is not known (only that
of the gradient its step consumes, back(R) + G_K), and under FSDP2 (full sharded accumulators) it
is the whole gradient's, so with clipping on every accumulator is full and the clipping norm is
the same number in one process, DDP and FSDP2. With clipping off the logged norm of a low-rank
accumulated matrix is that of back(R) + G_K.

Non-finite gradients: a parameter whose final gradient is not finite is not updated (its state is
untouched) and counted in `InBackward.skipped`; the others are. The trainer treats a step in which
no parameter was updated as a skipped step (nothing advances) and otherwise logs the count.

Several processes (the trainer sets these up; `Trainer._set_up_in_backward`):

* DDP (``dist.sharding=ddp``): the model is not wrapped in DDP, whose reducer would keep every
  gradient alive in its buckets; every rank starts from rank 0's weights (`broadcast_module_`,
  again for the factors a warm start's switch creates), accumulates its own micro-batches as
  above, and each final gradient is averaged over the ranks in its hook (`AllReduceMean`: G/N,
  then an all-reduce sum, as DDP's reducer does) before anything else reads it. The hooks fire in
  autograd's order, the same on every rank for the same graph; `check_same_order` verifies it
  after every step. One synchronous all-reduce per parameter (no bucketing, no overlap).
* FSDP2 (``dist.sharding=fsdp2``): FSDP2 calls the hooks itself on each sharded parameter right
  after its reduce-scatter (the averaged shard). This mode reduce-scatters on every micro-step, so
  the accumulators are shards (1/N of a full one) instead of FSDP2's unsharded accumulated
  gradients (no reduce-scatter until the last micro-step); the price is K reduce-scatters per
  step instead of one. Sharded matrices keep full (sharded) accumulators, never low-rank ones: the
  basis lives whole on one owner rank. Element-wise methods (and GaLore-8bit's rows of whole
  blocks) step their local shard; whole-matrix ones (projection, 8-bit, Adam-mini) step one
  parameter at a time through the owner ranks
  (optimizers/_owners.py), collectives that every rank enters for the same parameter in the same
  order (FSDP2 runs the hooks in its fixed parameter order). Each shard's squared norm is summed
  over the ranks in its hook (one scalar all-reduce), so every rank sees the whole gradient's
  norm and takes the same skip decision (a rank skipping a collective step alone would hang).
* The clip coefficient, the logged norm and the skip decision are the same numbers on every rank
  and in every launch mode. The one exception needs clipping off (no coefficient then): the
  logged norm of a low-rank accumulated matrix, ||back(R) + G_K||, depends on how the step's
  micro-batches are split (one process with K micro-batches of B N rows and N DDP ranks with K of
  B each agree; FSDP2, with full accumulators, logs the whole gradient's norm); the weights agree.

Bytes (per rank; s_g the gradient itemsize): the accumulators, sum over parameters of
s_g r max(m, n) (low rank) or s_g numel (full) while K > 1, plus the gradients in flight: the
largest step unit's final gradients plus the gradient autograd is producing (at most the two
largest parameters' gradients); see `effpretrain.memory`.

On CUDA:

* Streams. A unit steps on its hook's current stream, which the launch mode sets to the stream
  that produced the final gradient: autograd runs a post-accumulate-grad hook on the
  AccumulateGrad node's stream after that stream waited for the one that computed the gradient;
  FSDP2 calls the hooks inside ``torch.cuda.stream(post_reduce_stream)``, the stream of the
  reduce-scatter that wrote the shard (and records its post-reduce event after them, which the
  default stream waits for at the end of backward). PyTorch's kernels follow the current stream;
  bitsandbytes' (the 8-bit methods) launch on the legacy default stream whatever it is, and those
  methods order them with the hook's stream themselves (`optimizers._streams.ordered_on`: the
  legacy stream waits for the hook's stream, runs them, and the hook's stream waits for it before
  the gradient is freed or the next reduce-scatter starts).
* Time. `timer` puts a pair of timing events around each unit's step and reads them when asked
  (after one device synchronisation), so ``opt/step_s`` is the steps' device time, not their
  launch time, and timing adds no host synchronisation inside backward.
* Host reads. A step reads the device once per step unit (whether its final gradient is finite)
  and once in `finish` (the norm: the squares stay on the device and are summed there). The
  skip must be decided before the unit steps, and the one way to decide it on the device is a
  snapshot: copy the unit's parameter and state (p + s bytes) before the step and select them
  back (``torch.where`` on a device flag) where the gradient was not finite, which costs about
  5 (p + s) bytes of memory traffic per unit and step and p + s transient bytes (for llama_7b
  with galore_8bit in bf16 at least 67 GB per step, 5 p alone: tens of milliseconds at 1-3 TB/s;
  and the embedding's 262 MB at the peak); a read costs the GPU the time to launch the next
  kernel after the queue drained (tens of microseconds, about 290 per step at 7B; estimates,
  not yet measured on a GPU). The read is the cheaper, so it stays. Under FSDP2 it also waits for that unit's reduce-scatter. The
  projected and matrix methods read the device once more in each step
  (`optimizers._sharded.nonzero_flags`, the zero-gradient check a checkpoint loader's dummy step
  needs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from optimizers import FACTOR_PAIRS_KEY
from optimizers import projection as proj
from optimizers._sharded import local, sum_squares_fp64
from optimizers._streams import DeviceTimer
from optimizers.momentum_reset import unwrap_optimizer

__all__ = [
    "AllReduceMean",
    "InBackward",
    "broadcast_module_",
    "check_same_order",
    "clip_coefficient",
    "step_units",
]


def clip_coefficient(max_norm: float, norm: float | None) -> float:
    """min(1, max_norm / (norm + 1e-6)) in fp32 (torch's clip_grad_norm_ rule); 1 when clipping is
    off (max_norm <= 0) or no norm is known yet."""
    if max_norm <= 0 or norm is None:
        return 1.0
    total = torch.tensor(norm, dtype=torch.float32)
    return float(torch.clamp(max_norm / (total + 1e-6), max=1.0))


def step_units(opt: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The optimizer's step units among `params`: a (B, A) pair for each pair of a group with
    ``factor_pairs`` (consecutive parameters, as LORO lists them), one parameter otherwise."""
    wanted = {id(p) for p in params}
    units: list[list[torch.Tensor]] = []
    for group in unwrap_optimizer(opt).param_groups:
        ps = [p for p in group["params"] if id(p) in wanted]
        if group.get(FACTOR_PAIRS_KEY):
            units += [ps[i : i + 2] for i in range(0, len(ps), 2)]
        else:
            units += [[p] for p in ps]
    return units


class InBackward:
    """Steps the optimizer's units inside backward (see the module docstring for the rules).

    Args:
        params: the trainable parameters, in model order.
        optimizer: the run's optimizer (wrappers are followed to the one that owns the state;
            wrapper bookkeeping such as restarts runs at ``optimizer.step()`` after backward, which
            then finds no gradients).
        max_norm: clipping threshold (0: off).
        reduce: called with each final gradient before it is used (DDP's all-reduce and average),
            in the same parameter order on every rank.

    Attributes:
        prev_norm: the previous step's global gradient norm (None before the first step).
        order: this step's parameters (indices into `params`) in the order their gradients became
            final (the order of the `reduce` calls; `check_same_order`).
        skipped: parameters not updated in the last step (non-finite gradient).
        device: the parameters' (local) device, where the squares are summed.
        timer: the device time of the per-unit optimizer steps (`optimizers._streams.DeviceTimer`:
            timing events on CUDA, no host synchronisation per unit); the trainer hands its own.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        max_norm: float = 0.0,
        reduce: Callable[[torch.Tensor], None] | None = None,
        refresh_ahead: bool = False,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.refresh_ahead = refresh_ahead
        self.opt = unwrap_optimizer(optimizer)
        self.max_norm = float(max_norm)
        self.reduce = reduce
        self.prev_norm: float | None = None
        self.skipped = 0
        self.device = local(self.params[0]).device if self.params else torch.device("cpu")
        self.timer = DeviceTimer(self.device)
        self._group = {id(p): g for g in self.opt.param_groups for p in g["params"]}
        self._unit = {id(p): unit for unit in step_units(self.opt, self.params) for p in unit}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.order: list[int] = []
        self._acc: dict[int, tuple[torch.Tensor, torch.Tensor | None, str]] = {}
        self._final: dict[int, torch.Tensor] = {}
        self._squares: dict[int, torch.Tensor] = {}
        self._active = False
        self._last = True
        self._coef = 1.0
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def remove(self) -> None:
        """Removes the hooks (the model's trainable set changed, or the run ends)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- the step ---------------------------------------------------------------------------
    def begin_micro(self, k: int, num_micro: int) -> None:
        """Call before micro-batch `k` (0-based) of `num_micro`'s backward."""
        if k == 0:
            self._squares.clear()
            self.order = []
            self.skipped = 0
            self._coef = clip_coefficient(self.max_norm, self.prev_norm)
        self._active, self._last = True, k == num_micro - 1

    def finish(self) -> float:
        """Ends the step: the global norm of this step's final gradients, remembered for the next
        step's clipping (no collective: every parameter's squares are already whole, `_hook`)."""
        self._active = False
        if self._acc or self._final:
            raise RuntimeError(
                f"update_in_backward: {len(self._acc) + len(self._final)} gradients never became final "
                "(a parameter without a gradient in the last micro-batch, or a step unit left incomplete)"
            )
        norm = self._global_norm()
        if math.isfinite(norm):  # a non-finite step's norm would disable clipping for the next
            self.prev_norm = norm
        return norm

    def _global_norm(self) -> float:
        """sqrt(sum of this step's squares), the fp64 sum in model order (the same in every launch
        mode), added where the squares are: one host read for the step, not one per parameter."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params:
            sq = self._squares.get(id(p))
            if sq is not None:
                total += sq
        return float(total.sqrt().float())

    # -- the hook ---------------------------------------------------------------------------
    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        if not self._active or p.grad is None:
            return
        if not self._last:
            self._accumulate(p)
            return
        grad = self._final_grad(p)
        if self.reduce is not None:
            self.reduce(grad)
        self.order.append(self._index[id(p)])
        self._squares[id(p)] = _whole_squares(grad)
        self._final[id(p)] = grad
        p.grad = None
        unit = self._unit.get(id(p), [p])
        if all(id(q) in self._final for q in unit):
            self._step(unit)

    def _accumulate(self, p: torch.Tensor) -> None:
        g, key = p.grad, id(p)
        p.grad = None
        held = self._acc.get(key)
        if held is None:
            # Low rank only without clipping: the clipping norm must be the whole gradient's.
            target = getattr(self.opt, "accumulation_basis", None) if self.max_norm <= 0 else None
            found = target(p, self._group[key]) if target is not None else None
            if found is None and target is not None and self.refresh_ahead:
                found = self.opt.refresh_basis_ahead(p, self._group[key], g)
            if found is None:
                self._acc[key] = (g, None, "")  # autograd's fresh tensor becomes the accumulator
            else:
                basis, side = found
                self._acc[key] = (proj.project(g, basis, side), basis, side)
            return
        acc, basis, side = held
        if basis is None:
            acc.add_(g)
        else:
            acc.add_(proj.project(g, basis, side))

    def _final_grad(self, p: torch.Tensor) -> torch.Tensor:
        held = self._acc.pop(id(p), None)
        g = p.grad
        if held is None:
            return g
        acc, basis, side = held
        if basis is None:
            return acc.add_(g)  # acc + G_K: the order autograd's own accumulation adds in
        return g.add_(proj.project_back(acc, basis, side, m=p.shape[0]))

    def _step(self, unit: list[torch.Tensor]) -> None:
        grads = [self._final.pop(id(q)) for q in unit]
        squares = [self._squares[id(q)] for q in unit]
        # The one host read of a unit (module docstring, "On CUDA"): whether to step it at all.
        if not bool(torch.isfinite(squares[0] if len(unit) == 1 else torch.stack(squares)).all()):
            self.skipped += len(unit)
            return
        for q, g in zip(unit, grads):
            if self._coef != 1.0:
                g.mul_(self._coef)
            q.grad = g
        self.timer.start()
        try:
            self.opt.step()
        finally:
            self.timer.stop()
            for q in unit:
                q.grad = None

    @classmethod
    def for_run(
        cls, params: Iterable[torch.Tensor], optimizer: Any, train: Any, reduce: Any = None
    ) -> InBackward:
        """The engine a run's ``train`` section asks for: its clipping threshold and where a due
        basis refresh takes its gradient (``train.in_backward_refresh``)."""
        ahead = train.in_backward_refresh == "first_micro"
        return cls(params, optimizer, max_norm=train.grad_clip, reduce=reduce, refresh_ahead=ahead)

    def state_dict(self) -> dict[str, Any]:
        """What exact resume needs: the previous step's norm (the next step's clipping)."""
        return {"prev_norm": self.prev_norm}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.prev_norm = sd.get("prev_norm")


def _whole_squares(grad: torch.Tensor) -> torch.Tensor:
    """sum(G^2) in fp64 of a whole gradient: for an FSDP2 shard (DTensor) the ranks' partial sums
    are added (one all-reduce of a scalar), so that every rank sees the same number and takes
    the same skip decision (the whole-matrix steps are collectives: a rank that skipped alone
    would leave the others waiting)."""
    from torch.distributed.tensor import DTensor

    sq = sum_squares_fp64(local(grad))
    if isinstance(grad, DTensor):
        import torch.distributed as dist

        dist.all_reduce(sq, group=grad.device_mesh.get_group())
    return sq


class AllReduceMean:
    """`InBackward`'s ``reduce`` for data parallelism without a DDP wrapper: G <- sum_r (G_r / N)
    over the N ranks of `group` (an all-reduce per final gradient, called in the same order on
    every rank: hooks fire in autograd's order, the same for the same graph; `check_same_order`).

    The gradient is multiplied by 1/N before the sum, as DDP's reducer does on its buckets
    (``mul_out(bucket, grad, 1 / N)``, then SUM), so each averaged gradient is bitwise DDP's.
    """

    def __init__(self, world: int, group: Any = None) -> None:
        self.world, self.group = int(world), group

    def __call__(self, grad: torch.Tensor) -> None:
        import torch.distributed as dist

        grad.mul_(1.0 / self.world)
        dist.all_reduce(grad, group=self.group)


def check_same_order(order: list[int], device: torch.device, group: Any = None) -> None:
    """RuntimeError unless every rank reduced its gradients in the same order (one all-reduce of
    2 len(order) integers: a rank whose order differs would have averaged another parameter's
    gradient into its own)."""
    import torch.distributed as dist

    mine = torch.tensor(order, dtype=torch.int64, device=device)
    both = torch.cat([mine, -mine])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, lo = both[: len(order)], -both[len(order) :]
    if not torch.equal(hi, lo):
        raise RuntimeError(
            "update_in_backward: the ranks' gradients became final in different orders "
            "(a graph that differs between ranks); their all-reduces paired different parameters"
        )


@torch.no_grad()
def broadcast_module_(module: torch.nn.Module, src: int = 0, group: Any = None) -> None:
    """Every parameter and buffer of `module` set to rank `src`'s (as DDP does when it wraps a
    module): replicas that start equal and apply the same averaged gradients stay equal."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for t in [*module.parameters(), *module.buffers()]:
        if is_traceable_wrapper_subclass(t):  # an INT8 weight: its codes and scales, as they are
            for name in t.__tensor_flatten__()[0]:
                dist.broadcast(getattr(t, name), src=src, group=group)
        else:
            dist.broadcast(t.data, src=src, group=group)
