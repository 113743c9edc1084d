# Lazy re-export: the component's own body imports this package's plain modules inside the KFP
# executor, where kfp.dsl is only the runtime subset and cannot run @dsl.component again.
def __getattr__(name: str):
    if name == "provision_storage":
        from resilient_training.components.provision_storage.component import provision_storage

        return provision_storage
    raise AttributeError(name)


__all__ = ["provision_storage"]
