import pytest

from resilient_training.run import config as cfg


def test_argv_round_trip_is_exact():
    config = cfg.TrainConfig(run_dir="/tmp/x", steps=7, checkpoint=cfg.CheckpointConfig(async_save=False),
                             faults="sigkill@3:1", model=cfg.ModelConfig(d_model=32, n_heads=2))
    assert cfg.from_argv(cfg.to_argv(config)) == config
    assert cfg.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"checkpoint_every": 0}, "checkpoint_every must be a positive"),
        ({"steps": 0}, "steps must be positive"),
        ({"pg_timeout": 7.0}, "pg_timeout"),
        ({"heartbeat_timeout": 5.0}, "must exceed soft_timeout"),
        ({"keep_last": 0}, "keep_last"),
    ],
)
def test_bad_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cfg.from_dict({"run_dir": "/tmp/x", **kwargs})


def test_task_and_task_args_round_trip_through_flags_and_data():
    config = cfg.from_argv(["--run-dir", "/tmp/x", "--task", "my_pkg.train:task", "--task-arg", "width=8",
                            "--task-arg", "data=/fsx/*.txt=x"])
    assert config.task == "my_pkg.train:task" and config.task_args == {"width": "8", "data": "/fsx/*.txt=x"}
    assert cfg.from_argv(cfg.to_argv(config)) == config
    assert cfg.from_dict(config.to_dict()) == config
    # as KFP sends them: a Struct (numbers arrive as floats), or the flags' KEY=VALUE list
    assert cfg.from_dict({"run_dir": "r", "task_args": {"width": 8.0, "lr": 0.5}}).task_args == {"width": "8",
                                                                                                 "lr": "0.5"}
    assert cfg.from_dict({"run_dir": "r", "task_args": ["a=1"]}).task_args == {"a": "1"}
    assert cfg.TrainConfig(run_dir="r").task == cfg.DEFAULT_TASK


@pytest.mark.parametrize(("data", "message"), [
    ({"task": "no_colon"}, "must be MODULE:ATTR"),
    ({"task": "mod:"}, "must be MODULE:ATTR"),
    ({"task_args": ["novalue"]}, "is not KEY=VALUE"),
    ({"task_args": {"k": [1]}}, "must be a string or number"),
    ({"task_args": 3}, "must be a mapping or a list"),
])
def test_bad_task_settings_are_clear_errors(data, message):
    with pytest.raises(ValueError, match=message):
        cfg.from_dict({"run_dir": "r", **data})


def test_model_heads_must_divide_width():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        cfg.ModelConfig(d_model=30, n_heads=4)
