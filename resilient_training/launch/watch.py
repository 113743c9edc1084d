"""Run a cluster job (PyTorchJob or TrainJob) to completion.

Each kind is reached through a small adapter (:class:`PyTorchJobs` over the kubeflow-training
``TrainingClient``, :class:`TrainJobs` over the Kubernetes ``CustomObjectsApi``); everything
else is the same for both:

- Create the job; if it already exists (409: the step was retried), attach to it instead.
- Wait with an explicit overall timeout, printing each state change and a periodic heartbeat.
- Stream the workers' logs (node 0 by default, or all).
- Fail with the job's own reason plus each failed worker's exit code and last log lines.
- On SIGTERM (the KFP step is cancelled) or on timeout, delete the job so no GPU keeps running.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resilient_training.launch import cancel, jobshape, pytorchjob, trainjob

LOG_MODES = ("none", "worker-0", "all")
MAX_API_ERRORS = 5  # consecutive failed status reads tolerated (API server restarts, throttling)
EXIT_DO_NOT_RESTART = 93  # the trainer's "deterministic failure" exit code (nvrx_adapter)


class JobFailed(RuntimeError):
    """The job reached Failed; the message carries the operator's reason and the workers' exits."""


def api_status(exc: BaseException) -> int | None:
    """The HTTP status behind an API error: the TrainingClient wraps the ApiException as ``__cause__``."""
    return getattr(exc, "status", None) or getattr(exc.__cause__, "status", None)


class PyTorchJobs:
    """PyTorchJobs of one namespace through the kubeflow-training ``TrainingClient``."""

    kind = "PyTorchJob"
    container = pytorchjob.CONTAINER_NAME
    index_label = pytorchjob.POD_INDEX_LABEL

    def __init__(self, training_client: Any, namespace: str) -> None:
        self.client, self.namespace, self.core_api = training_client, namespace, training_client.core_api

    def create(self, job: Any) -> None:
        self.client.create_job(job=job, namespace=self.namespace)

    def get(self, name: str) -> tuple[str, str, str, str]:
        """``(state, reason, message, replica summary)``."""
        job = self.client.get_job(name, namespace=self.namespace)
        return (*_latest_condition(job), _replica_summary(job))

    def delete(self, name: str) -> None:
        self.client.delete_job(name, namespace=self.namespace)

    def pods(self, name: str) -> list[Any]:
        return self.client.get_job_pods(name, namespace=self.namespace, replica_type="worker")

    @staticmethod
    def owns_pod(job_name: str, pod_name: str) -> bool:
        return pod_name.startswith(job_name + "-worker-")


class TrainJobs:
    """Kubeflow Trainer v2 TrainJobs of one namespace through the Kubernetes ``CustomObjectsApi``.

    The ``kubeflow`` SDK's ``TrainerClient`` is not used: it builds the TrainJob from its own
    trainer types (no ``numProcPerNode``), reads the runtime first (one more RBAC grant) and
    reports a summary without the Failed condition's reason (docs/cluster.md, section 6).
    """

    kind = "TrainJob"
    container = trainjob.CONTAINER_NAME
    index_label = trainjob.POD_INDEX_LABEL

    def __init__(self, custom_api: Any, core_api: Any, namespace: str) -> None:
        self.custom_api, self.core_api, self.namespace = custom_api, core_api, namespace

    def create(self, job: Any) -> None:
        self.custom_api.create_namespaced_custom_object(
            trainjob.GROUP, trainjob.VERSION, self.namespace, trainjob.PLURAL, trainjob.to_dict(job))

    def get(self, name: str) -> tuple[str, str, str, str]:
        job = self.custom_api.get_namespaced_custom_object(
            trainjob.GROUP, trainjob.VERSION, self.namespace, trainjob.PLURAL, name)
        status = job.get("status") or {}
        current = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
        # No condition yet: the JobSet is being created or its pods run (a TrainJob has no Running condition).
        state, reason, message = "Running", "", ""
        if current:
            c = current[-1]
            state = {"Complete": "Succeeded"}.get(c.get("type", ""), c.get("type", ""))
            reason, message = c.get("reason", ""), c.get("message", "")
        counts: dict[str, int] = {}
        for job_status in status.get("jobsStatus") or []:
            for key in ("active", "ready", "succeeded", "failed"):
                counts[key] = counts.get(key, 0) + (job_status.get(key) or 0)
        summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no pods yet"
        return state, reason, message, "jobs: " + summary

    def delete(self, name: str) -> None:
        # Foreground: the JobSet and pods go before the TrainJob, so a re-created job never meets old pods.
        from kubernetes import client as k8s

        self.custom_api.delete_namespaced_custom_object(
            trainjob.GROUP, trainjob.VERSION, self.namespace, trainjob.PLURAL, name,
            body=k8s.V1DeleteOptions(propagation_policy="Foreground"))

    def pods(self, name: str) -> list[Any]:
        return self.core_api.list_namespaced_pod(
            self.namespace, label_selector=f"{trainjob.JOBSET_NAME_LABEL}={name}").items

    @staticmethod
    def owns_pod(job_name: str, pod_name: str) -> bool:
        """The JobSet's Job ``<job>-node-0`` and its pods ``<job>-node-0-<i>-<random>``, not another
        job's whose name only starts the same (``<job>-node-...``).
        """
        pattern = rf"{re.escape(job_name)}-{trainjob.REPLICATED_JOB}-0(-[0-9]+(-[a-z0-9]+)?)?"
        return re.fullmatch(pattern, pod_name) is not None


def jobs_api(kind: str, namespace: str, *, training_client: Any = None, kube_configuration: Any = None) -> Any:
    """The adapter for ``kind``; clients not given are made from ``kube_configuration`` (or the environment)."""
    if kind == "pytorchjob":
        if training_client is None:
            from kubeflow.training import TrainingClient

            from resilient_training.launch import kube_client

            training_client = TrainingClient(client_configuration=kube_configuration or kube_client.configuration(),
                                             namespace=namespace)
        return PyTorchJobs(training_client, namespace)
    from kubernetes import client as k8s

    from resilient_training.launch import kube_client

    api = k8s.ApiClient(kube_configuration or kube_client.configuration())
    return TrainJobs(k8s.CustomObjectsApi(api), k8s.CoreV1Api(api), namespace)


@dataclass(frozen=True, slots=True)
class LaunchOutcome:
    job_name: str
    namespace: str
    attached: bool
    seconds: float


def _latest_condition(job: Any) -> tuple[str, str, str]:
    conditions = (job.status.conditions if job.status else None) or []
    current = [c for c in conditions if c.status == "True"]
    if not current:
        return "Pending", "", ""
    c = current[-1]
    return c.type, c.reason or "", c.message or ""


def _replica_summary(job: Any) -> str:
    statuses = (job.status.replica_statuses if job.status else None) or {}
    worker = statuses.get("Worker")
    if worker is None:
        return "no worker status yet"
    parts = [f"{n} {attr}" for attr in ("active", "succeeded", "failed") if (n := getattr(worker, attr, None))]
    return "workers: " + (", ".join(parts) or "none active")


def create_or_attach(api: Any, job: Any, name: str, progress: Callable[[str], None],
                     gone_timeout_s: float = 300.0) -> bool:
    """Create ``job``; True when a job of this name already runs (a retried step) and we attach to it.

    A job left Failed by an earlier attempt of the step is deleted and created again, so a KFP
    retry really retries (training resumes from the last checkpoint on the shared storage).
    """
    where = f"{api.kind} {api.namespace}/{name}"
    for _ in range(2):
        try:
            api.create(job)
        except Exception as exc:
            if api_status(exc) != 409:
                raise
        else:
            progress(f"created {where}")
            return False
        state, reason, _, _ = api.get(name)
        if state != "Failed":
            progress(f"{where} already exists ({state}, a retried step): attaching to it")
            return True
        progress(f"{where} failed in an earlier attempt ({reason}): recreating it")
        api.delete(name)
        _wait_gone(api, name, gone_timeout_s)
    raise RuntimeError(f"{where} could not be recreated")


def _wait_gone(api: Any, name: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            api.get(name)
        except Exception as exc:
            if api_status(exc) == 404:
                return
            raise
        time.sleep(1.0)
    raise TimeoutError(f"{api.kind} {api.namespace}/{name} still exists {timeout_s:.0f} s after its deletion")


class LogFollower:
    """Follows the selected pods' logs in daemon threads, one per pod incarnation (uid)."""

    def __init__(self, core_api: Any, namespace: str, mode: str, emit: Callable[[str], None],
                 container: str = pytorchjob.CONTAINER_NAME, index_label: str = pytorchjob.POD_INDEX_LABEL) -> None:
        self.core_api, self.namespace, self.mode, self.emit = core_api, namespace, mode, emit
        self.container, self.index_label = container, index_label
        self._threads: dict[str, threading.Thread] = {}
        self._stop = threading.Event()

    def update(self, pods: list[Any]) -> None:
        if self.mode == "none":
            return
        for pod in pods:
            labels = pod.metadata.labels or {}
            if self.mode == "worker-0" and labels.get(self.index_label) != "0":
                continue
            # A pending pod has no log yet; a replaced pod (new uid) gets a new follower.
            if pod.status is None or pod.status.phase == "Pending" or pod.metadata.uid in self._threads:
                continue
            thread = threading.Thread(target=self._follow, args=(pod.metadata.name,), daemon=True)
            self._threads[pod.metadata.uid] = thread
            thread.start()

    def _follow(self, pod_name: str) -> None:
        try:
            resp = self.core_api.read_namespaced_pod_log(
                pod_name, self.namespace, container=self.container, follow=True, _preload_content=False)
            pending = b""
            for chunk in resp.stream(4096):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self.emit(f"[{pod_name}] {line.decode(errors='replace')}")
                if self._stop.is_set():
                    break
            if pending:
                self.emit(f"[{pod_name}] {pending.decode(errors='replace')}")
            resp.release_conn()
        except Exception as exc:  # noqa: BLE001 - logs are a convenience; the job status decides
            self.emit(f"[{pod_name}] (log stream ended: {exc})")

    def finish(self, timeout_s: float = 5.0) -> None:
        """Let the streams drain (a finished pod's stream ends by itself), then stop."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()


def warning_events(core_api: Any, namespace: str, job_name: str, seen: set[str] | None = None,
                   owns_pod: Callable[[str, str], bool] = PyTorchJobs.owns_pod) -> list[str]:
    """Warning events about the job and its pods (FailedScheduling, FailedMount, BackOff, ...), oldest first.

    ``seen`` (event uids) makes repeated calls report each event once.
    """
    try:
        events = core_api.list_namespaced_event(namespace, field_selector="type=Warning").items
    except Exception as exc:  # noqa: BLE001 - diagnostics only
        return [f"(events unavailable: {exc})"]
    out = []
    for event in events:
        obj = event.involved_object
        if obj is None or not (obj.name == job_name or owns_pod(job_name, obj.name or "")):
            continue
        uid = event.metadata.uid if event.metadata else None
        if seen is not None:
            if uid in seen:
                continue
            seen.add(uid)
        out.append(f"{obj.kind or ''} {obj.name}: {event.reason}: {event.message}")
    return out


def describe_failure(api: Any, name: str, reason: str, message: str) -> str:
    lines = [f"{api.kind} {api.namespace}/{name} failed: {reason or 'no reason'}: {message or 'no message'}"]
    try:
        pods = api.pods(name)
    except Exception as exc:  # noqa: BLE001 - the job's own reason above is still worth raising
        return lines[0] + f" (pods unavailable: {exc})"
    first_failed = None
    for pod in pods:
        for status in (pod.status.container_statuses if pod.status else None) or []:
            term = status.state.terminated if status.state else None
            if status.name != api.container or term is None or not term.exit_code:
                continue
            note = {EXIT_DO_NOT_RESTART: " (deterministic failure: do not restart)",
                    137: " (SIGKILL: OOM kill or node loss)"}.get(term.exit_code, "")
            lines.append(f"  {pod.metadata.name}: exit code {term.exit_code} {term.reason or ''}{note}".rstrip())
            first_failed = first_failed or pod.metadata.name
    if first_failed:
        try:
            tail = api.core_api.read_namespaced_pod_log(first_failed, api.namespace, container=api.container,
                                                        tail_lines=20)
            lines.append(f"  last log lines of {first_failed}:")
            lines += [f"    {line}" for line in tail.splitlines()]
        except Exception:  # noqa: BLE001, S110 - the pod may be gone already
            pass
    events = warning_events(api.core_api, api.namespace, name, owns_pod=api.owns_pod)
    if events:
        lines.append("  warning events:")
        lines += [f"    {e}" for e in events[-10:]]
    return "\n".join(lines)


def delete_job(api: Any, name: str, progress: Callable[[str], None] = print) -> str:
    """Delete a job (its pods go with it); ``gone`` when it does not exist, raises otherwise."""
    where = f"{api.kind} {api.namespace}/{name}"
    try:
        api.delete(name)
    except Exception as exc:
        # 404 also when the kind's CRD is not installed: nothing of that kind can exist.
        if api_status(exc) == 404:
            progress(f"k8s: {where} is already gone")
            return "gone"
        raise
    progress(f"deleted {where}")
    return "deleted"


def _delete_quietly(api: Any, name: str, progress: Callable[[str], None]) -> None:
    # On cancel or timeout the step is failing already: report a failed delete, do not mask the cause.
    try:
        delete_job(api, name, progress)
    except Exception as exc:  # noqa: BLE001
        progress(f"could not delete {api.kind} {api.namespace}/{name}: {exc}")


def build(spec: jobshape.JobSpec) -> Any:
    """The API object for ``spec.kind``."""
    return pytorchjob.build_job(spec) if spec.kind == "pytorchjob" else trainjob.build_job(spec)


def launch(
    spec: jobshape.JobSpec,
    *,
    training_client: Any = None,
    api: Any = None,
    timeout_s: float,
    poll_s: float = 15.0,
    heartbeat_s: float = 300.0,
    stream_logs: str = "worker-0",
    delete_on_timeout: bool = True,
    progress: Callable[[str], None] = print,
) -> LaunchOutcome:
    """Create (or attach to) the job and wait until it succeeds; raise on failure, timeout, cancel.

    ``api``: a :class:`PyTorchJobs` or :class:`TrainJobs` (default: from ``training_client`` or
    the environment, by ``spec.kind``).
    """
    if stream_logs not in LOG_MODES:
        raise ValueError(f"stream_logs must be one of {', '.join(LOG_MODES)}, got {stream_logs!r}")
    if not timeout_s > 0 or not 0 < poll_s <= timeout_s:
        raise ValueError(f"need 0 < poll_s ({poll_s}) <= timeout_s ({timeout_s})")
    job = build(spec)
    name, namespace = spec.name, spec.namespace
    api = api or jobs_api(spec.kind, namespace, training_client=training_client)
    where = f"{api.kind} {namespace}/{name}"

    logs = LogFollower(api.core_api, namespace, stream_logs, progress, api.container, api.index_label)
    start = time.monotonic()
    with cancel.sigterm_raises():
        try:
            attached = create_or_attach(api, job, name, progress)
            last_state, last_beat = None, start
            seen_events: set[str] = set()
            api_errors = 0
            while True:
                try:
                    state, reason, message, summary = api.get(name)
                    api_errors = 0
                except Exception as exc:
                    if api_status(exc) == 404:
                        raise JobFailed(f"{where} disappeared while running "
                                        "(deleted by someone, or its TTL expired)") from exc
                    if not isinstance(exc, RuntimeError | TimeoutError) and api_status(exc) is None:
                        raise
                    api_errors += 1
                    if api_errors > MAX_API_ERRORS:
                        raise
                    progress(f"warning: reading the job failed ({api_errors}/{MAX_API_ERRORS}), retrying: {exc}")
                    if time.monotonic() - start + poll_s > timeout_s:
                        raise TimeoutError(f"{where}: no status after {timeout_s:.0f} s") from exc
                    time.sleep(poll_s)
                    continue
                elapsed = time.monotonic() - start
                if state != last_state or elapsed - (last_beat - start) >= heartbeat_s:
                    progress(f"[{elapsed:7.0f} s] {namespace}/{name}: {state} ({summary})"
                             + (f" {reason}: {message}" if state != last_state and message else ""))
                    last_state, last_beat = state, time.monotonic()
                if state in ("Pending", "Created", "Restarting", "Running", "Suspended"):
                    # Why pods are not running yet (no GPU capacity, volume not mountable, image pull) is only in events.
                    for event in warning_events(api.core_api, namespace, name, seen_events, api.owns_pod):
                        progress(f"  warning: {event}")
                if stream_logs != "none" and state not in ("Pending", "Created"):
                    try:
                        logs.update(api.pods(name))
                    except Exception as exc:  # noqa: BLE001 - logs are a convenience; the job status decides
                        progress(f"warning: listing the pods failed: {exc}")
                if state == "Succeeded":
                    logs.finish()
                    progress(f"{where} succeeded after {elapsed:.0f} s")
                    return LaunchOutcome(name, namespace, attached, elapsed)
                if state == "Failed":
                    logs.finish()
                    raise JobFailed(describe_failure(api, name, reason, message))
                if elapsed + poll_s > timeout_s:
                    recent = warning_events(api.core_api, namespace, name, owns_pod=api.owns_pod)[-5:]
                    raise TimeoutError(f"{where} still {state} after {elapsed:.0f} s "
                                       f"(timeout {timeout_s:.0f} s)" + "".join(f"\n  {e}" for e in recent))
                time.sleep(poll_s)
        except cancel.Cancelled:
            progress(f"step cancelled (SIGTERM): deleting {where}")
            _delete_quietly(api, name, progress)
            raise
        except TimeoutError:
            if delete_on_timeout:
                _delete_quietly(api, name, progress)
            raise
