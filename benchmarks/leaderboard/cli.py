"""The command line: plan, run, collect, render; --readme, --paper."""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from leaderboard.claims import NOISE_RULE, _claim_table, evaluate_claims
from leaderboard.collect import ResultRow, _merge_run, cpu_description, gather_rows, read_jsonl, write_jsonl
from leaderboard.common import BASELINE, GRID_OVERRIDES, GRID_TOKENS, GRIDS, RECIPES, BadInput
from leaderboard.fmt import _groups, _is_ok, _phase, fmt_bytes
from leaderboard.plan import RunSpec, _display_path, budget_warnings, grid_recipes, parse_sweep, plan_runs
from leaderboard.plots import publish
from leaderboard.render import _ranked_cells, render_markdown
from leaderboard.run import Runner, run_grid, train_spec
from leaderboard.sweep import fmt_lr, select_lrs

# CLI


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Run a grid of recipes at equal tokens and publish a leaderboard (or --paper).",
        epilog="With only --out: re-collect DIR/runs (or read DIR/results.jsonl) and re-render.",
    )
    ap.add_argument(
        "--grid",
        choices=sorted(GRIDS),
        help="tiny: recipes/tiny/*.yaml; llama_60m: recipes/llama_60m/*.yaml; paper: recipes/llama_*/",
    )
    ap.add_argument(
        "--recipes", nargs="+", type=Path, default=[], help="recipe files (instead of / beside --grid)"
    )
    ap.add_argument(
        "--tokens",
        type=int,
        help="token budget per final run (default for --grid tiny: 1,048,576 = 512 steps of 2,048 tokens)",
    )
    ap.add_argument("--out", type=Path, help="output folder (runs/, results.jsonl, LEADERBOARD.md, plots)")
    ap.add_argument("--seeds", default="0", help="comma-separated train.seed values (default 0)")
    ap.add_argument("--methods", help="comma-separated methods (recipe stems) to keep")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override applied to every run, e.g. --set data.seq_len=64",
    )
    ap.add_argument(
        "--eval-points", type=int, default=4, help="about how many evaluations per run (default 4)"
    )
    _add_run_args(ap)
    return ap.parse_args(argv)


def _add_run_args(ap: argparse.ArgumentParser) -> None:
    """The sweep, parallelism and output options."""
    ap.add_argument(
        "--sweep",
        metavar="lr=POINTS",
        help="learning-rate sweep before the final runs: lr=x0.5,x1,x2 (multiples of each recipe's lr)"
        " or lr=1e-3,3e-3; the best lr per method (lowest val ppl, ties to the smaller) is carried over",
    )
    ap.add_argument("--sweep-tokens", type=int, help="token budget per sweep run (default: --tokens / 4)")
    ap.add_argument(
        "--sweep-seed", type=int, help="train.seed of the sweep runs (default: the first of --seeds)"
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="forked runs at once, each on cores / jobs torch threads (default 1)",
    )
    ap.add_argument(
        "--in-process", action="store_true", help="train in this process instead of a fork per run"
    )
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument(
        "--readme",
        type=Path,
        help="also rewrite the text between this markdown file's '<!-- leaderboard:start -->' and"
        " '<!-- leaderboard:end -->' markers with the top rows and the claims (README.md)",
    )
    ap.add_argument(
        "--paper",
        action="store_true",
        help="print the estimator-vs-published memory table of the paper recipes (markdown) and exit",
    )


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _readme(args: argparse.Namespace, rows: Sequence[ResultRow]) -> None:
    if args.readme is not None:
        changed = update_readme(args.readme, rows, _display_path(args.out))
        print(f"leaderboard: {'updated' if changed else 'unchanged'}: {args.readme}'s leaderboard section")


def _render_only(out: Path, plots: bool) -> list[ResultRow]:
    """Re-collects DIR/runs (beside the rows of DIR/results.jsonl) or reads the results alone."""
    previous = read_jsonl(out / "results.jsonl") if (out / "results.jsonl").is_file() else []
    if not (out / "runs").is_dir() and not previous:
        raise BadInput(f"{out}: no runs/ and no results.jsonl; pass --grid or --recipes to run a grid")
    names = sorted(p.name for p in (out / "runs").glob("*") if p.is_dir()) if (out / "runs").is_dir() else []
    rows = gather_rows(out, names, previous)
    publish(rows, out, plots=plots)
    print(f"leaderboard: rendered {len(rows)} rows into {out / 'LEADERBOARD.md'}")
    return rows


def _recipes_of(args: argparse.Namespace) -> list[Path]:
    recipes = grid_recipes(args.grid) if args.grid else []
    for r in args.recipes:
        if not r.is_file():
            raise BadInput(f"recipe not found: {r}")
        recipes.append(r)
    return recipes


def main(argv: Sequence[str] | None = None, runner: Runner | None = None) -> int:
    """The command line (see the module docstring); `runner` replaces the training of one run
    (tests), else runs are forked (or trained here with --in-process)."""
    args = _parse_args(argv)
    if args.paper:
        print(paper_report())
        return 0
    if args.out is None:
        raise BadInput("--out DIR is required (or use --paper)")
    out: Path = args.out
    if args.readme is not None:
        readme_span(args.readme)  # checked before anything trains
    if not args.grid and not args.recipes:
        _readme(args, _render_only(out, plots=not args.no_plots))
        return 0
    tokens, seeds = _budget(args)
    plan = functools.partial(
        plan_runs,
        _recipes_of(args),
        methods=[m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None,
        extra_overrides=[*GRID_OVERRIDES.get(args.grid or "", ()), *args.overrides],
        eval_points=args.eval_points,
    )
    sweep: list[RunSpec] = []
    if args.sweep:
        sweep_tokens = args.sweep_tokens if args.sweep_tokens is not None else max(1, tokens // 4)
        sweep_seed = args.sweep_seed if args.sweep_seed is not None else seeds[0]
        sweep = plan(sweep_tokens, [sweep_seed], sweep=parse_sweep(args.sweep))
    final = plan(tokens, seeds)  # at the recipes' lr: the budget is the same at any lr
    _print_plan(sweep, final)
    previous = read_jsonl(out / "results.jsonl") if (out / "results.jsonl").is_file() else []
    finished = {r["run"]: r for r in previous}
    runner = runner or (train_spec if args.in_process else None)
    names = [s.name for s in sweep]
    save = _saver(out, previous)
    failed = run_grid(sweep, out, runner, finished=finished, jobs=args.jobs, after_each=save)["failed"]
    if sweep:
        final = plan(tokens, seeds, lrs=_chosen_lrs(out, names, previous))
    names += [s.name for s in final]
    failed += run_grid(final, out, runner, finished=finished, jobs=args.jobs, after_each=save)["failed"]
    rows = gather_rows(out, names, previous)
    publish(rows, out, plots=not args.no_plots)
    print(f"leaderboard: wrote {out / 'results.jsonl'} and {out / 'LEADERBOARD.md'}")
    _readme(args, rows)
    print(render_table_only(rows))
    return 1 if failed else 0


def _budget(args: argparse.Namespace) -> tuple[int, list[int]]:
    """The final runs' token budget and seeds (bad input when missing)."""
    tokens = args.tokens if args.tokens is not None else GRID_TOKENS.get(args.grid or "")
    if tokens is None:
        raise BadInput("--tokens BUDGET is required to run a grid")
    if args.jobs < 1:
        raise BadInput(f"--jobs must be >= 1, got {args.jobs}")
    seeds = _int_list(args.seeds, "--seeds")
    if not seeds:
        raise BadInput("--seeds: expected at least one seed")
    return tokens, seeds


def _print_plan(sweep: list[RunSpec], final: list[RunSpec]) -> None:
    for w in budget_warnings([*sweep, *final]):
        print(f"warning: {w}", file=sys.stderr)
    print(
        f"leaderboard: plan: {len(sweep)} sweep runs ({sum(s.steps * s.tokens_per_step for s in sweep):,} tokens)"
        f" + {len(final)} final runs ({sum(s.steps * s.tokens_per_step for s in final):,} tokens)"
    )


def _saver(out: Path, previous: list[ResultRow]) -> Callable[[RunSpec], None]:
    """After each run: results.jsonl rewritten with it (commit it while a long grid goes on)."""
    current = {r["run"]: r for r in previous}

    def save(spec: RunSpec) -> None:
        _merge_run(current, out / "runs" / spec.name)
        write_jsonl([current[k] for k in sorted(current)], out / "results.jsonl")

    return save


def _chosen_lrs(out: Path, names: list[str], previous: list[ResultRow]) -> dict[tuple[str, str], float]:
    """Each method's learning rate from this grid's sweep rows (not an earlier, other sweep's)."""
    planned = set(names)
    choices = select_lrs(r for r in gather_rows(out, names, previous) if r["run"] in planned)
    for c in choices.values():
        note = f" (edge of grid: {c.edge} lr; widen it)" if c.edge else ""
        print(
            f"leaderboard: {c.method} on {c.model}: lr {fmt_lr(c.lr)}{note}"
            if c.lr
            else f"leaderboard: {c.method} on {c.model}: no sweep run finished, no final runs"
        )
    return {k: c.lr for k, c in choices.items() if c.lr is not None}


def paper_report(recipes_root: Path | None = None) -> str:
    """The --paper document: what produced it (command, commit, machine), then the table of
    `effpretrain.paper` computed from the paper recipes under `recipes_root` (default `RECIPES`)."""
    import torch

    from effpretrain.memory import published as paper
    from effpretrain.reporting import git_commit

    rows = paper.paper_memory_table(recipes_root=recipes_root or RECIPES)
    return "\n".join(
        [
            "# Weight + optimizer memory at the paper sizes: the estimator vs the published figures",
            "",
            "- Command: `python benchmarks/leaderboard.py --paper` (an analytic estimate on the meta device)",
            f"- Code: commit {git_commit()}, {dt.datetime.now(dt.timezone.utc):%Y-%m-%d}",
            f"- Machine: {cpu_description()}; torch {torch.__version__}",
            "- Counting: bf16 weights + optimizer state, GB = 1e9 bytes, gradients and activations not"
            " counted, vocabulary 32,000; ranks, factorization and density from each"
            " `recipes/<size>/<method>.yaml`. \"benchmark's count\" counts the state the method's"
            ' official code holds (the note says where that is more than ours); "effpretrain holds" is ours.',
            "",
            paper.format_paper_table(rows, paper.skipped_methods()),
        ]
    )


README_START = "<!-- leaderboard:start"
README_END = "<!-- leaderboard:end -->"


def readme_summary(rows: Sequence[ResultRow], source: str, top: int = 10) -> str:
    """The README's leaderboard excerpt, a pure function of the rows: per model the `top` final
    runs (rank, method, lr, perplexity over seeds, difference from the baseline, measured peak
    tensor memory and optimizer state) and every claim's verdict with its numbers.

    Args:
        rows: results.jsonl rows.
        source: the folder the rows come from, as the excerpt names it (a relative path).
        top: how many ranked methods to show per model.
    """
    ok = [r for r in rows if _is_ok(r)]
    final = [r for r in ok if _phase(r) == "final"]
    commits = sorted({r.get("git_commit") or "unknown" for r in ok})
    hardware = sorted({r.get("hardware") or "unknown" for r in ok})
    out = [
        f"Generated from `{source}/results.jsonl` by `benchmarks/leaderboard.py --out {source}"
        f" --readme README.md` ({len(final)} final and {len(ok) - len(final)} sweep runs; hardware:"
        f" {'; '.join(hardware) or '-'}; commits: {', '.join(commits) or '-'}). The full table, the"
        f" sweep and the budgets are in `{source}/LEADERBOARD.md`.",
        "",
    ]
    groups = _groups(ok)
    if not groups:
        out += ["No final run has finished yet: the study is still in its learning-rate sweep.", ""]
    for model, gs in groups.items():
        base = next((g for g in gs if g.method == BASELINE), None)
        shown = gs[:top]
        out += [
            f"**{model}**: the {len(shown)} best of {len(gs)} methods by mean validation perplexity.",
            "",
            f"| # | method | lr | val ppl | vs {BASELINE} | peak tensor memory | optimizer state |",
            "|---|---|---|---|---|---|---|",
        ]
        for rank, g in enumerate(shown, 1):
            cells = [
                *_ranked_cells(rank, g, base),
                fmt_bytes(g.mean("measured", "peak")),
                fmt_bytes(g.mean("measured", "optimizer_state")),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    claims = evaluate_claims(ok)
    if claims:
        out += [f"The benchmark's claims ({NOISE_RULE}):", "", *_claim_table(claims)]
    return "\n".join(out)


def readme_span(readme: Path) -> tuple[str, int, int]:
    """`readme`'s text and the (start, end) offsets of the text between its leaderboard markers;
    bad input when the file or a marker is missing."""
    if not readme.is_file():
        raise BadInput(f"--readme: {readme} not found")
    text = readme.read_text()
    start = text.find(README_START)
    end = text.find(README_END, start + 1) if start >= 0 else -1
    if start < 0 or end < 0 or "\n" not in text[start:end]:
        raise BadInput(f"--readme: {readme} lacks the markers '{README_START} -->' and '{README_END}'")
    return text, text.index("\n", start) + 1, end


def update_readme(readme: Path, rows: Sequence[ResultRow], source: str) -> bool:
    """Replaces the text between the README's leaderboard markers with `readme_summary`; returns
    whether the file changed. Missing markers are bad input (nothing is written)."""
    text, body_at, end = readme_span(readme)
    new = text[:body_at] + readme_summary(rows, source) + text[end:]
    if new != text:
        readme.write_text(new)
    return new != text


def render_table_only(rows: Sequence[ResultRow]) -> str:
    """The ranked tables of the markdown, for the terminal."""
    md = render_markdown(rows)
    return "\n".join(line for line in md.splitlines() if line.startswith(("|", "##")))


def cli() -> None:
    try:
        code = main()
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    cli()
