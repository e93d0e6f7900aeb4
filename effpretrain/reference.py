"""The generated pages of the docs (``docs/reference/``): every config key, every method and every
preset, read
from the code that defines them, so the reference cannot drift from it.

    python -m effpretrain.reference            # writes docs/reference/config.md, methods.md, models.md
    python -m effpretrain.reference --check    # exit 1 if a committed page differs

``make docs`` writes them before MkDocs builds the site; a test keeps the committed pages equal to
what this module renders.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
from collections.abc import Callable
from pathlib import Path

import optimizers
from effpretrain.config import config_table
from effpretrain.memory.terms import model_param_shapes
from effpretrain.models.factorized import FACTOR_KINDS
from effpretrain.models.llama import ARCHITECTURES, PRESETS

__all__ = ["PAGES", "config_page", "methods_page", "models_page", "write_pages"]


def config_page() -> str:
    """Every YAML key: its default, its allowed values and its meaning (the field docstrings)."""
    return (
        "# Config reference\n\n"
        "Every key of a recipe, generated from the dataclasses in `effpretrain/config/schema.py` (their types, "
        "defaults and field docstrings). Unknown keys, wrong types and out-of-range values are errors "
        "that name the key and the file (exit code 2). See [Training](../training.md) for how recipes "
        "and `--set` overrides fill them.\n\n" + config_table()
    )


def _block(text: str) -> str:
    return "```text\n" + text.rstrip() + "\n```\n"


def _method_section(name: str) -> str:
    spec = optimizers.method_spec(name)
    lines = [f"## `{name}`\n"]
    try:
        cls = optimizers.get_optimizer_class(name)
    except ImportError as e:  # an optional backend (bitsandbytes) missing where the docs are built
        return "\n".join([*lines, f"Class `{spec.target}` (not importable here: {e}).\n"])
    facts = [f"class `{cls.__module__}.{cls.__name__}`"]
    facts.append("projects its attention/MLP groups" if spec.projects else "no projection")
    if spec.matrix_params:
        facts.append(f"whole-matrix rule on {spec.matrix_params} matrices")
    if spec.steps_factor_pairs:
        facts.append("steps factor pairs jointly")
    lines.append("; ".join(facts) + ".\n")
    if cls.__module__.startswith("optimizers."):
        lines.append(_block(inspect.getdoc(cls) or ""))
        state_doc = inspect.getdoc(getattr(cls, "state_bytes", None)) or ""
    else:  # torch's own class: its rule is torch's documentation; the registry states the bytes
        lines.append(f"torch's own `{cls.__name__}` (see PyTorch's documentation for its update rule).\n")
        state_doc = inspect.getdoc(spec.state_bytes_fn) or ""
    if state_doc:
        lines.append("State memory:\n\n" + _block(state_doc))
    return "\n".join(lines)


def _kind_section(name: str) -> str:
    spec = FACTOR_KINDS[name]
    layer = spec.layer
    facts = [f"layer `{layer.__module__}.{layer.__name__}`"]
    for flag, words in (
        ("frozen_dense", "a frozen dense W0"),
        ("sparse", "a fixed random sparse part"),
        ("merges_at_restart", "merges into W0 at restarts"),
        ("warm_starts", "a full-rank warm start"),
    ):
        if getattr(spec, flag):
            facts.append(words)
    facts.append("refactorizable" if spec.refactorizable else "not refactorizable")
    starts = {
        "keep": "from pretrained weights: W is W0, B = 0",
        "svd": "from pretrained weights: W's truncated SVD",
    }
    facts.append(starts.get(spec.pretrained_start, "no start from pretrained weights"))
    return "\n".join([f"## `{name}`\n", "; ".join(facts) + ".\n", _block(inspect.getdoc(layer) or "")])


def methods_page() -> str:
    """Every registered optimizer (`optimizers.METHODS`) and factor kind
    (`effpretrain.models.FACTOR_KINDS`): its class, the registry's facts, the class's update rule
    and its state formula, from their docstrings."""
    head = (
        "# Methods reference\n\n"
        "Generated from the registries: `optimizers.METHODS` (one `MethodSpec` per optimizer) and "
        "`effpretrain.models.FACTOR_KINDS` (one `FactorSpec` per factorization). Each entry is the "
        "class's own docstring: its update rule, the paper symbol of each argument, its source, and "
        "its exact state-memory formula, which a test checks against the real state. "
        "[Methods](../methods.md) explains how they compare and how to add one.\n\n"
        "# Optimizers\n\n"
    )
    body = "\n".join(_method_section(n) for n in optimizers.METHODS)
    kinds = "\n".join(_kind_section(k) for k in FACTOR_KINDS)
    return head + body + "\n# Factorizations\n\n" + kinds


def models_page() -> str:
    """Every preset (`effpretrain.models.PRESETS`) with its shape and parameter count (counted on
    the model built on the meta device), and the supported architectures."""
    rows = [
        "| preset | architecture | hidden | MLP | layers | heads | KV heads | head size | vocab | tied | q/k/v bias | parameters |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in PRESETS.items():
        params = sum(math.prod(p.shape) for p in model_param_shapes(s))
        cells = [name, s.architecture, s.hidden, s.intermediate, s.layers, s.heads, s.kv, s.dim, s.vocab]
        cells += ["yes" if s.tied else "no", "yes" if s.qkv_bias else "no", f"{params:,}"]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return (
        "# Models reference\n\n"
        "Generated from `effpretrain.models.PRESETS`; parameter counts are those of the model built "
        "(on the meta device) at the preset's vocabulary. A run with the built-in tokenizer uses "
        "its vocabulary instead (`data.vocab_size`). `model.config` builds any model of these "
        "architectures: "
        + ", ".join(f"`{a}`" for a in ARCHITECTURES)
        + ". See [Models](../models.md).\n\n"
        + "\n".join(rows)
        + "\n"
    )


#: The generated pages, by file name under docs/reference/.
PAGES: dict[str, Callable[[], str]] = {
    "config.md": config_page,
    "methods.md": methods_page,
    "models.md": models_page,
}


def write_pages(folder: Path, check: bool = False) -> list[str]:
    """Writes every page into `folder` (or, with `check`, writes nothing); returns the names of
    the pages whose committed text differed."""
    stale = []
    for name, render in PAGES.items():
        path, text = folder / name, render()
        if not path.is_file() or path.read_text() != text:
            stale.append(name)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    return stale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write the generated docs pages (docs/reference/).")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "reference")
    p.add_argument("--check", action="store_true", help="exit 1 if a committed page is out of date")
    args = p.parse_args(argv)
    stale = write_pages(args.out, check=args.check)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)} (run python -m effpretrain.reference)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
