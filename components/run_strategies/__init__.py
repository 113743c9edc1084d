# Lazy re-export (see components/provision_storage/__init__.py for why).
def __getattr__(name: str):
    if name == "run_strategies":
        from resilient_training.components.run_strategies.component import run_strategies

        return run_strategies
    raise AttributeError(name)


__all__ = ["run_strategies"]
