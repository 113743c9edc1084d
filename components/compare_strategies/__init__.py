# Lazy re-export (see components/provision_storage/__init__.py for why).
def __getattr__(name: str):
    if name == "compare_strategies":
        from resilient_training.components.compare_strategies.component import compare_strategies

        return compare_strategies
    raise AttributeError(name)


__all__ = ["compare_strategies"]
