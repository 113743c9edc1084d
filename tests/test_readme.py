"""README claims that code can check: the two set-up commands, CI running the same test command,
and a parameters table that lists every parameter of the pipeline."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_gives_exactly_two_setup_commands_and_ci_runs_the_test_one():
    blocks = re.findall(r"```\n(.*?)```", README, flags=re.S)
    commands = [b.strip() for b in blocks if b.strip() in ("make demo", "make test")]
    assert commands == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_parameters_table_lists_every_pipeline_parameter():
    import inspect

    from resilient_training.pipelines import PIPELINES

    table = README.split("### Parameters of the `resilient-training` pipeline")[1].split("\n## ")[0]
    documented = set(re.findall(r"`([a-z_]+)`", table))
    parameters = set(inspect.signature(PIPELINES["resilient-training"].pipeline_func).parameters)
    assert parameters - documented == set()
