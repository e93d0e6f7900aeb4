"""Activations: what autograd saves per block as HF LLaMA and the factorized layers save it, what the loss saves, and checkpointing."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from effpretrain.loss import DEFAULT_CHUNK_TOKENS
from effpretrain.loss import loss_bytes as own_terms
from effpretrain.memory.terms import ParamShape, _layer_of, precision
from effpretrain.models.factorized import FactorSpec
from effpretrain.models.llama import ModelShape, resolve_shape


@dataclass(frozen=True)
class SavedBytes:
    """Bytes a decoder block of the LLaMA family (HF's LlamaDecoderLayer and its Mistral, Qwen2
    and Qwen3 kin; SDPA, SiLU MLP, RMSNorm) saves for backward per token, by precision:
    ``norm_h`` per hidden unit for its two RMSNorms, ``cast_h`` per hidden unit for autocast's
    casts of the linears' inputs, ``attn`` per element of SDPA's q and k (after RoPE), v and
    output (2 q_width + 2 kv_width), ``mlp_i`` per intermediate unit, ``qk_norm`` per element of q
    and k for Qwen3's per-head norms, ``final_norm_h`` for the final RMSNorm (whose output the head
    reads), ``residual`` the residual stream's itemsize, ``weight_cast`` the bytes per element of
    each linear weight's autocast copy (0 without autocast).

    fp32 (measured with `saved_tensor_bytes`, exact): each RMSNorm saves its input x, x rsqrt(.)
    and its output (2 x 3 h x 4 B); SDPA saves q and k after RoPE, v and its output (that output is
    already laid out as o_proj's input, one storage), 4 B each; the MLP saves the gate, its SiLU,
    up and their product (4 i x 4 B); a per-head q/k norm saves its input and x rsqrt(.) (8 B; its
    output goes into RoPE, which saves only the tables). bf16-pure: a norm keeps x in fp32 (4 B),
    x rsqrt(.) cast back (2 B) and its output (2 B): 2 x 8; q/k norms 4 + 2. bf16-mixed: the
    residual stream stays fp32; a norm saves x and x rsqrt(.) (8 B) while each linear saves its own
    bf16 cast of its input (q, k, v: three of the first norm's output, gate and up: two of the
    second's): 16 + 10, the final norm 8 + the head's cast 2, and autocast keeps a bf16 copy of every
    linear weight until backward. Every precision adds per block two fp32 rsqrt per token and
    SDPA's fp32 logsumexp per head, and with q/k norms one fp32 rsqrt per head of q and of k.
    Biases (Qwen2's q/k/v) save nothing; grouped-query attention's k and v are saved at the KV
    width (SDPA's own GQA, no repeated copies).
    """

    norm_h: int
    cast_h: int
    attn: int
    mlp_i: int
    qk_norm: int
    final_norm_h: int
    residual: int
    weight_cast: int

    def block(self, shape: ModelShape) -> int:
        """A full block's saved bytes per token (its linears' weight copies apart)."""
        s = shape
        qk = (self.qk_norm * (s.q_width + s.kv_width) + 4 * (s.heads + s.kv)) if s.qk_norm else 0
        attention = self.attn * 2 * (s.q_width + s.kv_width)
        return (
            (self.norm_h + self.cast_h) * s.hidden
            + attention
            + self.mlp_i * s.intermediate
            + 8
            + 4 * s.heads
            + qk
        )


SAVED_BYTES: dict[str, SavedBytes] = {
    "fp32": SavedBytes(24, 0, 4, 16, 8, 12, 4, 0),
    "bf16-mixed": SavedBytes(16, 10, 2, 8, 6, 10, 4, 2),
    "bf16-pure": SavedBytes(16, 0, 2, 8, 6, 8, 2, 0),
}


@dataclass(frozen=True)
class LossBytes:
    """The loss's memory (bytes): `saved` for backward (part of the activations), `forward` live
    beside the activations at the end of the forward, `backward` live beside them while the
    loss's backward runs."""

    saved: int
    forward: int
    backward: int


def loss_bytes(
    kind: str,
    tokens: int,
    vocab: int,
    hidden: int,
    act: torch.dtype,
    chunk: int = DEFAULT_CHUNK_TOKENS,
    params: torch.dtype = torch.float32,
) -> LossBytes:
    """Memory of the training loss over `tokens` rows (N) of vocabulary V at activation dtype e.

    ``standard``: the (N, V) logits at e, an fp32 copy when e is not fp32, the fp32 log-softmax
    saved for backward (4 N V) with the labels (8 N) and the reduction's weight (4); its backward
    holds the NLL's (N, V) gradient and the log-softmax's input gradient (2 x 4 N V) beside the
    saved log-softmax (the cast of that gradient back to e comes after both are freed).
    The chunked kinds (never the (N, V) logits) take their terms from `effpretrain.loss.loss_bytes`,
    the formula their own tests check against a measurement: ``saved`` is what they hold from the
    forward to the backward (``chunked``: dH and dW, 4 N h + 4 V h; ``chunked_recompute``: one fp32
    logsumexp a token), and their transient lives while the loss runs: in the forward for
    ``chunked`` (its backward scales dH and dW in place, and in a bf16-pure run casts dW to the
    weight's dtype: its backward term), in both for ``chunked_recompute``.
    The shifted labels (8 N) live during the forward.
    """
    N, V, e = tokens, vocab, act.itemsize
    if kind == "standard":
        return LossBytes(4 * N * V + 8 * N + 4, N * V * e + (4 * N * V if e != 4 else 0), 8 * N * V)

    terms = own_terms(kind, N, V, hidden, act, chunk, param_dtype=params)  # ValueError: unknown kind
    if kind == "chunked_recompute":
        return LossBytes(terms["saved"], terms["transient"] + 8 * N, terms["transient"])
    return LossBytes(terms["saved"], terms["forward"] + 8 * N, terms["backward"])


@dataclass(frozen=True)
class Activations:
    """Saved-for-backward bytes of one micro-batch, by part (see `activation_terms`)."""

    blocks: tuple[int, ...]  # what each decoder block keeps until its backward
    block_full: int  # one block's full saved set (a checkpointed block's recompute)
    base: int  # token ids, RoPE tables, final norm, autocast weight copies
    loss: LossBytes

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.base + self.loss.saved


def activation_terms(
    preset: str | ModelShape,
    vocab_size: int | None,
    batch_size: int,
    seq_len: int,
    checkpointed: Collection[int],
    dtype: str,
    *,
    rank_inputs: int = 0,
    rank: int = 0,
    linear_weights: tuple[int, int] = (0, 0),
    loss: str = "standard",
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Activations:
    """The saved activations of one micro-batch of N = `batch_size` x `seq_len` tokens.

    A full block saves ``N SavedBytes.block(shape) + rank_inputs N r e`` bytes (`rank_inputs`: the N x r tensors the factorized layers of a block save, at the
    activation itemsize e: `FactorSpec.rank_saves` per layer); a checkpointed block (in `checkpointed`) keeps only its input
    (``N h`` at the residual itemsize). The base: token ids (8 N), the RoPE cos/sin tables
    (2 T head_dim at the residual itemsize, saved once unless every block is checkpointed), the final
    norm (``final_norm_h N h + 4 N``) and, under autocast, the bf16 copy of the head's weight;
    under autocast a full block also saves the bf16 copies of its linear weights (a checkpointed
    block casts them again in its recompute). `linear_weights`: (elements of one block's linear
    weights, of the head's). The loss's part is `loss_bytes`.
    """
    p, sb, e = resolve_shape(preset), SAVED_BYTES[dtype], precision(dtype).activations.itemsize
    V, N = vocab_size or p.vocab, batch_size * seq_len
    full = N * sb.block(p) + rank_inputs * N * rank * e + sb.weight_cast * linear_weights[0]
    blocks = tuple(N * p.hidden * sb.residual if i in checkpointed else full for i in range(p.layers))
    rope = 0 if all(i in checkpointed for i in range(p.layers)) else 2 * seq_len * p.dim * sb.residual
    base = 8 * N + rope + N * (sb.final_norm_h * p.hidden + 4) + sb.weight_cast * linear_weights[1]
    prec = precision(dtype)
    lb = loss_bytes(loss, N, V, p.hidden, prec.activations, loss_chunk_tokens, prec.params)
    if loss == "chunked":
        # The head's product does not run through autograd: nothing saves the final norm's output
        # (as the head's input, e N h) nor autocast's copy of the head's weight.
        base -= N * p.hidden * e + sb.weight_cast * linear_weights[1]
    return Activations(blocks, full, base, lb)


def checkpointed_layers(spec: int | Collection[int], layers: int) -> frozenset[int]:
    """The decoder layers checkpointed by `spec`: an int k, every k-th layer from layer 0 (0: none),
    or the layer indices themselves."""
    if isinstance(spec, int):
        return frozenset(range(0, layers, spec)) if spec > 0 else frozenset()
    return frozenset(spec)


def activation_bytes(
    preset: str | ModelShape,
    vocab_size: int | None,
    batch_size: int,
    seq_len: int,
    activation_checkpointing: int | Collection[int],
    dtype: str,
) -> int:
    """Saved activations of one micro-batch of a dense model with the standard loss
    (`activation_terms`)."""
    ck = checkpointed_layers(activation_checkpointing, resolve_shape(preset).layers)
    return activation_terms(preset, vocab_size, batch_size, seq_len, ck, dtype).total


def _linear_elements(
    shapes: Iterable[ParamShape], factor: FactorSpec | None, targets: Sequence[str], rank: int, density: float
) -> tuple[int, int]:
    """Elements of one decoder block's linear weights (a factorized target's factors, sparse values
    and frozen W0) and of the head's: what autocast casts to bf16 in a forward."""
    block = head = 0
    for s in shapes:
        if s.linear is None or _layer_of(s.name) not in (0, None):
            continue
        n = math.prod(s.shape)
        if factor is not None and s.linear in targets:
            counts = factor.param_counts(*s.shape, rank, density)
            n = counts["trainable"] + counts["frozen"]
        if _layer_of(s.name) == 0:
            block += n
        else:
            head += n
    return block, head
