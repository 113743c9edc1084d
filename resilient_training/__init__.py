"""Resilient distributed training: NVRx-wrapped FSDP trainer, checkpoint contract, event log."""

__version__ = "0.1.0"
