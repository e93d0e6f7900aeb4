"""The GPU check's files: its rows as JSON and markdown tables with their provenance, and the docs'
"On a GPU" page rendered from the committed JSON (`benchmarks/gpu_check.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("numerics", "memory", "step_7b", "in_backward_fsdp2", "speed", "hf")


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k} {_cell(x)}" for k, x in v.items())
    if isinstance(v, list):
        return ", ".join(map(str, v)) or "-"
    return str(v)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and k not in ("measured", "estimated")]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]


def markdown(section: str, prov: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The section's rows as tables (one per run of rows of the same kind: cases, then ratios)."""
    head = f"### {section}\n\n{prov['device']}; commit {prov['commit']}; torch {prov['torch']}, CUDA {prov['cuda']}\n"
    groups: list[list[dict[str, Any]]] = []
    for r in rows:
        kind = r["case"].split(" ")[0] == "ratios"
        if not groups or (groups[-1][0]["case"].split(" ")[0] == "ratios") != kind:
            groups.append([])
        groups[-1].append(r)
    return head + "".join("\n" + "\n".join(_table(g)) + "\n" for g in groups)


def write_section(out: Path, section: str, prov: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{section}.json").write_text(json.dumps({**prov, "section": section, "rows": rows}, indent=2))
    (out / f"{section}.md").write_text(markdown(section, prov, rows))


README_START, README_END = "<!-- gpu-check:start", "<!-- gpu-check:end -->"
RESULTS = ROOT / "benchmarks" / "results" / "gpu-check"


def render_results(results: Path = RESULTS) -> str:
    """The docs' "On a GPU" results (docs/gpu.md): every section's tables, rendered again from its committed
    JSON (never typed), or a line saying that no GPU run is committed yet."""
    parts = []
    for section in SECTIONS:
        path = results / f"{section}.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            prov = {k: saved.get(k) for k in ("commit", "device", "torch", "cuda")}
            parts.append(markdown(section, prov, saved["rows"]).replace("### ", "#### ", 1))
    if not parts:
        return "No GPU run is committed yet: `benchmarks/results/gpu-check/` is empty.\n"
    return "\n".join(parts)


def update_readme(readme: Path = ROOT / "docs" / "gpu.md", results: Path = RESULTS) -> bool:
    """Replaces the text between the gpu-check markers of the docs' "On a GPU" page with
    `render_results`; returns whether the file changed. A missing marker is bad input (nothing is
    written)."""
    text = readme.read_text()
    start = text.find(README_START)
    end = text.find(README_END, start + 1) if start >= 0 else -1
    if start < 0 or end < 0:
        raise SystemExit(
            f"gpu_check: error: {readme} lacks the markers '{README_START} -->' and '{README_END}'"
        )
    body = text.index("\n", start) + 1
    new = text[:body] + render_results(results) + text[end:]
    if new != text:
        readme.write_text(new)
    return new != text
