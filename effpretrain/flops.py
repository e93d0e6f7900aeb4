"""Training FLOPs per token of a model's matrix multiplies (the leaderboard's column), and model
FLOPs utilisation (MFU): achieved model FLOP/s over the devices' peak dense FLOP/s at the dtype the
model's products run in (bf16, TF32 or fp32: `peak_dtype`)."""

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
# MFU: achieved model FLOP/s over the device's peak dense FLOP/s at the run's matmul dtype.

#: The dtypes a peak is given for: the model's matrix products run in bf16 (`train.precision`
#: bf16-mixed or bf16-pure), in TF32 (fp32 with `train.tf32`) or in full fp32.
PEAK_DTYPES: tuple[str, ...] = ("bf16", "tf32", "fp32")


def peak_dtype(precision: str, tf32: bool = False) -> str:
    """The dtype whose peak MFU divides by: "bf16" for a bf16 run (mixed or pure: the products
    run in bf16), "tf32" for an fp32 run with `train.tf32`, "fp32" for an fp32 run without."""
    if precision != "fp32":
        return "bf16"
    return "tf32" if tf32 else "fp32"


@dataclass(frozen=True)
class DevicePeak:
    """A device's peak dense FLOP/s (no structured sparsity) in bf16 tensor-core math (fp32
    accumulation where the sheet gives two figures), TF32 tensor-core math and plain fp32 (the
    vector units: a card without TF32 math does fp32 products there), matched by a regular
    expression on `torch.cuda.get_device_name`; `source` names the data sheet, per GPU."""

    pattern: str
    bf16: float
    tf32: float
    fp32: float
    source: str

    def flops(self, dtype: str = "bf16") -> float:
        """The peak for one of `PEAK_DTYPES`."""
        if dtype not in PEAK_DTYPES:
            raise ValueError(f"peak dtype {dtype!r}: choose one of {', '.join(PEAK_DTYPES)}")
        return getattr(self, dtype)


#: A MIG slice (`torch.cuda.get_device_name` says e.g. "NVIDIA A100-SXM4-80GB MIG 1g.10gb") has a
#: fraction of the chip's units; the table's peaks are whole chips', so a slice gets no peak.
MIG_PATTERN = r"\bMIG\b"

#: Peak dense FLOP/s by device name (bf16, tf32, fp32), per GPU. The first pattern that matches
#: wins, so a variant (H100 PCIe) comes before its family's default (H100 SXM). Data sheets quote
#: the sparse tensor figures first (marked "with sparsity"); the dense ones are half of them. The
#: figures are the sheets' as printed (their dense halves rounded as the sheets round).
DEVICE_PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak(
        r"\bH200 NVL\b",
        835e12,
        417.5e12,
        60e12,
        "NVIDIA H200 NVL data sheet: BF16 1,671, TF32 835 TFLOPS with sparsity; FP32 60 TFLOPS",
    ),
    DevicePeak(
        r"\bH200\b",
        989e12,
        494.5e12,
        67e12,
        "NVIDIA H200 SXM data sheet: BF16 1,979, TF32 989 TFLOPS with sparsity; FP32 67 TFLOPS",
    ),
    DevicePeak(
        r"\bH100 PCIe\b",
        756e12,
        378e12,
        51e12,
        "NVIDIA H100 PCIe data sheet: BF16 1,513, TF32 756 TFLOPS with sparsity; FP32 51 TFLOPS",
    ),
    DevicePeak(
        r"\bH800 PCIe\b",
        756e12,
        378e12,
        51e12,
        "NVIDIA H800 PCIe 80GB data sheet: BF16 1,513, TF32 756 TFLOPS with sparsity; FP32 51 TFLOPS",
    ),
    DevicePeak(
        r"\bH100 NVL\b",
        835e12,
        417.5e12,
        60e12,
        "NVIDIA H100 NVL data sheet: BF16 1,671, TF32 835 TFLOPS with sparsity; FP32 60 TFLOPS",
    ),
    DevicePeak(
        r"\b(H100|H800|GH200)\b",
        989e12,
        494.5e12,
        67e12,
        "NVIDIA H100 SXM data sheet (H800 SXM, GH200 the same): BF16 1,979, TF32 989 TFLOPS with "
        "sparsity; FP32 67 TFLOPS",
    ),
    DevicePeak(
        r"\bGB200\b",
        2500e12,
        1250e12,
        90e12,
        "NVIDIA GB200 NVL72 data sheet, per GPU (the rack's 72): FP16/BF16 360, TF32 180 PFLOPS with "
        "sparsity; FP32 6,480 TFLOPS",
    ),
    DevicePeak(
        r"\bB200\b",
        2250e12,
        1100e12,
        75e12,
        "NVIDIA HGX B200 data sheet, per GPU: FP16/BF16 4.5, TF32 2.2 PFLOPS with sparsity; FP32 75 TFLOPS",
    ),
    DevicePeak(
        r"\b(A100|A800)\b",
        312e12,
        156e12,
        19.5e12,
        "NVIDIA A100 data sheet: BF16 312, TF32 156 TFLOPS (624, 312 with sparsity); FP32 19.5 TFLOPS",
    ),
    DevicePeak(
        r"\bL40S\b",
        362.05e12,
        183e12,
        91.6e12,
        "NVIDIA L40S data sheet: BF16 362.05, TF32 183 TFLOPS (733, 366 with sparsity); FP32 91.6 TFLOPS",
    ),
    DevicePeak(
        r"\bL40\b",
        181.05e12,
        90.5e12,
        90.5e12,
        "NVIDIA L40 data sheet: BF16 181.05, TF32 90.5 TFLOPS (362.1, 181 with sparsity); FP32 90.5 TFLOPS",
    ),
    DevicePeak(
        r"\bL4\b",
        121e12,
        60e12,
        30.3e12,
        "NVIDIA L4 data sheet: BF16 242, TF32 120 TFLOPS with sparsity; FP32 30.3 TFLOPS",
    ),
    DevicePeak(
        r"\bA10G\b",
        70e12,
        35e12,
        35e12,
        "NVIDIA A10G (AWS EC2 G5; no public NVIDIA data sheet): 80 SMs at 1.71 GHz, BF16 70, TF32 35 "
        "TFLOPS dense, FP32 35 TFLOPS, as in Baseten's 'NVIDIA A10 vs A10G' spec comparison",
    ),
    DevicePeak(
        r"\bA10\b",
        125e12,
        62.5e12,
        31.2e12,
        "NVIDIA A10 data sheet: BF16 125, TF32 62.5 TFLOPS (250, 125 with sparsity); FP32 31.2 TFLOPS",
    ),
    DevicePeak(
        r"\bA40\b",
        149.7e12,
        74.8e12,
        37.4e12,
        "NVIDIA A40 data sheet: BF16 149.7, TF32 74.8 TFLOPS (299.4, 149.6 with sparsity); FP32 37.4 TFLOPS",
    ),
    DevicePeak(
        r"\bRTX 6000 Ada\b",
        364.2e12,
        91.1e12,
        91.1e12,
        "NVIDIA Ada Lovelace architecture whitepaper, RTX 6000 Ada: BF16 (FP32 accumulate) 364.2, "
        "TF32 91.1 TFLOPS dense; FP32 91.1 TFLOPS",
    ),
    DevicePeak(
        r"\bRTX A6000\b",
        154.8e12,
        77.4e12,
        38.7e12,
        "NVIDIA RTX A6000 data sheet: tensor 309.7 TFLOPS with sparsity; Ampere GA102 whitepaper: TF32 "
        "77.4 TFLOPS dense; FP32 38.7 TFLOPS",
    ),
    DevicePeak(
        r"\bRTX 4090\b",
        165.2e12,
        82.6e12,
        82.6e12,
        "NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: BF16 (FP32 accumulate) 165.2, "
        "TF32 82.6 TFLOPS dense; FP32 82.6 TFLOPS",
    ),
    DevicePeak(
        r"\bRTX 3090\b",
        71e12,
        35.6e12,
        35.6e12,
        "NVIDIA Ampere GA102 whitepaper, GeForce RTX 3090: BF16 (FP32 accumulate) 71, TF32 35.6 TFLOPS "
        "dense; FP32 35.6 TFLOPS",
    ),
    DevicePeak(
        r"\bMI300X\b",
        1307.4e12,
        653.7e12,
        163.4e12,
        "AMD Instinct MI300X data sheet: BF16 1,307.4, TF32 653.7 TFLOPS dense; FP32 matrix 163.4 TFLOPS",
    ),
)


def device_peak(name: str) -> DevicePeak | None:
    """The table's entry for a device name (`torch.cuda.get_device_name`); None when unknown or a
    MIG slice (whose share of the chip the table does not know)."""
    if re.search(MIG_PATTERN, name):
        return None
    return next((d for d in DEVICE_PEAKS if re.search(d.pattern, name)), None)


def peak_flops(
    device: torch.device, peak_tflops: float | None = None, dtype: str = "bf16"
) -> tuple[float | None, str]:
    """The peak dense FLOP/s at `dtype` (`peak_dtype`) that MFU divides by, and where it came from.

    `peak_tflops` (`train.peak_tflops`, stated for the run's dtype) wins; else a CUDA device is
    looked up by name in `DEVICE_PEAKS`. A CPU, an unknown device or a MIG slice has no peak
    (None): MFU is then null, never a guess."""
    if peak_tflops is not None:
        return peak_tflops * 1e12, "train.peak_tflops"
    if device.type != "cuda":
        return None, f"no peak for a {device.type} device"
    name = torch.cuda.get_device_name(device)
    if re.search(MIG_PATTERN, name):
        return None, f"{name} is a MIG slice: the table's peaks are whole chips' (set train.peak_tflops)"
    found = device_peak(name)
    if found is None:
        return None, f"{name} is not in effpretrain.flops.DEVICE_PEAKS (set train.peak_tflops)"
    return found.flops(dtype), f"{found.source} ({dtype})"


def run_peak_flops(cfg: RunConfig, device: torch.device) -> tuple[float | None, str, str]:
    """`peak_flops` for a run: (peak, source, dtype) at the run's matmul dtype (`peak_dtype` of
    `train.precision` and `train.tf32`)."""
    dtype = peak_dtype(cfg.train.precision, cfg.train.tf32)
    peak, source = peak_flops(device, cfg.train.peak_tflops, dtype)
    return peak, source, dtype


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
