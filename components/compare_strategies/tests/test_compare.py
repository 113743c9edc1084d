import json

import pytest

from resilient_training.bench.compare import compare, markdown_table, render_html, text_table


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, trainer_runs):
    """The session's shared trainer runs under the names of two strategies: one without faults
    (learning rate 0, which the comparison does not judge) and one with an exception.
    """
    root = tmp_path_factory.mktemp("bench")
    (root / "plain").symlink_to(trainer_runs / "no-learning", target_is_directory=True)
    (root / "faulted").symlink_to(trainer_runs / "faulted", target_is_directory=True)
    return root


@pytest.mark.slow
def test_rows_come_from_each_event_log(two_runs, tmp_path):
    rows = compare([str(two_runs / "plain"), str(two_runs / "faulted"), str(tmp_path / "missing")])
    plain, faulted, missing = rows
    assert plain["strategy"] == "plain" and plain["status"] == "completed" and plain["layers"] == "none"
    assert faulted["layers"] == "inprocess 1" and faulted["recovery_mean_s"] > 0
    assert 0 < faulted["training_goodput"] <= 1
    assert missing["status"].startswith("no usable event log")
    table = text_table(rows)
    assert table.splitlines()[0].startswith("strategy") and "inprocess 1" in table
    assert markdown_table(rows).count("\n") == 4
    page = render_html(rows)
    assert page.count("data:image/png;base64,") == 2 and "http" not in page.replace("http-equiv", "")
    json.dumps(rows)


def test_compare_component_runs_locally(kfp_local, two_runs):
    from resilient_training.components.compare_strategies import compare_strategies

    task = compare_strategies(run_dirs=[str(two_runs / "plain")])
    assert task.outputs["Output"].splitlines()[2].startswith("plain")
    assert (kfp_local.rglob("comparison").__next__()).read_text().startswith("<!doctype html>")
