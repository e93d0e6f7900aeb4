"""Training FLOPs per token of a model's matrix multiplies (the leaderboard's column), and model
FLOPs utilisation (MFU): achieved model FLOP/s over the devices' peak dense bf16 FLOP/s."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from effpretrain.config import ATTN_MLP_TARGETS, RunConfig
from effpretrain.memory import model_param_shapes
from effpretrain.models.factorized import factor_spec
from effpretrain.models.llama import ModelShape, model_shape, resolve_shape


def flops_per_token(
    preset: str | ModelShape,
    vocab_size: int,
    seq_len: int,
    factor_kind: str = "none",
    factor_rank: int = 128,
    *,
    factor_targets: Sequence[str] | None = None,
    tokens_per_step: int | None = None,
) -> float:
    """Training FLOPs per token (forward + backward) of a model's matrix multiplies (a
    preset's name or any `ModelShape`).

    Counted per token, 2 FLOPs per multiply-add:

    - a trainable dense m x n linear: 6 m n (forward 2 m n, input gradient 2 m n, weight
      gradient 2 m n); the lm_head likewise 6 V h; the embedding lookup 0;
    - a tied head (the embedding's matrix) likewise 6 V h: the matrix is one parameter, the
      product is still made;
    - attention scores and the weighted sum of values: 12 L q T per token for sequence length T and
      query width q = heads x head_dim (PaLM's count, h for the LLaMA presets; the causal mask is
      not exploited; grouped-query attention's narrower k and v do not change it);
    - a factorized target (`factor_kind`, on the linears named in `factor_targets`): its
      `FactorSpec.flops_per_token` (Low-Rank 6 r (m + n); a frozen W0 adds 4 m n; SLTrain as
      implemented 6 m n plus the once-per-step B A product and its backward, 6 m n r, spread over
      `tokens_per_step` when given); the sparse scatter is not counted.

    Norms, activations, softmax, the loss and the optimizer (including basis refreshes) are not
    counted: the optimizer's cost is reported as time instead.

    Raises:
        ValueError: `factor_kind` is neither ``"none"`` nor a registered factor kind.
    """
    spec = factor_spec(factor_kind) if factor_kind != "none" else None
    targets = set(factor_targets or ATTN_MLP_TARGETS)
    p = resolve_shape(preset)
    total = 12.0 * p.layers * p.q_width * seq_len
    if p.tied:
        total += 6 * vocab_size * p.hidden
    for s in model_param_shapes(p, vocab_size):
        if s.linear is None:  # norms, and the embedding (a lookup)
            continue
        m, n = s.shape
        if spec is not None and s.linear in targets:
            total += spec.flops_per_token(m, n, factor_rank, tokens_per_step)
        else:
            total += 6 * m * n
    return total


# ----------------------------------------------------------------------------------------------
# MFU: achieved model FLOP/s over the device's peak dense bf16 tensor FLOP/s.


@dataclass(frozen=True)
class DevicePeak:
    """A device's peak dense bf16 FLOP/s (no structured sparsity; fp32 accumulation where the
    sheet gives two figures), matched by a regular expression on `torch.cuda.get_device_name`."""

    pattern: str
    flops: float
    source: str


#: Peak dense bf16 FLOP/s by device name. The first pattern that matches wins, so a variant
#: (H100 PCIe) comes before its family's default (H100 SXM). Data sheets quote the sparse figure
#: first; the dense one is half of it.
DEVICE_PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak(r"\bH200 NVL\b", 835e12, "NVIDIA H200 NVL data sheet: BF16 1,671 TFLOPS with sparsity"),
    DevicePeak(r"\bH200\b", 989e12, "NVIDIA H200 SXM data sheet: BF16 1,979 TFLOPS with sparsity"),
    DevicePeak(r"\bH100 PCIe\b", 756e12, "NVIDIA H100 PCIe data sheet: BF16 1,513 TFLOPS with sparsity"),
    DevicePeak(r"\bH100 NVL\b", 835e12, "NVIDIA H100 NVL data sheet: BF16 1,671 TFLOPS with sparsity"),
    DevicePeak(
        r"\b(H100|H800|GH200)\b", 989e12, "NVIDIA H100 SXM data sheet: BF16 1,979 TFLOPS with sparsity"
    ),
    DevicePeak(
        r"\bB200\b", 2250e12, "NVIDIA HGX B200 data sheet: FP16/BF16 4.5 PFLOPS per GPU with sparsity"
    ),
    DevicePeak(r"\b(A100|A800)\b", 312e12, "NVIDIA A100 data sheet: BF16 312 TFLOPS (624 with sparsity)"),
    DevicePeak(r"\bL40S\b", 362.05e12, "NVIDIA L40S data sheet: BF16 733 TFLOPS with sparsity"),
    DevicePeak(r"\bL40\b", 181.05e12, "NVIDIA L40 data sheet: BF16 362.1 TFLOPS with sparsity"),
    DevicePeak(r"\bL4\b", 121e12, "NVIDIA L4 data sheet: BF16 242 TFLOPS with sparsity"),
    DevicePeak(r"\bA10\b", 125e12, "NVIDIA A10 data sheet: BF16 125 TFLOPS (250 with sparsity)"),
    DevicePeak(
        r"\bRTX 6000 Ada\b", 364.2e12, "NVIDIA Ada Lovelace architecture whitepaper: BF16, FP32 accumulate"
    ),
    DevicePeak(r"\bRTX A6000\b", 154.8e12, "NVIDIA RTX A6000 data sheet: tensor 309.7 TFLOPS with sparsity"),
    DevicePeak(
        r"\bRTX 4090\b", 165.2e12, "NVIDIA Ada Lovelace architecture whitepaper: BF16, FP32 accumulate"
    ),
    DevicePeak(r"\bRTX 3090\b", 71e12, "NVIDIA Ampere GA102 whitepaper: BF16, FP32 accumulate"),
    DevicePeak(r"\bMI300X\b", 1307.4e12, "AMD Instinct MI300X data sheet: BF16 1,307.4 TFLOPS dense"),
)


def device_peak(name: str) -> DevicePeak | None:
    """The table's entry for a device name (`torch.cuda.get_device_name`), None when unknown."""
    return next((d for d in DEVICE_PEAKS if re.search(d.pattern, name)), None)


def peak_flops(device: torch.device, peak_tflops: float | None = None) -> tuple[float | None, str]:
    """The peak dense bf16 FLOP/s that MFU divides by, and where it came from.

    `peak_tflops` (`train.peak_tflops`) wins; else a CUDA device is looked up by name in
    `DEVICE_PEAKS`. A CPU or an unknown device has no peak (None): MFU is then null, never a
    guess."""
    if peak_tflops is not None:
        return peak_tflops * 1e12, "train.peak_tflops"
    if device.type != "cuda":
        return None, f"no peak for a {device.type} device"
    name = torch.cuda.get_device_name(device)
    found = device_peak(name)
    if found is None:
        return None, f"{name} is not in effpretrain.flops.DEVICE_PEAKS (set train.peak_tflops)"
    return found.flops, found.source


def mfu(model_flops_per_s: float, peak: float | None, world_size: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s of the whole job over `world_size` devices'
    peak; None without a peak."""
    if peak is None or peak <= 0:
        return None
    return model_flops_per_s / (peak * world_size)


def run_flops_per_token(cfg: RunConfig, vocab_size: int, world_size: int = 1) -> float:
    """`flops_per_token` of a run's model as its config builds it (preset or HF config, vocabulary, sequence
    length, factorization), with SLTrain's once-per-step product spread over the step's tokens."""
    t, f = cfg.train, cfg.factor
    return flops_per_token(
        model_shape(cfg.model),
        vocab_size,
        cfg.data.seq_len,
        f.kind,
        f.rank,
        factor_targets=f.targets,
        tokens_per_step=t.batch_size * t.grad_accum * world_size * cfg.data.seq_len,
    )
