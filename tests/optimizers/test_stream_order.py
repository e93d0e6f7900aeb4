"""The CUDA stream ordering of optimizer steps inside backward hooks, and the device timer
(optimizers/_streams.py), checked on the CPU through a recording stand-in for the stream calls.

Under FSDP2 with updates in backward the hooks step on FSDP2's reduce-scatter stream, while
bitsandbytes' quantize and optimizer kernels run on the legacy default stream (no stream
argument). The stand-in says what the code asks of the streams: before every bitsandbytes kernel
the legacy stream waits for the hook's stream, the kernel is launched with the legacy stream
current, and afterwards the hook's stream waits for the legacy one and the used tensors are
recorded on it. The real run on a GPU is tests/gpu/test_streams.py."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch

pytest.importorskip("bitsandbytes")

import bitsandbytes.functional as bnb_f  # noqa: E402

from effpretrain.in_backward import InBackward  # noqa: E402
from optimizers import _streams  # noqa: E402
from optimizers._streams import DeviceTimer, Streams, ordered_on  # noqa: E402


class RecordingStreams(Streams):
    """Every CPU device "has streams": the hook's stream is ``"hook"``, the legacy one
    ``"legacy"``; each call is logged in order. Events are numbered; event k is at k seconds."""

    def __init__(self, cuda_only: bool = False) -> None:
        self.log: list[tuple] = []
        self.now = "hook"
        self.cuda_only = cuda_only
        self.events = 0
        self.passed = 0  # events up to this number count as done without waiting

    def active(self, device):
        return device.type == "cuda" if self.cuda_only else True

    def current(self, device):
        return self.now

    def legacy(self, device):
        return "legacy"

    def wait(self, waiter, producer):
        self.log.append(("wait", waiter, producer))

    @contextlib.contextmanager
    def use(self, stream):
        before, self.now = self.now, stream
        self.log.append(("enter", stream))
        try:
            yield
        finally:
            self.now = before
            self.log.append(("exit", stream))

    def record(self, tensor, stream):
        self.log.append(("record", stream, id(tensor)))

    def event(self, device):
        self.events += 1
        self.log.append(("event", self.now))
        return self.events

    def done(self, event):
        return event <= self.passed

    def seconds_between(self, start, end):
        return float(end - start)

    def synchronize(self, device):
        self.log.append(("synchronize", device.type))
        self.passed = self.events


@pytest.fixture
def streams(monkeypatch):
    rec = RecordingStreams()
    monkeypatch.setattr(_streams, "STREAMS", rec)
    return rec


def _spy_kernels(monkeypatch, streams, names):
    """Logs ("kernel", name, the current stream) at each call of bitsandbytes' functions `names`."""
    for name in names:
        real = getattr(bnb_f, name)

        def spy(*a, _real=real, _name=name, **kw):
            streams.log.append(("kernel", _name, streams.now))
            return _real(*a, **kw)

        monkeypatch.setattr(bnb_f, name, spy)


def _blocks(log):
    """The log cut into the stretches between entering and leaving the legacy stream, each with
    the calls just before (the wait) and just after (the wait back and the records)."""
    out, i = [], 0
    while i < len(log):
        if log[i] == ("enter", "legacy"):
            j = log.index(("exit", "legacy"), i)
            k = j + 1
            while k < len(log) and log[k][0] in ("wait", "record") and log[k] != ("wait", "legacy", "hook"):
                k += 1
            out.append((log[i - 1] if i else None, log[i + 1 : j], log[j + 1 : k]))
            i = k
        else:
            i += 1
    return out


def _check_ordered(log, min_blocks):
    """Every bitsandbytes kernel ran inside a legacy stretch that waited for the hook's stream
    before it, and after which the hook's stream waited for it and the used tensors were recorded."""
    kernels = [e for e in log if e[0] == "kernel"]
    assert kernels and all(e[2] == "legacy" for e in kernels), kernels
    blocks = _blocks(log)
    assert len(blocks) >= min_blocks
    for before, body, after in blocks:
        assert before == ("wait", "legacy", "hook"), (before, body)
        assert after[0] == ("wait", "hook", "legacy"), after
        assert any(e[0] == "record" and e[1] == "legacy" for e in after[1:]), after
    assert sum(len([e for e in body if e[0] == "kernel"]) for _, body, _ in blocks) == len(kernels)


def _in_backward_model(opt_for, log):
    """A two-layer model whose every parameter steps inside backward through `opt_for(params)`;
    `log` gets ("grad", i, id) when parameter i's final gradient arrives and ("freed", i) when
    that tensor is released. Returns a function running one step, and the parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 32))
    params = list(model.parameters())

    def watch(i):
        def hook(p):  # registered before the engine's, so it runs first
            log.append(("grad", i, id(p.grad)))
            weakref.finalize(p.grad, log.append, ("freed", i))

        return hook

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(watch(i))
    engine = InBackward(params, opt_for(params))

    def step():
        engine.begin_micro(0, 1)
        model(torch.randn(8, 64)).square().mean().backward()
        engine.finish()

    return step, params


def _galore_8bit(ps):
    from optimizers.galore_8bit import GaLoreAdamW8bit

    groups = [{"params": [ps[0], ps[2]], "rank": 4, "update_proj_gap": 2}, {"params": [ps[1], ps[3]]}]
    return GaLoreAdamW8bit(groups, lr=1e-2, min_8bit_size=0)  # every moment 8-bit


def _adamw_8bit(ps):
    from optimizers.adamw_8bit import AdamW8bit

    return AdamW8bit(ps, lr=1e-2, min_8bit_size=1000)  # 8-bit weights, fp32-state biases


@pytest.mark.parametrize(
    ("method", "kernels"),
    [
        ("galore_8bit", ["quantize_blockwise"]),
        ("adamw_8bit", ["optimizer_update_8bit_blockwise", "optimizer_update_32bit"]),
    ],
)
def test_bitsandbytes_kernels_in_hooks_are_ordered_with_the_hooks_stream(
    method, kernels, streams, monkeypatch
):
    """galore_8bit's quantize and adamw_8bit's update kernels (the bitsandbytes kernels that
    ignore the current stream) run ordered both ways with the hook's stream, for every parameter
    of every step, before that parameter's gradient is released; adamw_8bit's kernels read the
    gradient on the legacy stream, so the gradient is recorded on it."""
    _spy_kernels(monkeypatch, streams, kernels)
    step, params = _in_backward_model(_galore_8bit if method == "galore_8bit" else _adamw_8bit, streams.log)
    for _ in range(3):
        start = len(streams.log)
        step()
        log = streams.log[start:]
        _check_ordered(log, min_blocks=len(params))
        for i in range(len(params)):
            (arrived,) = [k for k, e in enumerate(log) if e[:2] == ("grad", i)]
            (freed,) = [k for k, e in enumerate(log) if e == ("freed", i)]
            mine = log[arrived:freed]
            blocks = _blocks(mine)
            assert blocks, f"parameter {i}: no bitsandbytes kernel on the legacy stream in its step"
            # Each of its stretches is waited for by the hook's stream before the release.
            assert all(after[:1] == [("wait", "hook", "legacy")] for _, _, after in blocks), blocks
            if method == "adamw_8bit":
                assert ("record", "legacy", log[arrived][2]) in mine  # the gradient, read there


def test_ordered_on_is_a_no_op_without_streams_or_on_the_callers_stream(streams):
    x = torch.zeros(3)
    with ordered_on(None, torch.device("cpu"), used=[x]):
        pass
    with ordered_on("hook", torch.device("cpu"), used=[x]):  # already the caller's stream
        pass
    assert streams.log == []
    streams.cuda_only = True
    with ordered_on("legacy", torch.device("cpu"), used=[x]):
        pass
    assert streams.log == []
    streams.cuda_only = False
    with pytest.raises(RuntimeError, match="boom"), ordered_on("legacy", torch.device("cpu"), used=[x]):
        raise RuntimeError("boom")
    # Even when the body raises, the caller's stream waits for the work queued on the other one.
    assert streams.log == [
        ("wait", "legacy", "hook"),
        ("enter", "legacy"),
        ("exit", "legacy"),
        ("wait", "hook", "legacy"),
        ("record", "legacy", id(x)),
    ]


def test_device_timer_synchronises_once_when_read_on_cuda_and_never_on_cpu(streams):
    """CUDA (the device kind is all the timer looks at): events on the current stream, no
    synchronisation while timing, one when the total is read, none when nothing is unread.
    CPU: perf_counter, no synchronisation and no events."""
    streams.cuda_only = True
    timer = DeviceTimer(torch.device("cuda"))
    for _ in range(3):
        with timer:
            pass
    assert [e[0] for e in streams.log] == ["event"] * 6
    assert timer.seconds() == 3.0  # event k at k seconds: three intervals of 1
    assert streams.log[6:] == [("synchronize", "cuda")]
    assert timer.seconds() == 3.0 and len(streams.log) == 7  # nothing unread: no second synchronisation

    cpu = DeviceTimer("cpu")
    with cpu:
        sum(range(1000))
    assert cpu.seconds() > 0 and len(streams.log) == 7


def test_device_timer_folds_what_the_device_has_passed_without_waiting(streams):
    streams.cuda_only = True
    timer = DeviceTimer(torch.device("cuda"))
    with timer:
        pass
    streams.passed = streams.events  # the device got there by itself
    with timer:
        pass
    assert len(timer._pending) == 1  # the first interval was folded at the second stop
    assert timer.seconds() == 2.0
