import pytest

from resilient_training.bench.strategy import DEFAULT_STRATEGIES, parse_strategy, run_strategies
from resilient_training.run.storage_ref import StorageRef


def test_default_strategies_parse_and_name_distinct_directories():
    names = [parse_strategy(s)[0] for s in DEFAULT_STRATEGIES]
    assert len(set(names)) == len(names) == 4
    assert parse_strategy({"name": "sync", "async_checkpoint": False}) == ("sync", {"async_checkpoint": False})


@pytest.mark.parametrize(
    ("strategy", "message"),
    [({"inprocess": True}, "strategy name ''"), ({"name": "../up"}, "strategy name '../up'"),
     ({"name": "x", "run_dir": "/tmp"}, "run_dir is chosen by the benchmark")],
)
def test_bad_strategies_are_refused(strategy, message):
    with pytest.raises(ValueError, match=message):
        parse_strategy(strategy)


def test_duplicate_or_missing_strategies_are_refused_before_training(tmp_path):
    ref = StorageRef(backend="local", run_dir=str(tmp_path)).to_json()
    with pytest.raises(ValueError, match="must be unique: a"):
        run_strategies(strategies=[{"name": "a"}, {"name": "a"}], storage_ref=ref, run_id="r")
    with pytest.raises(ValueError, match="no strategies"):
        run_strategies(strategies=[], storage_ref=ref, run_id="r")
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_each_strategy_trains_in_its_own_directory_and_a_failed_one_is_still_returned(tmp_path):
    ref = StorageRef(backend="local", run_dir=str(tmp_path / "bench")).to_json()
    dirs = run_strategies(
        strategies=[{"name": "sync", "async_checkpoint": False},
                    {"name": "doomed", "faults": "exception@2:0x9", "max_inprocess_restarts": 1, "max_restarts": 0}],
        storage_ref=ref, run_id="r1", train={"steps": 4, "checkpoint_every": 2}, procs_per_node=1,
        progress=lambda line: None,
    )
    assert dirs == [str(tmp_path / "bench" / "sync"), str(tmp_path / "bench" / "doomed")]
    assert (tmp_path / "bench" / "sync" / "checkpoints" / "step_4" / "manifest.json").is_file()
    assert not (tmp_path / "bench" / "doomed" / "checkpoints" / "step_4").exists()
