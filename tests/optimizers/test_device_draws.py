"""Random draws that define a method's state come from a CPU generator and are moved to the device
(docs/gpu.md, G7): APOLLO's and GoLore's bases and randomized SVD's sketches are the same values on any
hardware, so a run, its resume elsewhere and the CPU-vs-CUDA check draw the same bases.

No GPU here: the device path is exercised with the ``meta`` device, which has no generator (a draw
from the device's generator raises there) and no values (a draw made on the device leaves the CPU
generator untouched). The values that reach the device are the CPU draw held for the step's copy,
compared with the CPU path's; the two run the same CPU operations, so they are compared bitwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from optimizers import projection as proj
from optimizers.bases import SeededRandomBasis
from optimizers.golore import GOLORE_BASIS, orthonormal_basis

META = torch.device("meta")


def _advanced_like(gen: torch.Generator, seed: int, *shapes: tuple[int, ...]) -> bool:
    """Whether `gen` is in the state a CPU generator seeded `seed` reaches after drawing `shapes`."""
    ref = proj.cpu_generator(seed)
    for shape in shapes:
        torch.randn(shape, generator=ref)
    return torch.equal(gen.get_state(), ref.get_state())


@pytest.mark.parametrize("side, shape", [("right", (40, 24)), ("left", (24, 40))])
def test_gaussian_basis_is_the_cpu_draw_on_any_device(side, shape):
    cpu = proj.gaussian_basis(shape, 8, side, 1234, device="cpu")
    bshape = proj.basis_shape(shape, 8, side, "random")
    expected = torch.randn(bshape, generator=torch.Generator().manual_seed(1234)) / math.sqrt(8)
    assert torch.equal(cpu, expected)
    meta = proj.gaussian_basis(shape, 8, side, 1234, device=META)  # a device generator would raise
    assert meta.device == META and meta.shape == cpu.shape and meta.dtype == cpu.dtype
    holder = torch.empty(shape, device=META)
    proj.gaussian_basis(shape, 8, side, 1234, device=META, holder=holder)
    key, host = proj._held_draws[holder]  # the CPU result each step copies to the device
    assert host.device.type == "cpu" and torch.equal(host, cpu)


def test_a_held_draw_is_drawn_once_per_seed_and_replaced_when_the_seed_changes(monkeypatch):
    holder = torch.empty(30, 20, device=META)
    calls = []
    real = proj.cpu_generator
    monkeypatch.setattr(proj, "cpu_generator", lambda seed: calls.append(seed) or real(seed))
    for _ in range(3):
        proj.gaussian_basis((30, 20), 4, "right", 7, device=META, holder=holder)
    assert calls == [7]
    proj.gaussian_basis((30, 20), 4, "right", 8, device=META, holder=holder)
    assert calls == [7, 8] and proj._held_draws[holder][0] == ("gaussian_basis", 8, (4, 20), torch.float32)
    # On the CPU nothing is held (the draw is the basis; holding it would store the basis).
    cpu_holder = torch.empty(30, 20)
    proj.gaussian_basis((30, 20), 4, "right", 7, holder=cpu_holder)
    assert cpu_holder not in proj._held_draws


@pytest.mark.parametrize("side, shape", [("right", (40, 24)), ("left", (24, 40))])
def test_golore_basis_factors_the_cpu_draw(side, shape):
    cpu = orthonormal_basis(shape, 6, side, 99)
    holder = torch.empty(shape, device=META)
    meta = orthonormal_basis(shape, 6, side, 99, device=META, holder=holder)
    assert meta.device == META and meta.shape == cpu.shape
    _, z = proj._held_draws[holder]
    q, r = torch.linalg.qr(z)  # the same CPU QR as the CPU path's: bitwise
    q = q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0)
    assert torch.equal(q.t() if side == "right" else q, cpu)


@pytest.mark.parametrize("stream", ["mix", "apollo_torch"])
def test_apollo_basis_of_a_meta_parameter_is_the_cpu_parameters(stream):
    from optimizers.apollo import APOLLOAdamW

    policy = APOLLOAdamW.RANDOM_STREAMS[stream]
    assert isinstance(policy, SeededRandomBasis)
    group = {"seed": 5, "rank": 4, "update_proj_gap": 2}
    bases = {}
    for device in ("cpu", META):
        p = torch.empty(24, 16, device=device)
        state = {"step": 0}
        policy.init_state(state, p, group, "right", 3)
        for step in range(3):  # across a refresh (gap 2): the stream advances the same way
            state["step"] = step
            basis = policy.basis(p, None, state, group, "right", proj.RefreshStats())
        bases[str(device)] = (p, basis)
    p_meta, meta = bases["meta"]
    cpu = bases["cpu"][1]
    assert meta.device == META and meta.shape == cpu.shape
    assert torch.equal(proj._held_draws[p_meta][1], cpu)


def test_golore_policy_after_its_switch_draws_the_cpu_basis_on_a_meta_parameter():
    group = {
        "seed": 2,
        "rank": 4,
        "update_proj_gap": 2,
        "rand_ratio": 0.0,
        "total_steps": None,
        "basis": "randomized_svd",
        "proj_type": "std",
    }
    out = {}
    for device in ("cpu", META):
        p = torch.empty(24, 16, device=device)
        state = {"step": 0}
        GOLORE_BASIS.init_state(state, p, group, "right", 0)
        out[str(device)] = (p, GOLORE_BASIS.basis(p, None, state, group, "right", proj.RefreshStats()))
    p_meta, meta = out["meta"]
    assert meta.device == META and meta.shape == out["cpu"][1].shape
    expected = orthonormal_basis((24, 16), 4, "right", proj.mix_seed(proj.mix_seed(2, 0), 1))
    assert torch.equal(out["cpu"][1], expected)


def test_randomized_svd_sketch_is_drawn_on_the_cpu_for_a_device_gradient():
    """With q = 0 the randomized SVD has no host synchronisation, so it runs on meta: its sketch
    must come from the CPU generator (drawn there, so the generator advances), not the device's."""
    gen = proj.cpu_generator(3)
    a = torch.empty(50, 30, device=META)
    out = proj._randomized_left_vectors(a, 5, 8, 0, gen, None)
    assert out.device == META and out.shape == (50, 5)
    assert _advanced_like(gen, 3, (30, 13))
    # The whole refresh path, seeded from (seed, refresh): no generator on the gradient's device.
    basis = proj._decompose(a.t().float(), 5, "left", "randomized_svd", None, 3, 1, 8, 0)
    assert basis.device == META and basis.shape == (30, 5)


def test_a_sketch_from_a_device_generator_is_refused():
    class NotCpu:
        device = META

    with pytest.raises(ValueError, match="CPU generator"):
        proj.gaussian((3, 2), NotCpu())  # type: ignore[arg-type]
