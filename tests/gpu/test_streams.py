"""CUDA only (`make test-gpu`): the stream ordering of in-backward steps under FSDP2 and of
bitsandbytes' kernels (G1 of the CUDA review, docs/gpu.md), their device timing (G5), the host
synchronisations of an in-backward step (G6) and the 8-bit optimizer's (G13).

The CPU side of these claims (what the code asks of the streams, through a recording stand-in)
is tests/optimizers/test_stream_order.py; here the same code runs on a GPU."""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]


def _gpu_check():
    sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))
    from bench_scripts import load

    return load("gpu_check")


@pytest.mark.parametrize("method", ["galore_8bit", "adamw_8bit"])
def test_fsdp2_updates_in_backward_equal_the_normal_path_bitwise(method):
    """FSDP2 on one GPU runs the in-backward hooks on its reduce-scatter stream while bitsandbytes'
    kernels run on the legacy default stream; ordered (optimizers/_streams.py), the steps are
    the normal path's kernels on the same gradients: the same weights, bitwise, at fp32.
    Unordered, the quantize can read moments not yet written (the weights then differ)."""
    pytest.importorskip("bitsandbytes")
    gc = _gpu_check()
    scale = dataclasses.replace(gc.FULL, fsdp2_preset="llama_60m", fsdp2_steps=4)
    row = gc.in_backward_fsdp2_case(method, "fp32", scale)
    assert row["bitwise_equal"], row


def test_8bit_step_on_a_side_stream_equals_the_default_stream():
    """The same galore_8bit and adamw_8bit steps with the gradient written on a busy side stream
    and the step launched there (as a hook under FSDP2 is): bitwise the default stream's."""
    pytest.importorskip("bitsandbytes")
    from optimizers.adamw_8bit import AdamW8bit
    from optimizers.galore_8bit import GaLoreAdamW8bit

    def run(make, side):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(2048, 1024, device="cuda"))
        opt = make([w])
        x = torch.randn(4096, 2048, device="cuda")
        stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                g = x.T @ x[:, :1024]  # a long kernel right before the step reads its result
                for _ in range(8):
                    g = g @ torch.eye(1024, device="cuda")
                w.grad = g / g.norm()
                opt.step()
                w.grad = None
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return w.detach().clone()

    makers = [
        lambda ps: GaLoreAdamW8bit(
            [{"params": ps, "rank": 64, "update_proj_gap": 2}], lr=1e-2, min_8bit_size=0
        ),
        lambda ps: AdamW8bit(ps, lr=1e-2),
    ]
    for make in makers:
        assert torch.equal(run(make, side=True), run(make, side=False))


def test_device_timer_times_the_kernels_not_their_launch():
    """`torch.cuda._sleep` launches in microseconds and keeps the GPU busy for tens of
    milliseconds: the timer reports the latter."""
    from optimizers._streams import DeviceTimer

    torch.cuda.synchronize()
    timer = DeviceTimer("cuda")
    t0 = time.perf_counter()
    with timer:
        torch.cuda._sleep(100_000_000)  # about 0.05-0.1 s of GPU cycles
    launch = time.perf_counter() - t0
    seconds = timer.seconds()
    assert seconds > 0.02 and seconds > 5 * launch, (seconds, launch)


def _synchronisations(fn):
    """How many synchronising CUDA calls `fn()` makes (torch's sync debug mode, warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_in_backward_step_synchronises_once_per_unit_and_once_for_the_norm():
    """One host read per step unit (the skip decision) and one for the norm: no timing or norm
    read per parameter (in_backward.py, "On CUDA")."""
    from effpretrain.in_backward import InBackward

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64)).cuda()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, capturable=True)  # step counts on the GPU: no reads
    engine = InBackward(params, opt)
    x = torch.randn(32, 256, device="cuda")

    def step():
        engine.begin_micro(0, 1)
        model(x).square().mean().backward()
        engine.finish()

    step()  # the state exists from here on
    assert _synchronisations(step) == len(params) + 1


def test_adamw_8bit_does_not_synchronise_per_parameter_and_resumes_with_shared_maps(monkeypatch, tmp_path):
    """bitsandbytes' step calls torch.cuda.synchronize after every parameter; ours never does.
    A checkpoint read onto the CPU and loaded moves each parameter's quantile maps to the GPU
    separately; the maps are one pair again after the load, so the measured state is as before."""
    pytest.importorskip("bitsandbytes")
    import optimizers
    from optimizers.adamw_8bit import AdamW8bit

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, device="cuda")) for s in ((256, 128), (8192,), (64, 64))]
    opt = AdamW8bit(params, lr=1e-2)
    calls = []
    real = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert calls == []
    monkeypatch.undo()
    before = optimizers.measured_state_bytes(opt)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = AdamW8bit(fresh, lr=1e-2)
    resumed.load_state_dict(torch.load(tmp_path / "opt.pt", map_location="cpu", weights_only=True))
    assert resumed.state[fresh[0]]["qmap1"] is resumed.state[fresh[1]]["qmap1"]
    assert resumed.state[fresh[0]]["qmap1"].device.type == "cuda"
    assert optimizers.measured_state_bytes(resumed) == before
