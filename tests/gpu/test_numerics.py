"""CUDA numerics of docs/gpu.md's G7, G9 and G14 (`make test-gpu`; skipped without a CUDA device).

G7: the random draws that define a method's state are the CPU's on the GPU, bit for bit (the values
are made on the CPU and copied, so the comparison is exact by construction). G9: the optimizers'
matrix math runs at full fp32 under a process-wide TF32 setting, which a GPU with TF32 units shows
by the products' error. G14: the device this runs on has its peaks in the table, or is a MIG slice
whose MFU is null.
"""

from __future__ import annotations

import math

import pytest
import torch

from effpretrain import flops
from optimizers import projection as proj

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (make test-gpu)"),
]
CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("side, shape", [("right", (512, 256)), ("left", (256, 512))])
def test_apollo_bases_on_cuda_are_the_cpu_bases(dtype, side, shape):
    holder = torch.empty(shape, device=CUDA)
    for _ in range(2):  # the second call copies the held CPU draw
        on_gpu = proj.gaussian_basis(shape, 32, side, 77, device=CUDA, dtype=dtype, holder=holder)
        assert on_gpu.device.type == "cuda"
        assert torch.equal(on_gpu.cpu(), proj.gaussian_basis(shape, 32, side, 77, dtype=dtype))
    assert proj._held_draws[holder][1].is_pinned()


def test_golore_gaussian_and_randomized_svd_sketch_on_cuda_are_the_cpu_draws():
    from optimizers.golore import orthonormal_basis

    holder = torch.empty(300, 200, device=CUDA)
    orthonormal_basis((300, 200), 16, "right", 5, device=CUDA, holder=holder)
    assert torch.equal(proj._held_draws[holder][1], proj.gaussian((200, 16), proj.cpu_generator(5)))
    sketch = proj.gaussian((300, 24), proj.cpu_generator(9), device=CUDA)
    assert torch.equal(sketch.cpu(), proj.gaussian((300, 24), proj.cpu_generator(9)))


def test_a_randomized_svd_basis_on_cuda_is_the_cpus_up_to_rounding():
    """The same sketch on both: the bases differ by the devices' rounding only. The spectrum decays
    (0.8^i), so the top-r space is well separated and rounding cannot swap directions."""
    gen = torch.Generator().manual_seed(1)
    u, _ = torch.linalg.qr(torch.randn(400, 300, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(300, 300, generator=gen))
    g = (u * 0.8 ** torch.arange(300.0)) @ v.t()
    cpu = proj.compute_basis(g, 16, "left", "randomized_svd", seed=3, refresh=1)
    gpu = proj.compute_basis(g.to(CUDA), 16, "left", "randomized_svd", seed=3, refresh=1).cpu()
    # Same subspace: ||P_cpu^T P_gpu||_F^2 = r when the spans agree.
    overlap = (cpu.t() @ gpu).square().sum().item()
    assert overlap == pytest.approx(16, rel=1e-4)


def test_relora_reinit_and_factor_inits_on_cuda_are_the_cpu_draws():
    from effpretrain.models.factorized import ReLoRALinear

    def build(device):
        torch.manual_seed(4)
        layer = ReLoRALinear(96, 64, 8, 16.0, device=device)
        torch.manual_seed(5)
        layer.merge_and_reinit_()
        return layer

    cpu, gpu = build("cpu"), build(CUDA)
    assert torch.equal(gpu.A.detach().cpu(), cpu.A.detach())
    assert torch.equal(gpu.weight.detach().cpu(), cpu.weight.detach())  # B = 0 at init: W0 unchanged


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_full_fp32_runs_products_at_fp32_under_a_process_wide_tf32():
    from optimizers.precision import full_fp32

    a = torch.randn(1024, 1024, device=CUDA)
    b = torch.randn(1024, 1024, device=CUDA)
    ref = a.double() @ b.double()
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        outside = _rel_err(a @ b, ref)
        with full_fp32():
            inside = _rel_err(a @ b, ref)
            basis = proj.compute_basis(a, 32, "left", "svd")
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert inside < 1e-5  # fp32 accumulation of 1024 terms: ~1e-6
    if torch.cuda.get_device_capability(CUDA)[0] >= 8:  # TF32 units: ~1e-3 outside
        assert outside > 1e-4
    assert math.isfinite(basis.sum().item())


def test_this_devices_peaks_are_in_the_table_or_it_is_a_mig_slice():
    name = torch.cuda.get_device_name(CUDA)
    peak, source = flops.peak_flops(CUDA, dtype="bf16")
    if "MIG" in name.split():
        assert peak is None and "MIG" in source
        return
    found = flops.device_peak(name)
    if found is None:
        pytest.skip(f"{name} is not in effpretrain.flops.DEVICE_PEAKS (add it with its data sheet)")
    assert peak == found.bf16 and found.bf16 > found.tf32 >= found.fp32 > 0
