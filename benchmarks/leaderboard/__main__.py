"""``python benchmarks/leaderboard`` runs the command line too."""

from leaderboard.cli import cli

cli()
