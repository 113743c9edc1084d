"""Checkpoint integrity validation: the component and its plain function."""

from resilient_training.components.validate_checkpoint.component import validate_checkpoint

__all__ = ["validate_checkpoint"]
