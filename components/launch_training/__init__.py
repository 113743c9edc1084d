# Lazy re-export (see components/provision_storage/__init__.py for why).
def __getattr__(name: str):
    if name == "launch_training":
        from resilient_training.components.launch_training.component import launch_training

        return launch_training
    raise AttributeError(name)


__all__ = ["launch_training"]
