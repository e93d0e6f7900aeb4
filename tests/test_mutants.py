"""The mutation table (tests/mutants.py, `make mutants`) matches the code it mutates: each entry's
text occurs exactly once in its file and every test it names exists, so a refactoring that moves
the code fails here, in `make test`, instead of leaving a mutation that can no longer apply."""

from __future__ import annotations

import mutants


def test_every_mutation_applies_to_the_code_and_names_real_tests():
    assert mutants.check_table() == []


def test_the_table_catches_its_own_mistakes(tmp_path):
    """`check_table` reports text that is absent or repeated, and a test that does not exist."""
    (tmp_path / "m.py").write_text("a = 1\na = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_y():\n    pass\n")
    table = (
        mutants.Mutation("twice", "c", "m.py", "a = 1", "a = 2", ("tests/test_x.py::test_y",)),
        mutants.Mutation("absent", "c", "m.py", "b = 1", "b = 2", ("tests/test_x.py::test_z",)),
    )
    problems = mutants.check_table(table, tmp_path)
    assert any("twice: its text occurs 2 times" in p for p in problems)
    assert any("absent: its text occurs 0 times" in p for p in problems)
    assert any("absent: no test tests/test_x.py::test_z" in p for p in problems)


def test_the_acceptance_files_each_claim_resume():
    """A resume that restores nothing must fail a test in each file that claims exact resume."""
    (resume,) = [m for m in mutants.MUTATIONS if m.name == "resume-noop"]
    files = {f.split("/")[-1] for f in resume.files()}
    assert {
        "test_models.py",
        "test_trainer.py",
        "test_in_backward.py",
        "test_reliability.py",
        "test_compile.py",
        "test_distributed.py",
        "test_fsdp2.py",
        "test_in_backward_dist.py",
    } <= files
