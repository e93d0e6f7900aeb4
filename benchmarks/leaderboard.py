"""The leaderboard's command line (the package `benchmarks/leaderboard/`, whose docstring says what
it does):

    python benchmarks/leaderboard.py --grid tiny --sweep lr=x0.25,x0.5,x1,x2,x4 --seeds 0,1,2 --jobs 2 \\
        --out benchmarks/results/tiny-cpu-study
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from leaderboard.cli import cli, main  # noqa: E402, F401  (the package beside this file; main for callers)

if __name__ == "__main__":
    cli()
