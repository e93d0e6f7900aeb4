"""The one loader of the benchmark scripts for their tests."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from _common import ROOT


def load(script: str) -> ModuleType:
    """`benchmarks/<script>.py` as a module (benchmarks/ is a folder of scripts, not an installed
    package: the file itself is loaded, once per process)."""
    # The scripts import their shared helpers (benchmarks/_bench.py) as they do when run directly.
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    name = f"effpretrain_benchmarks_{script}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]
