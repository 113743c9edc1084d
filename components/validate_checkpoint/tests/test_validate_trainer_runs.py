"""Validation of checkpoints written by real `resilient-training train` runs: no false alarms, real damage caught."""

from pathlib import Path

import pytest

from resilient_training.gates.validate import validate

HEALTHY = ["faulted", "killed-mid-save", "no-learning", "tampered-restore"]


@pytest.mark.parametrize("name", HEALTHY)
def test_every_committed_checkpoint_of_a_healthy_run_is_valid(trainer_runs: Path, name: str) -> None:
    report = validate(trainer_runs / name, all_checkpoints=True)
    assert report.valid, [str(f) for f in report.all_findings]
    assert len(report.checkpoints) == 3  # keep_last
    for ckpt in report.checkpoints:
        assert len(ckpt.checks) == 11 and ckpt.bytes > 1_000_000


def test_a_run_killed_mid_save_is_valid_and_its_next_round_removed_the_leftover(trainer_runs: Path) -> None:
    report = validate(trainer_runs / "killed-mid-save")
    assert report.valid
    # The killed save's temporary directory is removed when the next launcher round restores.
    assert not [i for i in report.ignored if ".tmp-" in i["path"]]
    assert not list((trainer_runs / "killed-mid-save" / "checkpoints").glob(".tmp-*"))


def test_a_leftover_of_a_process_still_dead_is_ignored_not_failed(trainer_runs: Path, tmp_path: Path) -> None:
    # What a save killed mid-write leaves until a next round exists: a shard still ".partial".
    from tests.support.gates import copy_run

    run = copy_run(trainer_runs / "killed-mid-save", tmp_path / "run")
    leftover = run / "checkpoints" / ".tmp-step_10-0badcafei0"
    leftover.mkdir()
    (leftover / "__1_0.distcp.partial").write_bytes(b"half a shard")
    report = validate(run)
    assert report.valid
    (ignored,) = [i for i in report.ignored if i["path"].startswith("checkpoints/.tmp-step_10-")]
    assert ignored["reason"].startswith("uncommitted") and "__1_0.distcp.partial" in ignored["reason"]


def test_a_tampered_but_consistent_checkpoint_passes_validation(trainer_runs: Path) -> None:
    # Checkpoint and event log rewritten alike: validation proves integrity, not history; the
    # convergence gate catches the restore from it.
    assert validate(trainer_runs / "tampered-restore" / "checkpoints" / "step_30").valid


def test_a_final_checkpoint_rewritten_consistently_is_refused_by_the_run_s_own_log(
        trainer_runs: Path, tmp_path: Path) -> None:
    """The stranger's attack: the last checkpoint (which no restore ever reads) rewritten with
    every checksum re-recorded; the event log untouched.
    """
    from tests.support.gates import copy_run, tamper_with_initial_weights

    run = copy_run(trainer_runs / "faulted", tmp_path / "run")
    tamper_with_initial_weights(run / "checkpoints" / "step_30", forge_log=False)
    report = validate(run)
    assert [(f.code, f.file) for f in report.all_findings] == [("not_committed_by_run", "checkpoints/step_30/manifest.json")]


def test_nan_weights_written_by_the_trainer_are_caught(trainer_runs: Path) -> None:
    report = validate(trainer_runs / "nan", all_checkpoints=True)
    assert not report.valid
    by_step = {c.step: c for c in report.checkpoints}
    assert by_step[5].valid  # saved before the NaN at step 6
    for step in (10, 12):
        findings = by_step[step].findings
        assert [(f.code, f.file) for f in findings] == [
            ("non_finite", f"checkpoints/step_{step}/__0_0.distcp"), ("non_finite", f"checkpoints/step_{step}/__1_0.distcp")]
        assert findings[0].tensor.startswith("model.") and "chunks hold non-finite values" in findings[0].message
