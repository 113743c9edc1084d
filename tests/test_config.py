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


def test_model_heads_must_divide_width():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        cfg.ModelConfig(d_model=30, n_heads=4)
