"""The import graph of `effpretrain` and `optimizers`: no cycle (function-level imports counted),
`optimizers` never imports `effpretrain`, and every function-level import of a project module is
listed here with its reason (a heavy or optional dependency only)."""

from __future__ import annotations

import ast
from pathlib import Path

from _common import ROOT

PACKAGES = ("effpretrain", "optimizers")

#: (importing module, imported module): why the import waits until the function runs.
LAZY: dict[tuple[str, str], str] = {
    ("effpretrain.cli", "effpretrain.trainer"): (
        "heavy: Accelerate and torch's distributed stack load only for `train` and `eval`"
    ),
    ("effpretrain.cli", "effpretrain.export"): "heavy: exporting loads transformers' model classes",
    ("optimizers", "optimizers.moments_4bit"): (
        "heavy: the registry imports a method's module when its formula is first asked for (as it "
        "imports a class on first use), so that `import optimizers` loads no method"
    ),
    ("effpretrain.export", "effpretrain.models.factored_hf"): (
        "optional: registers the factored classes with transformers' Auto classes, a side effect "
        "only an export of factors wants"
    ),
}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _targets(node: ast.AST, current: str, modules: dict[str, Path]) -> list[str]:
    """The project modules an import statement loads (``from pkg import sub`` names the submodule)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = current.split(".")
            if modules[current].name != "__init__.py":
                here = here[:-1]
            base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    return sorted({n for n in names if n in modules and n != current})


def _edges() -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """Every module's imports of project modules, and which of them are inside a function (an
    ``if TYPE_CHECKING:`` import never runs and is left out)."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    lazy: set[tuple[str, str]] = set()
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
            for n in ast.walk(block)
        }
        in_function = {
            id(n)
            for f in ast.walk(tree)
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)
        }
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                for target in _targets(node, name, modules):
                    edges[name].add(target)
                    if id(node) in in_function:
                        lazy.add((name, target))
    return edges, lazy


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph, or None (depth-first search with colours)."""
    colour: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        colour[node] = 1
        for nxt in sorted(edges[node]):
            if colour.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in colour and (found := visit(nxt, [*path, nxt])):
                return found
        colour[node] = 2
        return None

    for start in sorted(edges):
        if start not in colour and (found := visit(start, [start])):
            return found
    return None


def test_the_import_graph_has_no_cycle():
    edges, _ = _edges()
    assert len(edges) > 50
    assert _cycle(edges) is None, " -> ".join(_cycle(edges) or [])


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_optimizers_never_import_effpretrain():
    edges, _ = _edges()
    bad = [
        (m, t)
        for m, ts in edges.items()
        if m.startswith("optimizers")
        for t in ts
        if t.startswith("effpretrain")
    ]
    assert not bad, bad


def test_every_function_level_import_of_a_project_module_has_its_reason():
    _, lazy = _edges()
    assert lazy == set(LAZY), (
        f"not listed: {sorted(lazy - set(LAZY))}; listed but gone: {sorted(set(LAZY) - lazy)}"
    )
    assert all(reason.startswith(("heavy:", "optional:")) for reason in LAZY.values())
