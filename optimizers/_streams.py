"""CUDA stream ordering for kernels that ignore the current stream, and a device timer.

Streams. A CUDA kernel runs on a stream; work on one stream runs in launch order, work on two
streams is unordered unless one waits for the other. PyTorch launches every kernel on the
*current* stream. An optimizer step usually runs on the default stream, but not always: under
FSDP2 with ``train.update_in_backward`` the post-accumulate-grad hooks that step each parameter run
inside ``torch.cuda.stream(post_reduce_stream)`` (torch's ``_fsdp_collectives.foreach_reduce``), a
non-blocking pool stream that wrote the gradient. PyTorch's own kernels in the step follow it (they
run after the gradient was written, on the stream that wrote it). bitsandbytes does not:
``quantize_blockwise`` and its 8-bit and 32-bit optimizer updates launch without a stream argument,
i.e. on the legacy default stream (bitsandbytes 0.50.2, ``backends/cuda/ops.py``;
``dequantize_blockwise`` does pass the current stream), which a non-blocking stream does not
synchronise with. Unordered, such a kernel can read moments or a gradient before they are written,
and a block freed on one stream can be handed to new work while a kernel on the other still uses it.

`ordered_on(stream, device, used)` is the one place that orders them: the body runs with `stream`
current, after `stream` waited for everything queued so far on the caller's stream (the gradient's
producer, for a hook), and the caller's stream waits for the body's work before anything it queues
next (so the next reduce-scatter, FSDP2's post-reduce event and the freeing of the gradient come
after it). The tensors in `used` (read or written in the body, allocated before it) are recorded
on `stream` (`Tensor.record_stream`): the caching allocator then does not hand their blocks to new
work until `stream` is done with them, whichever stream frees them. Both waits are GPU-side (an
event each: no host synchronisation). `legacy_stream(device)` is the stream bitsandbytes' kernels
run on; the 8-bit optimizers run those kernels inside ``ordered_on(legacy_stream(...))``, which is
a no-op where the caller's stream already is it (every step outside such a hook) and on the CPU.

Timing (`DeviceTimer`): CUDA kernels run asynchronously, so ``perf_counter`` around a call times
the launches; each timed interval is a pair of timing events on the current stream instead, read
after one device synchronisation when the total is asked for (no synchronisation per interval).

`STREAMS` holds the operations used (a module attribute, so that a test can record them).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["STREAMS", "DeviceTimer", "Streams", "legacy_stream", "ordered_on"]


class Streams:
    """The stream, event and synchronisation calls `ordered_on` and `DeviceTimer` make (CUDA)."""

    def active(self, device: torch.device) -> bool:
        """Whether `device` has streams at all (CUDA); everything here is a no-op elsewhere."""
        return device.type == "cuda"

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def legacy(self, device: torch.device) -> Any:
        # Stream 0: PyTorch's default stream is the legacy default stream, the one a kernel
        # launched without a stream argument runs on.
        return torch.cuda.default_stream(device)

    def wait(self, waiter: Any, producer: Any) -> None:
        """Work queued on `waiter` from now on runs after everything queued so far on `producer`."""
        waiter.wait_stream(producer)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def event(self, device: torch.device) -> Any:
        """A timing event recorded now on `device`'s current stream."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def done(self, event: Any) -> bool:
        """Whether the device has passed `event` (no waiting)."""
        return bool(event.query())

    def seconds_between(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


STREAMS = Streams()


def legacy_stream(device: torch.device) -> Any:
    """The stream bitsandbytes launches its stream-less kernels on (`device`'s legacy default
    stream); None where there are no streams (CPU)."""
    return STREAMS.legacy(device) if STREAMS.active(device) else None


@contextlib.contextmanager
def ordered_on(stream: Any, device: torch.device, used: Iterable[torch.Tensor] = ()) -> Iterator[None]:
    """Runs the body with `stream` current, ordered both ways with the caller's stream (module
    docstring): `stream` first waits for the caller's stream; after the body the caller's stream
    waits for `stream`, and every tensor in `used` is recorded on `stream`.

    A no-op when `stream` is None, on a device without streams, or when `stream` already is the
    caller's current stream (then program order orders everything)."""
    s = STREAMS
    if stream is None or not s.active(device):
        yield
        return
    caller = s.current(device)
    if stream == caller:
        yield
        return
    s.wait(stream, caller)
    try:
        with s.use(stream):
            yield
    finally:
        s.wait(caller, stream)
        for t in used:
            s.record(t, stream)


class DeviceTimer:
    """Seconds of device work between `start()` and `stop()` (or inside ``with timer:``), summed
    over the intervals.

    CPU: the work runs in the calling thread, so ``perf_counter`` intervals. CUDA: a timing event
    on the current stream at each end of an interval; `seconds()` synchronises the device once
    (when some interval is still unread) and adds up the elapsed times, so timing an interval
    inside backward costs no host synchronisation. Intervals the device has already passed are
    folded at each `stop()` without waiting, so the unread ones stay few.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._total = 0.0
        self._open: Any = None
        self._pending: list[tuple[Any, Any]] = []

    @property
    def on_device(self) -> bool:
        return STREAMS.active(self.device)

    def start(self) -> None:
        self._open = STREAMS.event(self.device) if self.on_device else time.perf_counter()

    def stop(self) -> None:
        start, self._open = self._open, None
        if not self.on_device:
            self._total += time.perf_counter() - start
            return
        self._pending.append((start, STREAMS.event(self.device)))
        while self._pending and STREAMS.done(self._pending[0][1]):
            self._fold(self._pending.pop(0))

    def __enter__(self) -> DeviceTimer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _fold(self, interval: tuple[Any, Any]) -> None:
        self._total += STREAMS.seconds_between(*interval)

    def seconds(self) -> float:
        """The total so far (synchronising the device first if an interval is unread)."""
        if self._pending:
            STREAMS.synchronize(self.device)
            for interval in self._pending:
                self._fold(interval)
            self._pending = []
        return self._total
