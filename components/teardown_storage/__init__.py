# Lazy re-export (see components/provision_storage/__init__.py for why).
def __getattr__(name: str):
    if name == "teardown_storage":
        from resilient_training.components.teardown_storage.component import teardown_storage

        return teardown_storage
    raise AttributeError(name)


__all__ = ["teardown_storage"]
