"""Gated promotion: the component (`promote_model`) and its plain function."""

__all__ = ["promote_model"]


def __getattr__(name: str):
    # Imported lazily: inside a running component KFP sets _KFP_RUNTIME and kfp.dsl has no
    # `component` decorator, while the component body imports this package's plain module.
    if name == "promote_model":
        from resilient_training.components.promote_model.component import promote_model

        return promote_model
    raise AttributeError(name)
