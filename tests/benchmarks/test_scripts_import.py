"""Every benchmark script loads (its imports resolve) without running, and its command line answers
--help: a script's broken import once went unnoticed because no test loaded it."""

from __future__ import annotations

import pytest
from _common import ROOT
from bench_scripts import load

BENCHMARKS = ROOT / "benchmarks"
# Helper modules beside the scripts, imported by them, with no command line of their own (the
# files starting with "_", and the leaderboard package under benchmarks/leaderboard/, are not
# globbed at all).
HELPERS = {"gpu_report": "gpu_check.py's result files and docs page"}
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))
COMMANDS = [s for s in SCRIPTS if s not in HELPERS]


def test_every_script_is_guarded_and_every_other_file_is_a_known_helper():
    assert COMMANDS, "no benchmark scripts found"
    for stem in SCRIPTS:
        guarded = 'if __name__ == "__main__":' in (BENCHMARKS / f"{stem}.py").read_text()
        assert guarded == (stem not in HELPERS), f"benchmarks/{stem}.py"


@pytest.mark.parametrize("stem", COMMANDS)
def test_script_loads_and_answers_help(stem, capsys):
    module = load(stem)  # executes the file under its own module name: the __main__ guard holds
    capsys.readouterr()
    assert callable(getattr(module, "main", None)), f"benchmarks/{stem}.py has no callable main"
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "--help" in out


@pytest.mark.parametrize("stem", sorted(HELPERS))
def test_helper_module_loads(stem):
    assert load(stem).__doc__
