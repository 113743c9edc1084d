"""Checkpoint integrity validation: the component (`validate_checkpoint`) and its plain function."""

__all__ = ["validate_checkpoint"]


def __getattr__(name: str):
    # Imported lazily: inside a running component KFP sets _KFP_RUNTIME and kfp.dsl has no
    # `component` decorator, while the component body imports this package's plain module.
    if name == "validate_checkpoint":
        from resilient_training.components.validate_checkpoint.component import validate_checkpoint

        return validate_checkpoint
    raise AttributeError(name)
