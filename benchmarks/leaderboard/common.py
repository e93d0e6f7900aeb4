"""Shared by the leaderboard modules: paths, the grids and their budgets, file names, bad input."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
GRIDS = {
    "tiny": ("tiny",),
    "llama_60m": ("llama_60m",),
    "paper": ("llama_60m", "llama_130m", "llama_350m", "llama_1b"),
}
#: Overrides a named grid applies to every run before --set: the tiny preset's budget floors hold
#: (16 x 128 = 2,048 tokens per step) whatever the recipes say.
GRID_OVERRIDES = {"tiny": ("data.seq_len=128", "train.batch_size=16", "train.grad_accum=1")}
#: --tokens when a named grid is run without it: 512 steps of 2,048 tokens for tiny; the
#: benchmark's 11,000 steps of 512 x 256 tokens at 60M.
GRID_TOKENS = {"tiny": 1_048_576, "llama_60m": 11_000 * 512 * 256}
#: Budget floors: fewer tokens per step or fewer steps per final run than these draw a warning
#: (stderr and LEADERBOARD.md): below them the tiny study's ranking is noise and warm-up.
MIN_TOKENS_PER_STEP = 2_000
MIN_STEPS = 500
BASELINE = "adamw"
RUN_RECORD = "leaderboard_run.json"  # the planned spec, written into each run dir
ERROR_FILE = "leaderboard_error.txt"  # written by the grid when a run fails
TIMING_FILE = "leaderboard_timing.json"  # seconds in evaluation and restarts, measured by the grid
PLOTS = {
    "memory_vs_ppl.png": "memory vs validation perplexity (Pareto front)",
    "val_curves.png": "validation perplexity vs tokens",
    "memory_breakdown.png": "estimated memory breakdown",
}
TELEMETRY_KEYS = ("opt/refreshes", "opt/refresh_s", "opt/restarts", "opt/restart_s", "opt/step_s")


class BadInput(ValueError):
    """A bad argument or path: reported in one line, exit code 2."""
