"""The convergence gate on real trainer runs: passes clean faulted runs, fails the broken ones."""

from pathlib import Path

import pytest

from resilient_training.gates.convergence import check_convergence


@pytest.mark.parametrize("name", ["faulted", "killed-mid-save"])
def test_clean_faulted_runs_pass(trainer_runs: Path, name: str) -> None:
    verdict = check_convergence(trainer_runs / name)
    assert verdict.passed, verdict.format()
    continuity = verdict.check("continuity")
    assert continuity.values["checked"] == 2 and continuity.values["max_deviation"] == 0.0  # bit-exact replay
    assert {r["basis"] for r in verdict.recoveries} == {"replayed step"}


def test_tampered_restore_fails_continuity(trainer_runs: Path) -> None:
    verdict = check_convergence(trainer_runs / "tampered-restore")
    assert not verdict.passed
    c = verdict.check("continuity")
    assert not c.passed and c.values["failed"] == 2 and c.values["restores"] == 4  # the in-process one was fine
    bad = [r for r in verdict.recoveries if not r["passed"]]
    assert {(r["restored_step"], r["first_step"], r["basis"]) for r in bad} == {(30, 31, "restored step")}
    assert all(r["deviation"] > 0.15 for r in bad)


def test_nan_run_fails(trainer_runs: Path) -> None:
    verdict = check_convergence(trainer_runs / "nan")
    f = verdict.check("finite")
    assert not verdict.passed and not f.passed and f.values["first_bad_step"] == 6


def test_run_that_did_not_learn_fails(trainer_runs: Path) -> None:
    verdict = check_convergence(trainer_runs / "no-learning")
    assert not verdict.passed
    assert verdict.check("finite").passed and verdict.check("continuity").skipped
    assert not verdict.check("improvement").passed and verdict.check("improvement").values["improvement"] < 0.02
    assert not verdict.check("final_loss").passed


def test_faulted_run_matches_its_uninterrupted_twin(trainer_runs: Path) -> None:
    # Same seed and data: the killed-mid-save run (launcher restart) is a reference for the
    # in-process-restarted one, step for step.
    verdict = check_convergence(trainer_runs / "faulted", reference_dir=trainer_runs / "killed-mid-save")
    ref = verdict.check("reference")
    assert ref.passed and ref.values["common_steps"] == 30 and ref.values["max_deviation"] == 0.0
    against_nan = check_convergence(trainer_runs / "faulted", reference_dir=trainer_runs / "nan").check("reference")
    assert not against_nan.passed
