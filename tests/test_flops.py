"""MFU claims: FLOPs/token of llama_1b against a hand count, the device peak table and its lookup,
the MFU formula, and summary.json's speed fields (MFU null on CPU, never a guess)."""

from __future__ import annotations

import pytest
import torch
from _common import ROOT

from effpretrain import flops
from effpretrain.config import load_config


def test_llama_1b_flops_per_token_against_a_hand_count():
    # llama_1b: hidden 2048, MLP 5461, 24 layers, vocabulary 32000, sequence 256 (the benchmark's).
    # Per layer, q k v o (2048 x 2048 each) and gate up down (2048 x 5461 each):
    per_layer = 4 * 2048 * 2048 + 3 * 2048 * 5461  # 16,777,216 + 33,552,384 = 50,329,600 weights
    assert per_layer == 50_329_600
    linear = 24 * per_layer + 32000 * 2048  # + the LM head; the embedding is a lookup
    assert linear == 1_273_446_400
    attention = 12 * 24 * 2048 * 256  # scores and weighted values: 12 L h T per token
    assert attention == 150_994_944
    hand = 6 * linear + attention  # forward 2, backward 4 FLOPs per weight per token
    assert hand == 7_791_673_344
    assert flops.flops_per_token("llama_1b", 32000, 256) == hand


@pytest.mark.parametrize(
    "name, bf16, tf32, fp32",
    [
        ("NVIDIA H100 80GB HBM3", 989, 494.5, 67),
        ("NVIDIA H100 PCIe", 756, 378, 51),
        ("NVIDIA H100 NVL", 835, 417.5, 60),
        ("NVIDIA H800", 989, 494.5, 67),
        ("NVIDIA H800 PCIe", 756, 378, 51),  # not the SXM part's 989 (docs/gpu.md, G14)
        ("NVIDIA GH200 480GB", 989, 494.5, 67),
        ("NVIDIA H200", 989, 494.5, 67),
        ("NVIDIA H200 NVL", 835, 417.5, 60),
        ("NVIDIA B200", 2250, 1100, 75),
        ("NVIDIA GB200", 2500, 1250, 90),  # per Blackwell GPU, not per superchip
        ("NVIDIA A100-SXM4-80GB", 312, 156, 19.5),
        ("NVIDIA A100-PCIE-40GB", 312, 156, 19.5),
        ("NVIDIA L40S", 362.05, 183, 91.6),
        ("NVIDIA L40", 181.05, 90.5, 90.5),
        ("NVIDIA L4", 121, 60, 30.3),
        ("NVIDIA A10", 125, 62.5, 31.2),
        ("NVIDIA A10G", 70, 35, 35),  # AWS's part: half the A10's tensor rate
        ("NVIDIA A40", 149.7, 74.8, 37.4),
        ("NVIDIA RTX 6000 Ada Generation", 364.2, 91.1, 91.1),
        ("NVIDIA RTX A6000", 154.8, 77.4, 38.7),
        ("NVIDIA GeForce RTX 4090", 165.2, 82.6, 82.6),
        ("NVIDIA GeForce RTX 3090", 71, 35.6, 35.6),
        ("AMD Instinct MI300X", 1307.4, 653.7, 163.4),
    ],
)
def test_device_table_lookup(name, bf16, tf32, fp32):
    found = flops.device_peak(name)
    assert found is not None
    assert [found.flops(d) for d in flops.PEAK_DTYPES] == pytest.approx(
        [bf16 * 1e12, tf32 * 1e12, fp32 * 1e12]
    )
    assert found.source  # every value says where it comes from


@pytest.mark.parametrize(
    "name",
    ["NVIDIA A100-SXM4-80GB MIG 1g.10gb", "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "Tesla V100-SXM2-16GB", ""],
)
def test_unknown_devices_and_mig_slices_have_no_peak(name):
    assert flops.device_peak(name) is None  # V100 has no bf16 tensor cores; a MIG slice is part of a chip


def test_a_mig_slice_gets_a_null_mfu(monkeypatch):
    """docs/gpu.md, G14: a slice would otherwise be divided by the whole chip's peak."""
    monkeypatch.setattr(
        torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
    )
    peak, source = flops.peak_flops(torch.device("cuda", 0))
    assert peak is None and "MIG" in source and flops.mfu(1e15, peak) is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert flops.peak_flops(torch.device("cuda", 0), dtype="tf32")[0] == 156e12


@pytest.mark.parametrize(
    "precision, tf32, dtype",
    [
        ("bf16-pure", False, "bf16"),
        ("bf16-mixed", True, "bf16"),
        ("fp32", True, "tf32"),
        ("fp32", False, "fp32"),
    ],
)
def test_mfu_divides_by_the_peak_of_the_dtype_the_products_run_in(monkeypatch, precision, tf32, dtype):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    cfg = load_config(
        ROOT / "recipes" / "tiny" / "adamw.yaml",
        [f"train.precision={precision}", f"train.tf32={str(tf32).lower()}"],
    )
    peak, source, got = flops.run_peak_flops(cfg, torch.device("cuda", 0))
    assert got == dtype and peak == {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}[dtype]
    assert source.endswith(f"({dtype})")
    with pytest.raises(ValueError, match="peak dtype"):
        flops.device_peak("NVIDIA H100 PCIe").flops("fp8")


def test_every_table_entry_is_matched_by_its_own_names_first():
    """Each entry is reachable: no earlier pattern shadows a later one's example name."""
    examples = {
        r"\bH200 NVL\b": "NVIDIA H200 NVL",
        r"\bH200\b": "NVIDIA H200",
        r"\bH100 PCIe\b": "NVIDIA H100 PCIe",
        r"\bH800 PCIe\b": "NVIDIA H800 PCIe",
        r"\bH100 NVL\b": "NVIDIA H100 NVL",
        r"\b(H100|H800|GH200)\b": "NVIDIA GH200 480GB",
        r"\bGB200\b": "NVIDIA GB200",
        r"\bB200\b": "NVIDIA B200",
        r"\b(A100|A800)\b": "NVIDIA A800 80GB PCIe",
        r"\bL40S\b": "NVIDIA L40S",
        r"\bL40\b": "NVIDIA L40",
        r"\bL4\b": "NVIDIA L4",
        r"\bA10G\b": "NVIDIA A10G",
        r"\bA10\b": "NVIDIA A10",
        r"\bA40\b": "NVIDIA A40",
        r"\bRTX 6000 Ada\b": "NVIDIA RTX 6000 Ada Generation",
        r"\bRTX A6000\b": "NVIDIA RTX A6000",
        r"\bRTX 4090\b": "NVIDIA GeForce RTX 4090",
        r"\bRTX 3090\b": "NVIDIA GeForce RTX 3090",
        r"\bMI300X\b": "AMD Instinct MI300X",
    }
    assert set(examples) == {d.pattern for d in flops.DEVICE_PEAKS}
    for pattern, name in examples.items():
        assert flops.device_peak(name).pattern == pattern, name


def test_peak_on_cpu_is_none_unless_given():
    cpu = torch.device("cpu")
    assert flops.peak_flops(cpu)[0] is None
    assert flops.peak_flops(cpu, peak_tflops=100.0) == (100e12, "train.peak_tflops")


def test_mfu_formula():
    # 1e15 model FLOP/s over 2 devices of 989 TFLOP/s each.
    assert flops.mfu(1e15, 989e12, 2) == pytest.approx(1e15 / 1.978e15)
    assert flops.mfu(1e15, None, 2) is None
    assert flops.mfu(0.0, 989e12) == 0.0


@pytest.mark.run
@pytest.mark.fast
def test_summary_reports_model_flops_and_a_null_mfu_on_cpu(tmp_path, tiny_overrides):
    from effpretrain.trainer import train

    over = tiny_overrides + ["train.max_steps=2", "train.eval_every=0", "train.memory_steps=[]"]
    s = train(load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", over), tmp_path / "run")
    assert s["flops_per_token"] == flops.flops_per_token("tiny", 512, 32)
    assert s["model_flops_per_s"] == pytest.approx(s["flops_per_token"] * s["tokens_per_s"])
    assert s["mfu"] is None and s["peak_flops"] is None
    assert s["peak_flops_dtype"] == "fp32"  # an fp32 run without train.tf32
    assert s["compile_s"] == 0.0 and s["compiled_blocks"] == 0
    over.append("train.peak_tflops=0.001")  # a stated peak gives an MFU even on CPU
    s = train(load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", over), tmp_path / "stated")
    assert s["mfu"] == pytest.approx(s["model_flops_per_s"] / 1e9)
    assert s["peak_flops_source"] == "train.peak_tflops"


@pytest.mark.run
def test_a_compiled_run_reports_its_compile_time(tmp_path, tiny_overrides):
    """`compile_s` is the time this run spent compiling, within its wall time (Dynamo's caches
    reset first, so nothing compiled earlier in this process serves it), and every decoder block
    ran compiled."""
    import torch._dynamo

    from effpretrain.trainer import train

    over = tiny_overrides + ["train.max_steps=2", "train.eval_every=0", "train.memory_steps=[]"]
    torch._dynamo.reset()
    s = train(
        load_config(ROOT / "recipes" / "tiny" / "adamw.yaml", over + ["train.compile=true"]), tmp_path / "c"
    )
    assert s["compile_s"] > 0 and s["compiled_blocks"] == 4
    assert s["compile_s"] < s["wall_s"]
    assert s["model_flops_per_s"] == pytest.approx(s["flops_per_token"] * s["tokens_per_s"])
