"""The training objective: summed next-token cross-entropy and its target count.

Three ways to compute the same number (`train.loss`):

- ``standard``: the model's LM head writes the (N, V) logits of all N = B T positions, and
  `F.cross_entropy` takes their fp32 log-softmax (saved for backward). At N = 8,192 tokens and a
  vocabulary of V = 32,000 that is about 1 GB per (N, V) fp32 block, three of them at once in the
  backward.
- ``chunked`` (the default): a linear cross-entropy (`linear_cross_entropy`) takes the final
  hidden states H (N, h) and the head's weight W (V, h) and never holds the (N, V) logits. Rows
  are processed C (`train.loss_chunk_tokens`) at a time: Z_c = H_c W^T (fp32), the per-row
  logsumexp l_i = m_i + log sum_v exp(Z_iv - m_i) (m_i = max_v Z_iv), the loss
  S = sum_i (l_i - Z_{i,y_i}) over the rows whose label is not IGNORE_INDEX. While the chunk's
  block is alive it becomes dS/dZ_c = softmax(Z_c) - onehot(y_c), and dH_c = dS/dZ_c W,
  dW += (dS/dZ_c)^T H_c, as fused linear cross-entropy kernels (Liger's) do; dH (N, h) and dW
  (V, h), fp32, are saved, and the backward multiplies them by the incoming gradient g. Three
  products with the head, as the standard loss's forward and backward.
- ``chunked_recompute``: the same forward saving only l (N fp32 values) beside H, W and the
  labels, which are alive anyway; the backward recomputes each chunk's Z_c and uses
  dS/dZ_iv = g (exp(Z_iv - l_i) - [v = y_i]). A fourth head product, for 4 N bytes instead of
  dH + dW between forward and backward. The issue that asked for the chunked loss suggested this
  recompute; it is not the default because it measured 0.84x (0.91x in an earlier run) the
  standard loss's tokens/s on a llama_20m fp32 run on this project's CPU, where the
  gradients-in-forward form measured 1.03x (benchmarks/results/chunked_loss.json).

Both chunked forms, without a gradient to compute (no-grad evaluation), compute S alone. Their
bytes are `loss_bytes`: the transient of either is about one (C, V) fp32 block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Literal

import torch
import torch.nn.functional as F

from effpretrain.data import IGNORE_INDEX
from effpretrain.errors import ConfigError

LossKind = Literal["standard", "chunked", "chunked_recompute"]
#: Rows per chunk of the chunked loss unless told (`train.loss_chunk_tokens`).
DEFAULT_CHUNK_TOKENS = 1024
#: The fewest vocabulary rows per block of a lower-precision dW product (`dw_block_rows`).
DW_BLOCK_ROWS = 4096

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "LossKind",
    "linear_cross_entropy",
    "loss_bytes",
    "token_loss_sum",
]


def _compute_dtype(h: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype the head's product runs in: autocast's if it is on (as F.linear would), else
    the operands' common dtype."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, w.dtype)


def _chunk_logits(h: torch.Tensor, wc: torch.Tensor, rows: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Z_c = H[rows] W^T as a fresh fp32 (C, V) block (the product in `dt`, as the head's)."""
    z = torch.mm(h.index_select(0, rows).to(dt), wc.t())
    return z if z.dtype == torch.float32 else z.float()


def _chunk_softmax_(z: torch.Tensor, y: torch.Tensor, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Turns the fp32 logits block Z_c into exp(Z_c - max), and into softmax(Z_c) if `normalize`,
    in place; returns (logsumexp_v Z_iv, Z_{i,y_i})."""
    target = z.gather(1, y.unsqueeze(1)).squeeze(1)
    m = z.amax(1, keepdim=True)
    # In place: the chunk holds one (C, V) block, never a second for exp(Z - m).
    se = z.sub_(m).exp_().sum(1, keepdim=True)
    if normalize:
        z.div_(se)
    return se.squeeze(1).log_().add_(m.squeeze(1)), target


def dw_block_rows(chunk_tokens: int, vocab: int) -> int:
    """B, the vocabulary rows per block of a lower-precision dW product: the chunk's rows, at least
    `DW_BLOCK_ROWS` (fewer, larger products), at most V."""
    return min(max(chunk_tokens, DW_BLOCK_ROWS), vocab)


def _add_weight_grad_(gw: torch.Tensor, dz: torch.Tensor, hc: torch.Tensor, chunk: int) -> None:
    """dW += dZ_c^T H_c into the fp32 accumulator `gw`: one ``addmm_`` for fp32 operands; for a
    product in a lower precision, B = `dw_block_rows` vocabulary rows at a time, so that the
    product (at dZ's dtype) and its fp32 copy are (B, h) temporaries instead of (V, h) ones (at a
    128k vocabulary and h = 4096 in bf16: 100 MB for 4,096 rows instead of 3.2 GB)."""
    if dz.dtype == torch.float32:
        gw.addmm_(dz.t(), hc)
        return
    rows = dw_block_rows(chunk, gw.shape[0])
    for v0 in range(0, gw.shape[0], rows):
        gw[v0 : v0 + rows] += torch.mm(dz[:, v0 : v0 + rows].t(), hc).float()


def _chunked_loss_and_grads(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunk: int, ignore_index: int, need: tuple
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """S and, where `need` = (need_h, need_w) asks, dS/dH (H's dtype) and dS/dW (fp32), chunk by chunk.

    Per chunk of C labelled rows: Z_c = H_c W^T (fp32), P_c = softmax(Z_c) (in place in Z_c's block),
    S += sum_i logsumexp(Z_i) - Z_{i,y_i}; with a gradient, dZ_c = P_c - onehot(y_c) (in place again),
    dH_c = dZ_c W and dW += dZ_c^T H_c: three head products per chunk, as the standard loss's
    forward and backward make over all rows.
    """
    dt = _compute_dtype(h, w)
    need_h, need_w = need
    with torch.autocast(h.device.type, enabled=False):
        rows_all = (labels != ignore_index).nonzero().squeeze(1)
        wc = w.to(dt)
        gh = torch.zeros_like(h) if need_h else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for c0 in range(0, rows_all.numel(), chunk):
            rows = rows_all[c0 : c0 + chunk]
            y = labels[rows]
            hc = h.index_select(0, rows).to(dt)
            z = torch.mm(hc, wc.t())
            z = z if z.dtype == torch.float32 else z.float()
            lse_c, target = _chunk_softmax_(z, y, need_h or need_w)
            total += (lse_c - target).sum()
            if need_h or need_w:
                z[torch.arange(rows.numel(), device=z.device), y] -= 1.0
                dzc = z if dt == torch.float32 else z.to(dt)
                if need_h:
                    gh.index_copy_(0, rows, torch.mm(dzc, wc).to(gh.dtype))
                if need_w:
                    _add_weight_grad_(gw, dzc, hc, chunk)
                del dzc
            del z, hc
    return total, gh, gw


class _ChunkedLinearCE(torch.autograd.Function):
    """S = sum over labelled rows of logsumexp(H_i W^T) - (H_i W^T)_{y_i}; dS/dH and dS/dW are
    computed in the forward (`_chunked_loss_and_grads`) and saved, and the backward only scales
    them by the incoming gradient g: dH = g dS/dH, dW = g dS/dW (as fused linear cross-entropy
    kernels do). The backward scales the saved tensors in place, so a second backward through the
    same graph (retain_graph) fails autograd's version check instead of scaling twice."""

    @staticmethod
    def forward(ctx, h, w, labels, chunk: int, ignore_index: int):  # noqa: ANN001, ANN205
        need = (h.requires_grad, w.requires_grad)
        total, gh, gw = _chunked_loss_and_grads(h, w, labels, chunk, ignore_index, need)
        ctx.save_for_backward(gh, gw)
        ctx.w_dtype = w.dtype
        return total

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        gh, gw = ctx.saved_tensors
        if gh is not None:
            gh = gh.mul_(g.to(gh.dtype))
        if gw is not None:
            gw = gw.mul_(g.float()).to(ctx.w_dtype)
        return gh, gw, None, None, None


class _RecomputeLinearCE(torch.autograd.Function):
    """The same S, saving only one fp32 logsumexp per row: the backward recomputes each chunk's
    logits, dZ_c = g (exp(Z_c - lse_c) - onehot(y_c)), dH_c = dZ_c W and dW += dZ_c^T H_c (a
    fourth head product, the price of not holding dH and dW between forward and backward)."""

    @staticmethod
    def forward(ctx, h, w, labels, chunk: int, ignore_index: int):  # noqa: ANN001, ANN205
        dt = _compute_dtype(h, w)
        with torch.autocast(h.device.type, enabled=False):
            rows_all = (labels != ignore_index).nonzero().squeeze(1)
            wc = w.to(dt)
            lse = torch.zeros(labels.shape[0], dtype=torch.float32, device=h.device)
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for c0 in range(0, rows_all.numel(), chunk):
                rows = rows_all[c0 : c0 + chunk]
                z = _chunk_logits(h, wc, rows, dt)
                target = z.gather(1, labels[rows].unsqueeze(1)).squeeze(1)
                m = z.amax(1, keepdim=True)
                # In place: the chunk holds one (C, V) block, never a second for exp(Z - m).
                lse_c = z.sub_(m).exp_().sum(1).log_().add_(m.squeeze(1))
                lse.index_copy_(0, rows, lse_c)
                total += (lse_c - target).sum()
                del z
        ctx.save_for_backward(h, w, labels, lse)
        ctx.chunk, ctx.ignore_index, ctx.dt = chunk, ignore_index, dt
        return total

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        h, w, labels, lse = ctx.saved_tensors
        dt, chunk = ctx.dt, ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(h.device.type, enabled=False):
            rows_all = (labels != ctx.ignore_index).nonzero().squeeze(1)
            wc = w.to(dt)
            gh = torch.zeros_like(h) if need_h else None
            gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
            for c0 in range(0, rows_all.numel(), chunk):
                rows = rows_all[c0 : c0 + chunk]
                # dZ = g (softmax(Z) - onehot(y)), built in place in the recomputed logits.
                dz = _chunk_logits(h, wc, rows, dt).sub_(lse[rows].unsqueeze(1)).exp_()
                dz[torch.arange(rows.numel(), device=dz.device), labels[rows]] -= 1.0
                dz.mul_(g.float())
                dzc = dz if dt == torch.float32 else dz.to(dt)
                if need_h:
                    gh.index_copy_(0, rows, torch.mm(dzc, wc).to(gh.dtype))
                if need_w:
                    _add_weight_grad_(gw, dzc, h.index_select(0, rows).to(dt), chunk)
                del dz, dzc
        return gh, (gw.to(w.dtype) if need_w else None), None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    kind: LossKind = "chunked",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Summed cross-entropy of the logits Z = H W^T against `labels` (fp32 reduction).

    S = sum_{i: y_i != ignore_index} (logsumexp_v Z_iv - Z_{i,y_i}). ``standard`` materialises Z and
    calls `F.cross_entropy`; ``chunked`` and ``chunked_recompute`` never hold more than
    `chunk_tokens` rows of Z (module docstring), with the same value and gradients up to fp32
    summation order. Without a gradient to compute (no-grad mode, as in evaluation, or neither H
    nor W requiring one) both chunked kinds compute the loss alone.

    Args:
        hidden: H, (N, h) final hidden states.
        weight: W, (V, h) LM-head weight (no bias).
        labels: (N,) target ids, `ignore_index` where a row has no target.
        kind: ``standard``, ``chunked`` or ``chunked_recompute``.
        chunk_tokens: C, rows per chunk (chunked kinds only).
        ignore_index: the label of rows that contribute nothing.
    """
    if kind == "standard":
        logits = F.linear(hidden, weight)
        return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")
    if kind not in ("chunked", "chunked_recompute"):
        raise ValueError(f"unknown loss kind {kind!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return _chunked_loss_and_grads(hidden, weight, labels, chunk_tokens, ignore_index, (False, False))[0]
    fn = _ChunkedLinearCE if kind == "chunked" else _RecomputeLinearCE
    return fn.apply(hidden, weight, labels, chunk_tokens, ignore_index)


def _lm_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The model's own output projection, through DDP (`.module`) or similar wrappers."""
    inner = model
    while not hasattr(inner, "get_output_embeddings") and hasattr(inner, "module"):
        inner = inner.module
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise ConfigError(
            f"train.loss=chunked* needs a bias-free linear LM head; {type(inner).__name__} has "
            f"{type(head).__name__}"
        )
    return head


@contextlib.contextmanager
def _head_returns_loss(
    model: torch.nn.Module, labels: torch.Tensor, kind: LossKind, chunk_tokens: int
) -> Iterator[None]:
    """While active, the LM head's forward returns the chunked loss sum instead of logits.

    The model is still called whole (through its DDP or FSDP2 wrapper, so their hooks fire), and
    the head's weight is read inside that forward, where FSDP2 has it unsharded.
    """
    head = _lm_head(model)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.size(-1))
        return linear_cross_entropy(h, head.weight, labels, kind, chunk_tokens)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # the class's forward again


def token_loss_sum(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    packed: bool | None = None,
    loss: LossKind = "standard",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token cross-entropies over the batch's targets (fp32), and their count.

    With logits z and targets y_{t+1} (positions whose label is IGNORE_INDEX left out), the sum is
    S = sum_t -log softmax(z_t)[y_{t+1}]; the trainer divides the global S by the global count.
    The count is a tensor, so that no device sync is forced.

    Args:
        model: a causal LM returning `.logits` (possibly DDP- or FSDP2-wrapped).
        batch: `input_ids`, `attention_mask` and `labels` of shape (B, T).
        packed: every position is real, so SDPA takes its causal fast path without a mask; None
            checks the mask, which costs a device sync on GPU.
        loss: ``standard`` (the model's logits), or ``chunked`` / ``chunked_recompute``
            (`linear_cross_entropy` on the final hidden states inside the model's forward; the
            logits are never formed).
        chunk_tokens: rows per chunk of the chunked loss.
    """
    mask = batch["attention_mask"]
    if packed is None:
        packed = bool(mask.all())
    attn = None if packed else mask
    # Shift the labels, not the logits: a sliced (B, T-1, V) view would cost a full copy of the logits.
    labels = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    count = (labels != IGNORE_INDEX).sum()
    if loss != "standard":
        with _head_returns_loss(model, labels.reshape(-1), loss, chunk_tokens):
            return model(input_ids=batch["input_ids"], attention_mask=attn).logits, count
    logits = model(input_ids=batch["input_ids"], attention_mask=attn).logits
    s = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return s, count


def loss_bytes(
    kind: LossKind,
    tokens: int,
    vocab: int,
    hidden: int,
    act_dtype: torch.dtype = torch.float32,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    targets: int | None = None,
    param_dtype: torch.dtype = torch.float32,
) -> dict[str, int]:
    """Bytes the loss itself holds over one forward and backward (what `measure_loss_bytes`
    measures): H (N, h) and W (V, h) are `param_dtype` (the final norm's output and the head
    weight: fp32 in an fp32 or bf16-mixed run, bf16 in a bf16-pure one), the product runs in
    `act_dtype` (e bytes an element).

    With N tokens, t = `targets` labelled rows (default N), V vocabulary, h hidden,
    C = min(chunk_tokens, t) (the chunked kinds compute only labelled rows), x = 1 if e < 4
    else 0, and y = 1 if H and W are fp32 (a lower-precision product then works on copies) else 0.
    The formulas below are for y = 1; with y = 0 (bf16-pure) no copy of H or W is made (the
    ``y e ...`` copy terms vanish), dH is held at e (e N h instead of 4 N h), and returning dW at
    W's dtype makes an e V h cast of the fp32 accumulator at the end of the backward (``chunked``:
    the backward's transient; ``chunked_recompute``: a third candidate, 4 V h + e N h + e V h):

    - standard: saved = 4 N V (fp32 log-softmax) + x e (N h + V h) (autocast's copies of H and W,
      saved by the product) + 4; forward peak = saved + e N V (logits) + 4 x N V (their fp32 copy);
      backward peak = saved + 8 N V (the gradients of the log-softmax's output and input);
      transient = max(forward, backward) peak - saved.
    - chunked (gradients in the forward): saved = 4 N h (dH, H's fp32) + 4 V h (dW, fp32), held
      from the forward to the backward, which scales them in place into the gradients (nothing
      more); transient = 4 C V (the chunk's logits, then softmax, then dZ, in one block) + 8 t (row
      index) + (1 - x) 8 C h (H_c and dH_c) + x (e C V (dZ_c in e) + e V h (W in e) + (e + 4) B h
      (a block of B = `dw_block_rows` rows of the chunk's dW product and its fp32 copy) +
      e C h (H_c in e)).
    - chunked_recompute: saved = 4 N (one logsumexp a token; H, W and the labels are alive anyway);
      forward = 4 C V + x (e C V + e V h) + 8 N (row index) + (4 + e x) C h;
      backward = 4 C V + x (e C V + e V h + (e + 4) B h) + 4 V h (dW, fp32) + 4 N h (dH) + 8 N
      + 8 C h; transient = max(forward, backward).

    Returns:
        ``saved``, the ``forward`` and ``backward`` transients, ``transient`` = the larger of
        the two, and ``peak`` = saved + transient (bytes).
    """
    n, v, h = tokens, vocab, hidden
    e = torch.empty((), dtype=act_dtype).element_size()
    x = int(e < 4)
    y = int(param_dtype == torch.float32)
    gh = 4 if y else e  # dH, allocated like H
    t = n if targets is None else targets
    c = min(chunk_tokens, t)
    b = dw_block_rows(chunk_tokens, v)  # vocabulary rows per block of a lower-precision dW product
    if kind == "standard":
        saved = 4 * n * v + x * y * e * (n * h + v * h) + 4
        forward, backward = e * n * v + 4 * x * n * v + 4, 8 * n * v + 4
    elif kind == "chunked":
        saved = gh * n * h + 4 * v * h
        forward = 4 * c * v + 8 * t + (1 - x) * 8 * c * h
        forward += x * (e * c * v + y * e * v * h + (e + 4) * b * h + e * c * h)
        backward = (1 - y) * e * v * h
    elif kind == "chunked_recompute":
        saved = 4 * n
        forward = 4 * c * v + x * e * (c * v + y * v * h) + 8 * n + (4 + e * x) * c * h
        backward = 4 * c * v + x * (e * c * v + y * e * v * h + (e + 4) * b * h) + 4 * v * h + gh * n * h
        backward = max(backward + 8 * n + 8 * c * h, (1 - y) * (4 * v * h + gh * n * h + e * v * h))
    else:
        raise ValueError(f"unknown loss kind {kind!r}")
    transient = max(forward, backward)
    return {
        "saved": saved,
        "forward": forward,
        "backward": backward,
        "transient": transient,
        "peak": saved + transient,
    }
