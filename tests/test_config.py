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
    ({"task": "my-pkg:make"}, "is no module name"),  # never importable: refused before any worker starts
    ({"task": "pkg.:make"}, "is no module name"),
    ({"task": "pkg:make.task"}, "is no Python name"),
    ({"task": "tasks/mine:make"}, "does not end in .py"),
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


def test_launch_component_defaults_are_the_trainer_defaults():
    """KFP needs literal defaults in a component's signature; they must be TrainConfig's, not a second source."""
    import inspect

    from resilient_training.components.launch_training import launch_training

    params = inspect.signature(launch_training.python_func).parameters
    defaults = cfg.from_dict({"run_dir": "/x"})
    expected = {"steps": defaults.steps, "checkpoint_every": defaults.checkpoint.every, "faults": defaults.faults,
                "async_checkpoint": defaults.checkpoint.async_save, "inprocess": defaults.restart.inprocess,
                "ft_launcher": defaults.restart.ft_launcher}
    assert {name: params[name].default for name in expected} == expected


def test_flat_and_nested_settings_agree_and_bad_types_are_refused():
    flat = cfg.from_dict({"run_dir": "/x", "checkpoint_every": 7.0, "soft_timeout": 5, "batch_size": 4})
    nested = cfg.from_dict({"run_dir": "/x", "checkpoint": {"every": 7}, "timeouts": {"soft": 5.0},
                            "data": {"batch_size": 4}})
    assert flat == nested and flat.checkpoint.every == 7 and isinstance(flat.timeouts.soft, float)
    for bad, message in [({"model": 5}, "model must be a mapping"), ({"checkpoint_every": 2.5}, "must be an integer"),
                         ({"inprocess": "yes"}, "must be true or false"), ({"lr": float("nan")}, "finite"),
                         ({"steps": True}, "must be an integer"), ({"faults": 3}, "must be a string"),
                         ({"run_dir": ""}, "run_dir must not be empty"), ({"soft_timeout": -1.0}, "soft_timeout"),
                         # Stranger trial: an integer past a double's range raised OverflowError (a traceback).
                         ({"lr": 10**400}, "setting lr must be a finite number, got an integer of 401 digits"),
                         ({"timeouts": {"pg": -10**400}}, "timeouts setting pg must be a finite number"),
                         # A key with a newline made a second "error:" line: quoted, one line.
                         ({"lr\nerror: injected": 1}, r"unknown trainer settings: 'lr\\nerror: injected' \(known"),
                         ({"model": {"x\ny": 1}}, r"unknown model settings: 'x\\ny' \(known")]:
        with pytest.raises(ValueError, match=message):
            cfg.from_dict({"run_dir": "/x", **bad})
