"""Kubernetes client configuration for the cluster components: in-cluster first, then kubeconfig."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def configuration() -> Any:
    """A ``kubernetes.client.Configuration``: the pod's service account when in a cluster, else ``KUBECONFIG``."""
    from kubernetes import client, config

    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg)
    return cfg


def default_namespace() -> str:
    """The namespace this pod runs in (KFP runs steps in the user's profile namespace), else the kubeconfig's."""
    if _SA_NAMESPACE.is_file():
        return _SA_NAMESPACE.read_text().strip()
    try:
        from kubernetes import config

        _, context = config.list_kube_config_contexts()
        return (context or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # no kubeconfig: the caller's explicit namespace is then required anyway
        return "default"
