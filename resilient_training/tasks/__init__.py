"""Built-in training tasks (see :mod:`resilient_training.runtime.task` for the interface)."""
