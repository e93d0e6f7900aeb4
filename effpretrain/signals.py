"""How a run stops on SIGTERM/SIGINT: gracefully once the loop runs, at once otherwise.

- During start-up (data, tokenizer, model, resume: before the loop's first step) a signal stops
  the run at once: nothing has been trained that a checkpoint could keep.
- In the loop the first signal finishes the current step, saves a checkpoint and returns
  normally (the CLI exits 0; `--resume auto` continues exactly).
- A second signal stops at once, without a checkpoint (the newest complete one stays valid).
  A repeat within `REPEAT_WINDOW_S` (1 s) of the last signal counted is not a second one but the
  same request delivered twice (a scheduler and a launcher may both send SIGTERM); the handler
  and the watchdog below count by this one rule.
- Signals are counted per process: a graceful stop the ranks agreed on because another rank was
  signalled (`StopSignals.agreed`) leaves this process's own first signal a first one.

Stopping at once raises `RunInterrupted` from the handler; the CLI turns it into exit code
128 + signal number (143 for SIGTERM, 130 for SIGINT), the shell's convention for a process
ended by a signal. Python runs signal handlers only between bytecodes of the main thread, so a
step blocked inside one native call (a collective waiting for a peer that never comes) would
never see the exception: a watchdog thread, woken by the signal itself (`signal.set_wakeup_fd`),
then ends the process with the same exit code `FORCE_EXIT_AFTER_S` seconds after an immediate
stop was asked for, if it is still running.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
import time
from types import FrameType, TracebackType

log = logging.getLogger("effpretrain")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds an immediate stop leaves the main thread to unwind on its own before the watchdog exits.
FORCE_EXIT_AFTER_S = 5.0
# A stop signal within this many seconds of the previous counted one is the same request: a
# scheduler and a launcher (scancel + torchrun forwarding) may deliver two SIGTERMs at once, and
# CPython may run the handler once for both while the wake-up fd sees two bytes.
REPEAT_WINDOW_S = 1.0


class RunInterrupted(KeyboardInterrupt):
    """A run stopped at once by a signal, without a checkpoint.

    A KeyboardInterrupt, so that library code's `except Exception` does not swallow it and
    callers that already treat Ctrl-C as "stop" (the leaderboard) treat it alike.
    """

    def __init__(self, signum: int, when: str):
        self.signum = signum
        super().__init__(f"stopped at once by {signal.Signals(signum).name} {when}; no checkpoint written")

    @property
    def exit_code(self) -> int:
        """128 + signal number: the shell's status for a process ended by that signal."""
        return 128 + self.signum


class StopSignals:
    """Installs the SIGTERM/SIGINT policy above for a `with` block and restores the previous
    handlers (and wake-up fd) on leaving it. Handlers can only be installed from the main
    thread; elsewhere the block changes nothing and signals stay with whoever owns them.

    Attributes:
        requested: the signal this process received that asked for a graceful stop, or None.
        agreed: a graceful stop the processes agreed on because another rank received a signal
            (set by the trainer); it does not make this process's own first signal a second one.
        in_loop: start-up is over (`enter_loop`): a first signal now asks for a graceful stop.
    """

    def __init__(self) -> None:
        self.requested: int | None = None
        self.agreed: int | None = None
        self.in_loop = False
        self._last_counted = float("-inf")
        self._previous: dict[int, object] = {}
        self._watchdog: _Watchdog | None = None

    def __enter__(self) -> StopSignals:
        # All or nothing: any failure restores the previous handlers before it propagates. Only a
        # watchdog that cannot be set up here (no pipe wake-up fd, no thread) is done without; it
        # undoes its own partial set-up, and the handler alone still applies the policy.
        try:
            for s in STOP_SIGNALS:
                with contextlib.suppress(ValueError):  # not in the main thread
                    self._previous[s] = signal.signal(s, self._on_signal)
            if self._previous:
                with contextlib.suppress(ValueError, OSError, RuntimeError):
                    self._watchdog = _Watchdog(self)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        for s, handler in self._previous.items():
            # None: the previous handler was not installed from Python; the default is the closest.
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def enter_loop(self) -> None:
        """From now on the first signal asks for a graceful stop (start-up is over)."""
        self.in_loop = True

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self.in_loop:
            raise RunInterrupted(signum, "during start-up")
        now = time.monotonic()
        if now - self._last_counted < REPEAT_WINDOW_S:
            return  # the same request delivered twice (see REPEAT_WINDOW_S)
        self._last_counted = now
        if self.requested is not None:
            raise RunInterrupted(signum, "(second signal)")
        self.requested = signum
        log.warning(
            "%s: finishing the current step, then saving a checkpoint (send it again to stop at once)",
            signal.Signals(signum).name,
        )


class _Watchdog:
    """A daemon thread that reads every delivered signal from the wake-up fd (written by the
    interpreter's C-level handler, whatever the main thread is doing) and, once the policy
    calls for an immediate stop, exits the process if it is still alive `FORCE_EXIT_AFTER_S`
    later. It repeats the policy's count itself: the Python handler may never get to run."""

    def __init__(self, policy: StopSignals):
        # All or nothing: on any failure the fds are closed and the wake-up fd is given back.
        self.policy = policy
        fds: list[int] = []
        previous: int | None = None
        try:
            self._read, self._write = os.pipe()
            fds += [self._read, self._write]
            self._quit_read, self._quit_write = os.pipe()
            fds += [self._quit_read, self._quit_write]
            os.set_blocking(self._write, False)
            previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
            self._previous_fd = previous
            self._thread = threading.Thread(target=self._run, name="effpretrain-stop-watchdog", daemon=True)
            self._thread.start()
        except BaseException:
            if previous is not None:
                signal.set_wakeup_fd(previous)
            for fd in fds:
                os.close(fd)
            raise

    def stop(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        os.write(self._quit_write, b"q")
        self._thread.join()
        for fd in (self._read, self._write, self._quit_read, self._quit_write):
            os.close(fd)

    def _run(self) -> None:
        stops = {int(s) for s in STOP_SIGNALS}
        in_loop_seen, deadline, why, last = 0, None, (0, ""), float("-inf")
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._read, self._quit_read], [], [], timeout)
            if self._quit_read in ready:
                return
            if not ready:
                self._force_exit(*why)
            for signum in os.read(self._read, 512):
                if signum not in stops or deadline is not None:
                    continue
                now = time.monotonic()
                if self.policy.in_loop and now - last < REPEAT_WINDOW_S:
                    continue  # the handler's rule: a repeat within the window is one request
                last = now
                if self.policy.in_loop:
                    in_loop_seen += 1
                if not self.policy.in_loop or in_loop_seen >= 2:
                    when = "(second signal)" if self.policy.in_loop else "during start-up"
                    deadline, why = time.monotonic() + FORCE_EXIT_AFTER_S, (signum, when)

    @staticmethod
    def _force_exit(signum: int, when: str) -> None:
        msg = str(RunInterrupted(signum, when))
        os.write(2, f"\neffpretrain: {msg}; blocked in native code, exiting without clean-up\n".encode())
        os._exit(128 + signum)
