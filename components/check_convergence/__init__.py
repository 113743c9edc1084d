"""The convergence gate: the component (`check_convergence`) and its plain function."""

__all__ = ["check_convergence"]


def __getattr__(name: str):
    # Imported lazily: inside a running component KFP sets _KFP_RUNTIME and kfp.dsl has no
    # `component` decorator, while the component body imports this package's plain module.
    if name == "check_convergence":
        from resilient_training.components.check_convergence.component import check_convergence

        return check_convergence
    raise AttributeError(name)
