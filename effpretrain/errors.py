"""The one exception for bad input: the CLI reports it in one line and exits with code 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """Bad input (config, recipe, data, paths, checkpoints), as opposed to a bug.

    The message is always one line: a value or path that holds a line break (a key typed with a
    newline, a multi-line error from a library) is joined into one line, so the CLI's
    ``effpretrain: error: ...`` report stays a single line whatever the input was.
    """

    def __init__(self, message: object = "") -> None:
        lines = [line.strip() for line in str(message).splitlines()]
        super().__init__(" ".join(line for line in lines if line))
