"""The project documents itself: the generated reference pages are current, README.md stays a
newcomer's page (at most 250 lines), and nothing outside docs/ cites the team's guidance files."""

from __future__ import annotations

import subprocess

from _common import ROOT

from effpretrain.reference import PAGES, write_pages


def test_generated_reference_pages_are_current():
    stale = write_pages(ROOT / "docs" / "reference", check=True)
    assert not stale, f"out of date: {stale}; regenerate with: python -m effpretrain.reference"
    assert set(PAGES) == {p.name for p in (ROOT / "docs" / "reference").glob("*.md")}


def test_every_method_and_kind_is_in_the_methods_reference():
    import optimizers
    from effpretrain.models import FACTOR_KINDS

    page = (ROOT / "docs" / "reference" / "methods.md").read_text()
    for name in [*optimizers.METHODS, *FACTOR_KINDS]:
        assert f"## `{name}`" in page, name


def test_readme_is_a_newcomers_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for command in ("make train", "make test", "make test-fast", "make docs"):
        assert command in readme, command


def test_every_docs_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert pages and all(p in nav for p in pages), [p for p in pages if p not in nav]


def test_nothing_outside_docs_cites_the_guidance_files():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    hits = []
    for name in tracked.stdout.split():
        path = ROOT / name
        if name.startswith("docs/") or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        # (spelled in two halves so that this file does not cite them either)
        if any(f"{stem}.md" in text for stem in ("PAPER", "DESIGN")):
            hits.append(name)
    assert not hits, hits
