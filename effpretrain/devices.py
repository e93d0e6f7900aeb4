"""Which device a run trains on (`train.device`), and whether this machine has an NVIDIA driver.

The driver is detected from the files its kernel module creates, not by running ``nvidia-smi``
(which need not be on PATH: a container, a minimal image). The Makefile runs this file as a
script (``python effpretrain/devices.py``, exit 0 where a driver is present) to choose between a
CUDA and a CPU build of torch, so the module imports nothing outside the standard library at the
top (torch only inside `cuda_facts`).

`choose` is the rule, on facts passed in (tests give it any machine); `cuda_facts` reads this
machine's.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

#: Files the NVIDIA kernel driver creates when it is loaded, relative to the root: the version file
#: under /proc, the control node and the first GPU's node under /dev.
DRIVER_FILES: tuple[str, ...] = ("proc/driver/nvidia/version", "dev/nvidiactl", "dev/nvidia0")

DEVICES: tuple[str, ...] = ("auto", "cuda", "cpu")


def nvidia_driver(root: str = "/") -> str | None:
    """The first of `DRIVER_FILES` present under `root` (as an absolute path when `root` is /),
    None when the machine has no NVIDIA driver loaded."""
    for rel in DRIVER_FILES:
        path = os.path.join(root, rel)
        if os.path.exists(path):
            return path
    return None


def gpus_hidden(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """True when ``CUDA_VISIBLE_DEVICES`` hides every GPU: set and empty, or its first entry a
    negative number (CUDA stops at the first invalid entry, so ``-1`` and ``-1,-1`` hide all; the
    tests and the ``*_cpu`` launch configs hide GPUs this way)."""
    var = environ.get("CUDA_VISIBLE_DEVICES")
    if var is None:
        return False
    first = var.split(",")[0].strip()
    return first == "" or first.startswith("-")


@dataclass(frozen=True)
class CudaFacts:
    """What decides where a run can train.

    Attributes:
        available: ``torch.cuda.is_available()``.
        torch_cuda: the CUDA version torch was built for (``torch.version.cuda``); None for a CPU build.
        driver: the driver file found (`nvidia_driver`), or None.
        hidden: ``CUDA_VISIBLE_DEVICES`` hides every GPU (`gpus_hidden`).
        error: torch's own reason when CUDA failed to initialise (its ``CUDA initialization: ...``
            warning, e.g. a driver too old for torch's CUDA), or None.
    """

    available: bool
    torch_cuda: str | None
    driver: str | None
    hidden: bool
    error: str | None = None

    def why_not(self) -> str:
        """Why CUDA does not start here (one clause)."""
        if self.hidden:
            return "CUDA_VISIBLE_DEVICES hides every GPU"
        if self.torch_cuda is None:
            return "this torch is a CPU build"
        if self.driver is None:
            return "no NVIDIA driver is loaded"
        if self.error:
            return f"CUDA {self.torch_cuda} does not start: {self.error}"
        return f"CUDA {self.torch_cuda} does not start with the loaded driver (older than that CUDA, or no GPU visible)"


def cuda_facts() -> CudaFacts:
    """This machine's `CudaFacts`. torch's warning when CUDA fails to initialise (a message of
    several lines on stderr) is caught and kept as the reason, so the run says it once, in its
    own line."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = bool(torch.cuda.is_available())
    errors = [str(w.message) for w in caught if "CUDA initialization" in str(w.message)]
    # The first sentence: torch appends where in its source the warning was raised.
    error = errors[0].split(" (Triggered internally")[0].strip() if errors else None
    return CudaFacts(
        available=available,
        torch_cuda=torch.version.cuda,
        driver=nvidia_driver(),
        hidden=gpus_hidden(),
        error=" ".join(error.split()) if error else None,
    )


@dataclass(frozen=True)
class Choice:
    """Where a run trains: `cpu` (Accelerate's ``cpu=``), why (the start line's reason), and a
    warning (one line) or None."""

    cpu: bool
    reason: str
    warning: str | None = None


def choose(setting: str, facts: CudaFacts) -> Choice:
    """The device for `train.device` = `setting` on a machine with `facts`.

    ``cpu``: the CPU. ``cuda``: CUDA, or ValueError (one line: why CUDA does not start) where it
    does not. ``auto``: CUDA where it starts, else the CPU, with a warning when an NVIDIA driver is
    loaded but CUDA does not start (unless ``CUDA_VISIBLE_DEVICES`` hides the GPUs on purpose): the
    run would otherwise train on the CPU of a GPU machine without a word.
    """
    if setting not in DEVICES:
        raise ValueError(f"train.device must be one of {', '.join(DEVICES)}, got {setting!r}")
    if setting == "cpu":
        return Choice(True, "train.device=cpu")
    if facts.available:
        return Choice(False, f"train.device={setting}")
    if setting == "cuda":
        hint = ""
        if facts.driver is not None and facts.torch_cuda is None and not facts.hidden:
            hint = " (an NVIDIA driver is loaded: `make venv` installs a CUDA build of torch where one is)"
        raise ValueError(f"train.device=cuda but CUDA is not available: {facts.why_not()}{hint}")
    warning = None
    if facts.driver is not None and not facts.hidden:
        warning = (
            f"an NVIDIA driver is loaded ({facts.driver}) but CUDA does not start: {facts.why_not()}; "
            "training on the CPU (train.device=cuda makes this an error)"
        )
    return Choice(True, f"train.device=auto, no CUDA: {facts.why_not()}", warning)


if __name__ == "__main__":
    # The Makefile's test: exit 0 where an NVIDIA driver is loaded.
    sys.exit(0 if nvidia_driver() else 1)
