"""The resilience report: the component (`resilience_report`) and its plain function."""

__all__ = ["resilience_report"]


def __getattr__(name: str):
    # Imported lazily: inside a running component KFP sets _KFP_RUNTIME and kfp.dsl has no
    # `component` decorator, while the component body imports this package's plain module.
    if name == "resilience_report":
        from resilient_training.components.resilience_report.component import resilience_report

        return resilience_report
    raise AttributeError(name)
