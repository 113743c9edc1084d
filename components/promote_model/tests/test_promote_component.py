"""The promote_model component through the KFP local runner, alone and behind the gates."""

import json
from pathlib import Path

import pytest
from kfp import dsl

from resilient_training.components.check_convergence import check_convergence
from resilient_training.components.promote_model import promote_model
from resilient_training.components.resilience_report import resilience_report
from resilient_training.components.validate_checkpoint import validate_checkpoint
from resilient_training.gates.convergence import check_convergence as check_fn
from resilient_training.gates.convergence import write_convergence_record
from resilient_training.gates.promote import read_promotion
from resilient_training.gates.validate import validate, write_validation_record
from tests.support.gates import copy_run


def test_component_promotes_a_gated_trainer_checkpoint(kfp_local: Path, trainer_runs: Path, tmp_path: Path) -> None:
    run = copy_run(trainer_runs / "killed-mid-save", tmp_path / "run")
    write_validation_record(run, validate(run))
    write_convergence_record(run, check_fn(run))
    dest = tmp_path / "models" / "gpt"
    task = promote_model(checkpoint=str(run), dest=str(dest))
    assert task.outputs["Output"] == str(dest)
    model = task.outputs["model"]
    assert model.metadata["step"] == 30 and model.metadata["already_promoted"] is False
    assert read_promotion(str(dest))["source"]["checkpoint"] == "checkpoints/step_30"
    outcome = json.loads(Path(task.outputs["promotion"].path).read_text())["outcome"]
    assert outcome["bytes"] > 1_000_000


def test_component_fails_the_task_when_not_gated(kfp_local: Path, trainer_runs: Path, tmp_path: Path) -> None:
    run = copy_run(trainer_runs / "faulted", tmp_path / "run")
    with pytest.raises(RuntimeError, match="promote-model"):
        promote_model(checkpoint=str(run), dest=str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


@dsl.pipeline
def gated(run_dir: str, dest: str):
    """validate -> check convergence -> [both passed] promote; the report always."""
    valid = validate_checkpoint(run_dir=run_dir)
    gate = check_convergence(run_dir=run_dir).after(valid)
    with dsl.If(valid.outputs["Output"] == True):  # noqa: E712 - a KFP condition, not a Python comparison
        with dsl.If(gate.outputs["Output"] == True):  # noqa: E712
            promote_model(checkpoint=run_dir, dest=dest)
    resilience_report(run_dir=run_dir).after(gate)


@pytest.mark.parametrize(("name", "promoted"), [("faulted", True), ("tampered-restore", False)])
def test_promotion_runs_only_behind_passing_gates(kfp_local: Path, trainer_runs: Path, tmp_path: Path,
                                                  name: str, promoted: bool) -> None:
    run = copy_run(trainer_runs / name, tmp_path / "run")
    dest = tmp_path / "promoted"
    gated(run_dir=str(run), dest=str(dest))
    assert (read_promotion(str(dest)) is not None) is promoted
    assert dest.exists() is promoted
    assert len(list(kfp_local.rglob("report"))) == 1  # the report ran either way
