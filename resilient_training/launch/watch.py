"""Run a PyTorchJob to completion through the kubeflow-training ``TrainingClient``.

- Create the job; if it already exists (409: the step was retried), attach to it instead.
- Wait with an explicit overall timeout, printing each state change and a periodic heartbeat.
- Stream the workers' logs (elastic jobs have no master: worker 0 by default, or all).
- Fail with the job's own reason plus each failed worker's exit code and last log lines.
- On SIGTERM (the KFP step is cancelled) or on timeout, delete the job so no GPU keeps running.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from resilient_training.launch import cancel, pytorchjob

LOG_MODES = ("none", "worker-0", "all")
MAX_API_ERRORS = 5  # consecutive failed status reads tolerated (API server restarts, throttling)
EXIT_DO_NOT_RESTART = 93  # the trainer's "deterministic failure" exit code (nvrx_adapter)


class JobFailed(RuntimeError):
    """The PyTorchJob reached Failed; the message carries the operator's reason and the workers' exits."""


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


def create_or_attach(training_client: Any, job: Any, progress: Callable[[str], None],
                     gone_timeout_s: float = 300.0) -> bool:
    """Create ``job``; True when a job of this name already runs (a retried step) and we attach to it.

    A job left Failed by an earlier attempt of the step is deleted and created again, so a KFP
    retry really retries (training resumes from the last checkpoint on the shared storage).
    """
    name, namespace = job.metadata.name, job.metadata.namespace
    for _ in range(2):
        try:
            training_client.create_job(job=job, namespace=namespace)
        except RuntimeError as exc:  # TrainingClient wraps the ApiException as __cause__
            if getattr(exc.__cause__, "status", None) != 409:
                raise
        else:
            progress(f"created PyTorchJob {namespace}/{name}")
            return False
        state, reason, _ = _latest_condition(training_client.get_job(name, namespace=namespace))
        if state != "Failed":
            progress(f"PyTorchJob {namespace}/{name} already exists ({state}, a retried step): attaching to it")
            return True
        progress(f"PyTorchJob {namespace}/{name} failed in an earlier attempt ({reason}): recreating it")
        training_client.delete_job(name, namespace=namespace)
        _wait_gone(training_client, name, namespace, gone_timeout_s)
    raise RuntimeError(f"PyTorchJob {namespace}/{name} could not be recreated")


def _wait_gone(training_client: Any, name: str, namespace: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            training_client.get_job(name, namespace=namespace)
        except RuntimeError as exc:
            if getattr(exc.__cause__, "status", None) == 404:
                return
            raise
        time.sleep(1.0)
    raise TimeoutError(f"PyTorchJob {namespace}/{name} still exists {timeout_s:.0f} s after its deletion")


class LogFollower:
    """Follows the selected worker pods' logs in daemon threads, one per pod incarnation (uid)."""

    def __init__(self, core_api: Any, namespace: str, mode: str, emit: Callable[[str], None]) -> None:
        self.core_api, self.namespace, self.mode, self.emit = core_api, namespace, mode, emit
        self._threads: dict[str, threading.Thread] = {}
        self._stop = threading.Event()

    def update(self, pods: list[Any]) -> None:
        if self.mode == "none":
            return
        for pod in pods:
            labels = pod.metadata.labels or {}
            if self.mode == "worker-0" and labels.get("training.kubeflow.org/replica-index") != "0":
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
                pod_name, self.namespace, container=pytorchjob.CONTAINER_NAME, follow=True, _preload_content=False)
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


def warning_events(core_api: Any, namespace: str, job_name: str, seen: set[str] | None = None) -> list[str]:
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
        if obj is None or not (obj.name == job_name or (obj.name or "").startswith(job_name + "-worker-")):
            continue
        uid = event.metadata.uid if event.metadata else None
        if seen is not None:
            if uid in seen:
                continue
            seen.add(uid)
        out.append(f"{obj.kind or ''} {obj.name}: {event.reason}: {event.message}")
    return out


def describe_failure(training_client: Any, name: str, namespace: str, reason: str, message: str) -> str:
    lines = [f"PyTorchJob {namespace}/{name} failed: {reason or 'no reason'}: {message or 'no message'}"]
    try:
        pods = training_client.get_job_pods(name, namespace=namespace, replica_type="worker")
    except Exception as exc:  # noqa: BLE001 - the job's own reason above is still worth raising
        return lines[0] + f" (pods unavailable: {exc})"
    first_failed = None
    for pod in pods:
        for status in (pod.status.container_statuses if pod.status else None) or []:
            term = status.state.terminated if status.state else None
            if status.name != pytorchjob.CONTAINER_NAME or term is None or not term.exit_code:
                continue
            note = {EXIT_DO_NOT_RESTART: " (deterministic failure: do not restart)",
                    137: " (SIGKILL: OOM kill or node loss)"}.get(term.exit_code, "")
            lines.append(f"  {pod.metadata.name}: exit code {term.exit_code} {term.reason or ''}{note}".rstrip())
            first_failed = first_failed or pod.metadata.name
    if first_failed:
        try:
            tail = training_client.core_api.read_namespaced_pod_log(
                first_failed, namespace, container=pytorchjob.CONTAINER_NAME, tail_lines=20)
            lines.append(f"  last log lines of {first_failed}:")
            lines += [f"    {line}" for line in tail.splitlines()]
        except Exception:  # noqa: BLE001, S110 - the pod may be gone already
            pass
    events = warning_events(training_client.core_api, namespace, name)
    if events:
        lines.append("  warning events:")
        lines += [f"    {e}" for e in events[-10:]]
    return "\n".join(lines)


def delete_job(training_client: Any, name: str, namespace: str, progress: Callable[[str], None] = print) -> str:
    """Delete a PyTorchJob (its pods go with it); ``gone`` when it does not exist, raises otherwise."""
    try:
        training_client.delete_job(name, namespace=namespace)
    except RuntimeError as exc:  # TrainingClient wraps the ApiException
        if getattr(exc.__cause__, "status", None) == 404:
            progress(f"k8s: PyTorchJob {namespace}/{name} is already gone")
            return "gone"
        raise
    progress(f"deleted PyTorchJob {namespace}/{name}")
    return "deleted"


def _delete_quietly(training_client: Any, name: str, namespace: str, progress: Callable[[str], None]) -> None:
    # On cancel or timeout the step is failing already: report a failed delete, do not mask the cause.
    try:
        delete_job(training_client, name, namespace, progress)
    except RuntimeError as exc:
        progress(f"could not delete PyTorchJob {namespace}/{name}: {exc}")


def launch(
    spec: pytorchjob.JobSpec,
    *,
    training_client: Any,
    timeout_s: float,
    poll_s: float = 15.0,
    heartbeat_s: float = 300.0,
    stream_logs: str = "worker-0",
    delete_on_timeout: bool = True,
    progress: Callable[[str], None] = print,
) -> LaunchOutcome:
    """Create (or attach to) the job and wait until it succeeds; raise on failure, timeout, cancel."""
    if stream_logs not in LOG_MODES:
        raise ValueError(f"stream_logs must be one of {', '.join(LOG_MODES)}, got {stream_logs!r}")
    if not timeout_s > 0 or not 0 < poll_s <= timeout_s:
        raise ValueError(f"need 0 < poll_s ({poll_s}) <= timeout_s ({timeout_s})")
    job = pytorchjob.build_job(spec)
    name, namespace = spec.name, spec.namespace

    logs = LogFollower(training_client.core_api, namespace, stream_logs, progress)
    start = time.monotonic()
    with cancel.sigterm_raises():
        try:
            attached = create_or_attach(training_client, job, progress)
            last_state, last_beat = None, start
            seen_events: set[str] = set()
            api_errors = 0
            while True:
                try:
                    current = training_client.get_job(name, namespace=namespace)
                    api_errors = 0
                except (RuntimeError, TimeoutError) as exc:
                    if getattr(exc.__cause__, "status", None) == 404:
                        raise JobFailed(f"PyTorchJob {namespace}/{name} disappeared while running "
                                        "(deleted by someone, or its TTL expired)") from exc
                    api_errors += 1
                    if api_errors > MAX_API_ERRORS:
                        raise
                    progress(f"warning: reading the job failed ({api_errors}/{MAX_API_ERRORS}), retrying: {exc}")
                    if time.monotonic() - start + poll_s > timeout_s:
                        raise TimeoutError(f"PyTorchJob {namespace}/{name}: no status after {timeout_s:.0f} s") from exc
                    time.sleep(poll_s)
                    continue
                state, reason, message = _latest_condition(current)
                elapsed = time.monotonic() - start
                if state != last_state or elapsed - (last_beat - start) >= heartbeat_s:
                    progress(f"[{elapsed:7.0f} s] {namespace}/{name}: {state} ({_replica_summary(current)})"
                             + (f" {reason}: {message}" if state != last_state and message else ""))
                    last_state, last_beat = state, time.monotonic()
                if state in ("Pending", "Created", "Restarting"):
                    # Why pods are not running yet (no GPU capacity, volume not mountable, image pull) is only in events.
                    for event in warning_events(training_client.core_api, namespace, name, seen_events):
                        progress(f"  warning: {event}")
                if stream_logs != "none" and state not in ("Pending", "Created"):
                    try:
                        logs.update(training_client.get_job_pods(name, namespace=namespace, replica_type="worker"))
                    except Exception as exc:  # noqa: BLE001 - logs are a convenience; the job status decides
                        progress(f"warning: listing the worker pods failed: {exc}")
                if state == "Succeeded":
                    logs.finish()
                    progress(f"PyTorchJob {namespace}/{name} succeeded after {elapsed:.0f} s")
                    return LaunchOutcome(name, namespace, attached, elapsed)
                if state == "Failed":
                    logs.finish()
                    raise JobFailed(describe_failure(training_client, name, namespace, reason, message))
                if elapsed + poll_s > timeout_s:
                    recent = warning_events(training_client.core_api, namespace, name)[-5:]
                    raise TimeoutError(f"PyTorchJob {namespace}/{name} still {state} after {elapsed:.0f} s "
                                       f"(timeout {timeout_s:.0f} s)" + "".join(f"\n  {e}" for e in recent))
                time.sleep(poll_s)
        except cancel.Cancelled:
            progress(f"step cancelled (SIGTERM): deleting PyTorchJob {namespace}/{name}")
            _delete_quietly(training_client, name, namespace, progress)
            raise
        except TimeoutError:
            if delete_on_timeout:
                _delete_quietly(training_client, name, namespace, progress)
            raise
