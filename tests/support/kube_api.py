"""A small stateful stand-in for the Kubernetes API server, on 127.0.0.1, for the real clients.

It serves the endpoints the cluster components call, with the API server's status codes and
``Status`` bodies (201 on create, 409 AlreadyExists, 404 NotFound, 200 on delete):

- ``kubeflow.org/v1`` pytorchjobs: create, get, delete. A created job follows a scripted
  operator timeline (``job_timeline``), one step per GET of the job, so a test decides exactly
  what the watcher sees: ``Created`` -> ``Running`` (worker pods appear) -> ``Succeeded`` or
  ``Failed`` with a reason; a timeline that ends in ``Running`` never finishes.
- ``trainer.kubeflow.org/v1alpha1`` trainjobs: the same, with the Trainer's view of the timeline
  (no condition while created or running, ``Complete`` or ``Failed`` at the end) and JobSet pods
  (``<job>-node-0-<i>-<suffix>``, container ``node``, labelled with the JobSet name and completion index).
- ``v1`` pods: list by label selector; ``pods/{name}/log``: the text in ``pod_logs``;
  events: list (field selector equality), filled with :meth:`KubeApiServer.add_event`.
- ``v1`` persistentvolumes (cluster scope) and persistentvolumeclaims: create, get, delete; a
  claim naming an existing volume reads back ``Bound``.

``fail_next[(METHOD, resource)] = code`` makes the next such call fail (e.g. a 500 or 403 on PV
create) to simulate a failure in the middle of a sequence. ``requests`` records every call.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

JOB_NAME_LABEL = "training.kubeflow.org/job-name"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
JOB_RESOURCES = ("pytorchjobs", "trainjobs")
_REASONS = {404: "NotFound", 409: "AlreadyExists", 403: "Forbidden", 500: "InternalError", 422: "Invalid"}


@dataclass
class Phase:
    """One step of the simulated operator: a job condition and what the pods look like."""

    condition: str  # Created | Running | Restarting | Succeeded | Failed
    reason: str = ""
    message: str = ""
    pod_phase: str = ""  # default derived from condition
    exit_code: int | None = None  # container exit code of worker pods once terminated
    new_pods: bool = False  # the operator replaced the pods (new uids): log followers must re-attach


def default_timeline() -> list[Phase]:
    return [Phase("Created"), Phase("Running"), Phase("Succeeded", reason="PyTorchJobSucceeded")]


@dataclass
class KubeState:
    objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = field(default_factory=dict)
    job_timeline: list[Phase] = field(default_factory=default_timeline)
    job_progress: dict[tuple[str, str], int] = field(default_factory=dict)
    pod_logs: dict[str, str] = field(default_factory=dict)
    fail_next: dict[tuple[str, str], int] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    delete_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> the last DELETE's body
    lock: threading.RLock = field(default_factory=threading.RLock)

    def store(self, resource: str) -> dict[tuple[str, str], dict[str, Any]]:
        return self.objects.setdefault(resource, {})


def _status(code: int, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": _REASONS.get(code, "Unknown"), "code": code}


def route(path: str) -> tuple[str, str, str] | None:
    """``(resource, namespace, name)`` for the paths served; name may be ''."""
    parts = [p for p in path.split("/") if p]
    if parts[:3] == ["apis", "kubeflow.org", "v1"] and len(parts) >= 5 and parts[3] == "namespaces":
        if parts[5:6] == ["pytorchjobs"]:
            return "pytorchjobs", parts[4], parts[6] if len(parts) > 6 else ""
    if parts[:3] == ["apis", "trainer.kubeflow.org", "v1alpha1"] and len(parts) >= 5 and parts[3] == "namespaces":
        if parts[5:6] == ["trainjobs"]:
            return "trainjobs", parts[4], parts[6] if len(parts) > 6 else ""
    if parts[:2] == ["api", "v1"]:
        if parts[2:3] == ["persistentvolumes"]:
            return "persistentvolumes", "", parts[3] if len(parts) > 3 else ""
        if len(parts) >= 5 and parts[2] == "namespaces":
            resource = parts[4]
            name = parts[5] if len(parts) > 5 else ""
            if resource == "pods" and len(parts) == 7 and parts[6] == "log":
                return "pods/log", parts[3], name
            if resource in ("pods", "persistentvolumeclaims", "events"):
                return resource, parts[3], name
    return None


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def _field(obj: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part, {}) if isinstance(obj, dict) else {}
    return obj if obj != {} else None


def _fields_match(obj: dict[str, Any], selector: str) -> bool:
    """``fieldSelector`` equality terms (``type=Warning``, ``involvedObject.name=x``)."""
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if str(_field(obj, key)) != value:
            return False
    return True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    state: KubeState  # set on the subclass made per server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet test output
        pass

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}")

    def _handle(self, method: str) -> None:
        url = urlparse(self.path)
        target = route(url.path)
        body = self._body() if method == "POST" else None
        options = self._body() if method == "DELETE" else None  # delete options: recorded, not acted on
        st = self.state
        with st.lock:
            st.requests.append((method, url.path))
            if options is not None:
                st.delete_options[url.path] = options
            if target is None:
                return self._send(404, _status(404, f"the server could not find the requested resource {url.path}"))
            resource, namespace, name = target
            code = st.fail_next.pop((method, resource), None)
            if code is not None:
                return self._send(code, _status(code, f"injected failure of {method} {resource}"))
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            handler = getattr(self, f"_{method.lower()}")
            return handler(resource, namespace, name, body, query)

    def _post(self, resource: str, namespace: str, name: str, body: Any, query: dict[str, str]) -> None:
        st = self.state
        meta = body.setdefault("metadata", {})
        name = meta.get("name", "")
        key = (namespace, name)
        store = st.store(resource)
        if key in store:
            return self._send(409, _status(409, f'{resource} "{name}" already exists'))
        if namespace:
            meta["namespace"] = namespace
        meta.update(uid=str(uuid.uuid4()), resourceVersion="1",
                    creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if resource in ("persistentvolumes", "persistentvolumeclaims"):
            body["status"] = {"phase": "Available" if resource == "persistentvolumes" else "Pending"}
        store[key] = body
        return self._send(201, body)

    def _get(self, resource: str, namespace: str, name: str, body: Any, query: dict[str, str]) -> None:
        st = self.state
        if resource == "pods/log":
            pod = st.store("pods").get((namespace, name))
            if pod is None:
                return self._send(404, _status(404, f'pods "{name}" not found'))
            return self._send(200, st.pod_logs.get(name, ""), "text/plain")
        if not name:
            selector = query.get("labelSelector", "")
            fields = query.get("fieldSelector", "")
            items = [o for (ns, _), o in sorted(st.store(resource).items())
                     if ns == namespace and _matches(o.get("metadata", {}).get("labels") or {}, selector)
                     and _fields_match(o, fields)]
            return self._send(200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items})
        obj = st.store(resource).get((namespace, name))
        if obj is None:
            return self._send(404, _status(404, f'{resource} "{name}" not found'))
        if resource in JOB_RESOURCES:
            self._advance_job(obj, resource)
        if resource == "persistentvolumeclaims":
            volume = obj.get("spec", {}).get("volumeName", "")
            if volume and ("", volume) in st.store("persistentvolumes"):
                obj["status"] = {"phase": "Bound"}
        return self._send(200, obj)

    def _delete(self, resource: str, namespace: str, name: str, body: Any, query: dict[str, str]) -> None:
        st = self.state
        obj = st.store(resource).pop((namespace, name), None)
        if obj is None:
            return self._send(404, _status(404, f'{resource} "{name}" not found'))
        if resource in JOB_RESOURCES:
            st.job_progress.pop((namespace, name), None)  # a job created again under this name starts over
            label = JOB_NAME_LABEL if resource == "pytorchjobs" else JOBSET_NAME_LABEL
            for key in [k for k, pod in st.store("pods").items()
                        if pod["metadata"]["labels"].get(label) == name and k[0] == namespace]:
                del st.store("pods")[key]
        return self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "details": {"name": name}})

    def _advance_job(self, job: dict[str, Any], resource: str) -> None:
        st = self.state
        key = (job["metadata"].get("namespace", ""), job["metadata"]["name"])
        step = st.job_progress.get(key, -1) + 1
        if step >= len(st.job_timeline):
            return
        st.job_progress[key] = step
        phase = st.job_timeline[step]
        if resource == "trainjobs":
            return self._advance_trainjob(job, phase)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        conditions = job.setdefault("status", {}).setdefault("conditions", [])
        for cond in conditions:
            cond["status"] = "False"
        reason = phase.reason or f"PyTorchJob{phase.condition}"
        conditions.append({"type": phase.condition, "status": "True", "reason": reason,
                           "message": phase.message or f"PyTorchJob {key[1]} is {phase.condition.lower()}.",
                           "lastUpdateTime": now, "lastTransitionTime": now})
        if phase.condition != "Created":
            self._set_pods(job, phase)

    def _advance_trainjob(self, job: dict[str, Any], phase: Phase) -> None:
        """The Trainer's TrainJob: conditions only when it ends (Complete/Failed); pods from its JobSet."""
        st = self.state
        namespace, name = job["metadata"].get("namespace", ""), job["metadata"]["name"]
        status = job.setdefault("status", {})
        if phase.condition in ("Succeeded", "Failed"):
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            ctype = "Complete" if phase.condition == "Succeeded" else "Failed"
            status["conditions"] = [{"type": ctype, "status": "True", "lastTransitionTime": now,
                                     "reason": phase.reason or ("JobSetCompleted" if ctype == "Complete" else "FailedJobs"),
                                     "message": phase.message or f"jobset {name} {ctype.lower()}"}]
        if phase.condition == "Created":
            return
        nodes = job["spec"].get("trainer", {}).get("numNodes", 1)
        pod_phase = phase.pod_phase or {"Succeeded": "Succeeded", "Failed": "Failed"}.get(phase.condition, "Running")
        generation = sum(1 for p in st.job_timeline[: st.job_progress[(namespace, name)] + 1] if p.new_pods)
        for key in [k for k, pod in st.store("pods").items()
                    if pod["metadata"]["labels"].get(JOBSET_NAME_LABEL) == name and k[0] == namespace]:
            del st.store("pods")[key]
        for index in range(nodes):
            pod_name = f"{name}-node-0-{index}-g{generation}"
            st.store("pods")[(namespace, pod_name)] = self._pod(
                namespace, pod_name, f"{pod_name}-uid", {JOBSET_NAME_LABEL: name, COMPLETION_INDEX_LABEL: str(index)},
                "node", pod_phase, phase)
            st.pod_logs.setdefault(pod_name, "step 1 loss 5.5\nstep 2 loss 5.1\n")
        status["jobsStatus"] = [{"name": "node", pod_phase.lower() if pod_phase != "Running" else "active": nodes}]

    @staticmethod
    def _pod(namespace: str, pod_name: str, uid: str, labels: dict[str, str], container: str, pod_phase: str,
             phase: Phase) -> dict[str, Any]:
        state: dict[str, Any] = {"running": {}}
        if pod_phase in ("Succeeded", "Failed"):
            code = phase.exit_code if phase.exit_code is not None else (0 if pod_phase == "Succeeded" else 1)
            state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": namespace, "uid": uid, "labels": labels},
                "status": {"phase": pod_phase,
                           "containerStatuses": [{"name": container, "ready": pod_phase == "Running", "restartCount": 0,
                                                  "image": "trainer", "imageID": "", "state": state}]}}

    def _set_pods(self, job: dict[str, Any], phase: Phase) -> None:
        st = self.state
        namespace, name = job["metadata"].get("namespace", ""), job["metadata"]["name"]
        worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
        pod_phase = phase.pod_phase or {"Succeeded": "Succeeded", "Failed": "Failed"}.get(phase.condition, "Running")
        generation = sum(1 for p in st.job_timeline[: st.job_progress[(namespace, name)] + 1] if p.new_pods)
        for index in range(worker.get("replicas", 1)):
            pod_name = f"{name}-worker-{index}"
            state: dict[str, Any] = {"running": {}}
            if pod_phase in ("Succeeded", "Failed"):
                code = phase.exit_code if phase.exit_code is not None else (0 if pod_phase == "Succeeded" else 1)
                state = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}
            st.store("pods")[(namespace, pod_name)] = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": namespace, "uid": f"{pod_name}-uid-{generation}",
                             "labels": {JOB_NAME_LABEL: name, REPLICA_TYPE_LABEL: "worker",
                                        REPLICA_INDEX_LABEL: str(index)}},
                "status": {"phase": pod_phase,
                           "containerStatuses": [{"name": "pytorch", "ready": pod_phase == "Running", "restartCount": 0,
                                                  "image": "trainer", "imageID": "", "state": state}]},
            }
            st.pod_logs.setdefault(pod_name, "step 1 loss 5.5\nstep 2 loss 5.1\n")
        job["status"]["replicaStatuses"] = {"Worker": {pod_phase.lower() if pod_phase != "Running" else "active":
                                                       worker.get("replicas", 1)}}

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle("DELETE")


class KubeApiServer:
    """The stand-in, serving on ``127.0.0.1:<free port>`` from a daemon thread."""

    def __init__(self) -> None:
        self.state = KubeState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> KubeApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def configuration(self) -> Any:
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = self.url
        return cfg

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig for this server (for subprocesses such as kfp.local components)."""
        import yaml

        doc = {"apiVersion": "v1", "kind": "Config", "current-context": "stand-in",
               "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
               "users": [{"name": "nobody", "user": {}}],
               "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in", "user": "nobody",
                                                            "namespace": namespace}}]}
        path.write_text(yaml.safe_dump(doc))
        return path

    def add_event(self, namespace: str, kind: str, name: str, reason: str, message: str,
                  type_: str = "Warning") -> None:
        """An event as the scheduler/kubelet would record it (e.g. FailedScheduling on a worker pod)."""
        with self.state.lock:
            uid = str(uuid.uuid4())
            self.state.store("events")[(namespace, f"{name}.{uid[:8]}")] = {
                "apiVersion": "v1", "kind": "Event", "type": type_, "reason": reason, "message": message,
                "metadata": {"name": f"{name}.{uid[:8]}", "namespace": namespace, "uid": uid},
                "involvedObject": {"kind": kind, "name": name, "namespace": namespace}}

    # Convenience for assertions.
    def get(self, resource: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        with self.state.lock:
            return self.state.store(resource).get((namespace, name))

    def names(self, resource: str) -> list[str]:
        with self.state.lock:
            return sorted(name for _, name in self.state.store(resource))


@contextmanager
def running() -> Iterator[KubeApiServer]:
    server = KubeApiServer().start()
    try:
        yield server
    finally:
        server.stop()
