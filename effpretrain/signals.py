"""How a run stops on SIGTERM/SIGINT: gracefully once the loop runs, at once otherwise.

- During start-up (data, tokenizer, model, resume: before the loop's first step) a signal stops
  the run at once: nothing has been trained that a checkpoint could keep.
- In the loop the first signal finishes the current step, saves a checkpoint and returns
  normally (the CLI exits 0; `--resume auto` continues exactly).
- A second signal stops at once, without a checkpoint (the newest complete one stays valid).

Stopping at once raises `RunInterrupted` from the handler; the CLI turns it into exit code
128 + signal number (143 for SIGTERM, 130 for SIGINT), the shell's convention for a process
ended by a signal. Python runs handlers between bytecodes, so a step blocked inside one native
call (a hung collective, say) stops when that call returns; SIGKILL remains the last resort.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from types import FrameType, TracebackType

log = logging.getLogger("effpretrain")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class RunInterrupted(KeyboardInterrupt):
    """A run stopped at once by a signal, without a checkpoint.

    A KeyboardInterrupt, so that library code's `except Exception` does not swallow it and
    callers that already treat Ctrl-C as "stop" (the leaderboard) treat it alike.
    """

    def __init__(self, signum: int, when: str):
        self.signum = signum
        name = signal.Signals(signum).name
        super().__init__(f"stopped at once by {name} {when}; no checkpoint written")

    @property
    def exit_code(self) -> int:
        """128 + signal number: the shell's status for a process ended by that signal."""
        return 128 + self.signum


class StopSignals:
    """Installs the SIGTERM/SIGINT policy above for a `with` block and restores the previous
    handlers on leaving it. Handlers can only be installed from the main thread; elsewhere the
    block changes nothing and signals stay with whoever owns them.

    Attributes:
        requested: the signal that asked for a graceful stop, or None.
    """

    def __init__(self) -> None:
        self.requested: int | None = None
        self._in_loop = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for s in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not in the main thread
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for s, handler in self._previous.items():
            # None: the previous handler was not installed from Python; the default is the closest.
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def enter_loop(self) -> None:
        """From now on the first signal asks for a graceful stop (start-up is over)."""
        self._in_loop = True

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self._in_loop:
            raise RunInterrupted(signum, "during start-up")
        if self.requested is not None:
            raise RunInterrupted(signum, "(second signal)")
        self.requested = signum
        log.warning(
            "%s: finishing the current step, then saving a checkpoint (send it again to stop at once)",
            signal.Signals(signum).name,
        )
