"""Leaderboard: runs a grid of recipes at equal tokens and publishes memory, speed and perplexity.

A package of the steps (`plan`, `run`, `collect`, `sweep`, `claims`, `render`, `plots`, `cli`) over
result rows (`collect.ResultRow`); ``python benchmarks/leaderboard.py`` is its command line.

The committed CPU study (benchmarks/results/tiny-cpu-study/) is this command:

    python benchmarks/leaderboard.py --grid tiny --sweep lr=x0.25,x0.5,x1,x2,x4 --seeds 0,1,2 --jobs 2 \
        --out benchmarks/results/tiny-cpu-study

``--grid tiny`` is every ``recipes/tiny/*.yaml`` at 2,048 tokens per step (``data.seq_len=128``,
``train.batch_size=16``) and, by default, 1,048,576 tokens per final run (512 steps); the sweep
trains each method at 0.25x, 0.5x, 1x, 2x and 4x its recipe's lr for a quarter of that (128
steps, seed 0), then three seeds at the best lr. That is 26 x 5 sweep runs (34.1M tokens) and
26 x 3 final runs (81.8M tokens): at about 7,500 tokens/s for two tiny runs at once on a 2-core
CPU, about 4.5 hours, plus about an hour for Muon's Newton-Schulz iterations. (A 3-point grid,
x0.5,x1,x2, left the best lr at an edge for most methods.) The plan's token
count is printed first. The same table at 60M on a GPU (the benchmark's 11,000 steps of 131,072
tokens; the sweep at a quarter of it):

    python benchmarks/leaderboard.py --grid llama_60m --sweep lr=x0.5,x1,x2 --seeds 0,1,2 --out DIR

Other forms:

    python benchmarks/leaderboard.py --grid tiny --tokens 200000 --out DIR [--seeds 0,1]
        [--methods adamw,galore] [--recipes recipes/tiny/adamw.yaml ...] [--set key=value ...]
        [--sweep lr=x0.25,x0.5,x1,x2,x4 | lr=1e-3,3e-3] [--sweep-tokens N] [--sweep-seed K] [--jobs N]
    python benchmarks/leaderboard.py --out DIR          # re-collect and re-render what DIR holds
    python benchmarks/leaderboard.py --out benchmarks/results/tiny-cpu-study --readme README.md
                                                        # also regenerate README.md's excerpt
    python benchmarks/leaderboard.py --paper            # estimator vs the paper's memory table

Each recipe runs once per seed, as ``DIR/runs/<method>-<model>-seed<k>/``, with
``train.max_steps = ceil(tokens / (batch_size * grad_accum * seq_len))`` so that every method sees the
same number of tokens; evaluation is spread over a few points of the run (``--eval-points``).

Learning-rate sweep (``--sweep``): first every method trains each lr of the grid (multiples
``xM`` of its recipe's ``optim.lr``, or absolute values) on ``--sweep-tokens`` (default a quarter of
``--tokens``) at ``--sweep-seed`` (default the first seed), as
``DIR/runs/<method>-<model>-sweep-lr<point>-seed<k>/``; the lr with the lowest final validation
perplexity (ties to the smaller lr; failed or diverged runs never win) is then trained at every
seed on the full budget. A choice at either end of the grid is flagged "edge of grid: widen it".
The choice is a pure function of the sweep rows (`select_lrs`), so it is the same on every
re-invocation.

Seeds and claims: the table gives each method's mean final perplexity and sample standard
deviation over seeds, and its difference from AdamW; two methods differ "within noise" when
|mean_a - mean_b| <= max(sd_a, sd_b) (sd 0 for a single seed). The claims section checks the
benchmark's claims (`CLAIMS`, data) against the final runs (`evaluate_claims`): reproduced, not
reproduced, within noise, or not measured (a method missing), with the numbers.

Budgets: the header states tokens per step, steps and tokens per run of the sweep and the final
runs; fewer than `MIN_TOKENS_PER_STEP` tokens per step, or final runs of fewer than `MIN_STEPS`
steps, are warned about on stderr and in the markdown.

Resuming: a run is skipped when its ``summary.json`` exists or ``DIR/results.jsonl`` holds a
finished row of it, so the committed results alone (run folders deleted, a new machine) re-run
nothing and re-render the same markdown; results.jsonl is rewritten after every run. A run stopped
mid-way with a complete checkpoint is resumed from it. A run that crashes is recorded as an error
and the grid goes on (it is retried on the next invocation).

Runs are trained by `effpretrain.trainer.train` in a forked copy of this process (Linux): the fork
shares the already imported torch/transformers (no per-run import cost), isolates crashes (even a
segfault), and gives every run its own measured peak memory, which on CPU is the process's peak
RSS, a high-water mark that would otherwise carry over from one run to the next. ``--jobs N``
keeps N forked runs going at once, each on cores / N torch threads. The parent does not
initialise CUDA itself (a forked child could not use it then); should something have done so,
runs are trained in-process, one at a time. ``--in-process`` trains in this process always (then
the measured peak of a run is at least that of the runs before it).

Outputs in DIR: ``results.jsonl`` (one line per run: the run's summary plus phase, lr, hardware,
commit, date, config hash, token budget, FLOPs per token, serial decompositions per update,
optimizer telemetry, evaluation and restart seconds and the validation curve), ``LEADERBOARD.md``
(a pure function of those rows) and three plots of the final runs: ``memory_vs_ppl.png`` (with the
Pareto front), ``val_curves.png`` (every method's validation curve, mean over seeds) and
``memory_breakdown.png``.

``--readme FILE`` rewrites the text between FILE's ``<!-- leaderboard:start -->`` and
``<!-- leaderboard:end -->`` markers with `readme_summary` of the rows (per model the top final
runs, then every claim's verdict): the README's leaderboard excerpt is generated, not edited.

Exit codes: 0 all runs finished; 1 some run failed (recorded in the results); 2 bad input.
"""

from __future__ import annotations

from leaderboard.claims import CLAIMS as CLAIMS
from leaderboard.claims import NOISE_RULE as NOISE_RULE
from leaderboard.claims import VERDICTS as VERDICTS
from leaderboard.claims import Claim as Claim
from leaderboard.claims import compare as compare
from leaderboard.claims import evaluate_claims as evaluate_claims
from leaderboard.cli import README_END as README_END
from leaderboard.cli import README_START as README_START
from leaderboard.cli import main as main
from leaderboard.cli import paper_report as paper_report
from leaderboard.cli import readme_span as readme_span
from leaderboard.cli import readme_summary as readme_summary
from leaderboard.cli import render_table_only as render_table_only
from leaderboard.cli import update_readme as update_readme
from leaderboard.collect import MEASURED_KEYS as MEASURED_KEYS
from leaderboard.collect import ResultRow as ResultRow
from leaderboard.collect import collect as collect
from leaderboard.collect import collect_run as collect_run
from leaderboard.collect import cpu_description as cpu_description
from leaderboard.collect import gather_rows as gather_rows
from leaderboard.collect import read_jsonl as read_jsonl
from leaderboard.collect import read_metrics as read_metrics
from leaderboard.collect import serial_cost as serial_cost
from leaderboard.collect import write_jsonl as write_jsonl
from leaderboard.common import BASELINE as BASELINE
from leaderboard.common import ERROR_FILE as ERROR_FILE
from leaderboard.common import GRID_OVERRIDES as GRID_OVERRIDES
from leaderboard.common import GRID_TOKENS as GRID_TOKENS
from leaderboard.common import GRIDS as GRIDS
from leaderboard.common import MIN_STEPS as MIN_STEPS
from leaderboard.common import MIN_TOKENS_PER_STEP as MIN_TOKENS_PER_STEP
from leaderboard.common import PLOTS as PLOTS
from leaderboard.common import RECIPES as RECIPES
from leaderboard.common import RUN_RECORD as RUN_RECORD
from leaderboard.common import TELEMETRY_KEYS as TELEMETRY_KEYS
from leaderboard.common import TIMING_FILE as TIMING_FILE
from leaderboard.common import BadInput as BadInput
from leaderboard.fmt import fmt_bytes as fmt_bytes
from leaderboard.fmt import fmt_count as fmt_count
from leaderboard.fmt import pareto_front as pareto_front
from leaderboard.plan import LrPoint as LrPoint
from leaderboard.plan import RunSpec as RunSpec
from leaderboard.plan import budget_warnings as budget_warnings
from leaderboard.plan import eval_every_for as eval_every_for
from leaderboard.plan import grid_recipes as grid_recipes
from leaderboard.plan import parse_sweep as parse_sweep
from leaderboard.plan import plan_runs as plan_runs
from leaderboard.plan import steps_for_tokens as steps_for_tokens
from leaderboard.plots import plot_all as plot_all
from leaderboard.plots import publish as publish
from leaderboard.render import render_markdown as render_markdown
from leaderboard.run import _cores as _cores
from leaderboard.run import forked_runner as forked_runner
from leaderboard.run import run_forked as run_forked
from leaderboard.run import run_grid as run_grid
from leaderboard.run import timed_events as timed_events
from leaderboard.run import train_spec as train_spec
from leaderboard.sweep import LrChoice as LrChoice
from leaderboard.sweep import select_lrs as select_lrs
