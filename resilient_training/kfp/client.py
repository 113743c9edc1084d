"""Talking to a Kubeflow Pipelines server through ``kfp.Client``: auth, upload, runs, schedules.

Plain functions over a :class:`Connection`. Every server problem comes out as a
:class:`KfpError` whose message names the host and what was being done, never as a
traceback from urllib3 or the generated API client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from resilient_training import __version__
from resilient_training.kfp.compile import CompiledPipeline, default_version_name

if TYPE_CHECKING:
    import kfp
    import kfp_server_api

TOKEN_ENV = "KF_PIPELINES_TOKEN"
# kfp's own variable for the projected token path (kfp.client.KF_PIPELINES_SA_TOKEN_ENV).
SA_TOKEN_PATH_ENV = "KF_PIPELINES_SA_TOKEN_PATH"
# The projected token KFP documents for in-cluster clients (audience pipelines.kubeflow.org),
# then the pod's default service-account token, which only servers accepting its audience take.
IN_CLUSTER_TOKEN_PATHS: tuple[str, ...] = (
    "/var/run/secrets/kubeflow/pipelines/token",
    "/var/run/secrets/kubernetes.io/serviceaccount/token",
)
AUTH_MODES: tuple[str, ...] = ("auto", "none", "token", "kubeconfig", "in-cluster")
# Marker in each uploaded version's description; finding it again makes uploads idempotent.
HASH_MARKER = "content sha256:"
_EQUALS = 1  # filter.proto Predicate.Operation EQUALS, as kfp.Client itself sends it


class KfpError(RuntimeError):
    """The server could not be reached, refused a request, or lacks what was asked for."""


class AuthError(ValueError):
    """The requested credentials are not available (found before any call)."""


class _NotTheApi(Exception):
    """A 2xx answer whose body is not a JSON object (its content type is the message)."""


class _TooSlow(Exception):
    """A whole request (connection and answer) took longer than its deadline (:func:`_deadline`)."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`_TooSlow` in the block after ``seconds``. urllib3's timeouts bound each socket
    operation, so a server sending a byte a second kept a request going for as long as it liked (a
    stranger trial). By SIGALRM, so in the main thread only (where the CLI sends its requests).
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise _TooSlow(seconds)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclasses.dataclass(frozen=True, slots=True)
class Auth:
    """A bearer token (or none) and where it came from, for messages."""

    token: str | None = dataclasses.field(repr=False)  # never in a repr, a log line or a traceback
    source: str


@dataclasses.dataclass(frozen=True, slots=True)
class Connection:
    """A checked connection to one KFP server."""

    client: kfp.Client
    host: str
    auth: Auth
    namespace: str | None = None
    multi_user: bool = False
    timeout: float = 10.0  # seconds each request may take to connect, and to answer


@dataclasses.dataclass(frozen=True, slots=True)
class UploadResult:
    pipeline_id: str
    pipeline_name: str
    version_id: str
    version_name: str
    created_pipeline: bool
    created_version: bool


@dataclasses.dataclass(frozen=True, slots=True)
class RunSource:
    """What a run or recurring run executes: an uploaded version, or a local package sent inline."""

    label: str
    package_path: Path | None = None
    pipeline_id: str | None = None
    version_id: str | None = None


def resolve_auth(
    mode: str = "auto",
    *,
    token: str | None = None,
    kubeconfig: str | None = None,
    context: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Auth:
    """Find the bearer token to send, without contacting any server.

    ``auto`` takes, in order: ``token``, ``$KF_PIPELINES_TOKEN``, the kubeconfig user's token
    when ``kubeconfig`` or ``context`` is given, the in-cluster token file when it exists, else
    no token. Kubernetes credentials are never sent unless asked for, so a kubeconfig is read
    only on request.

    Args:
        mode: one of :data:`AUTH_MODES`.
        token: ``--token``.
        kubeconfig: kubeconfig file (default ``$KUBECONFIG`` or ``~/.kube/config``).
        context: kubeconfig context (default: its current context).
        env: environment to read (default ``os.environ``).

    Returns:
        The token and a description of its source.

    Raises:
        AuthError: the chosen mode's credentials are missing or unreadable.

    """
    env = os.environ if env is None else env
    if mode not in AUTH_MODES:
        raise AuthError(f"unknown auth mode {mode!r}; choose one of {', '.join(AUTH_MODES)}")
    if token and mode not in ("auto", "token"):  # it was dropped without a word (stranger trial)
        raise AuthError(f"--token is not sent with --auth {mode}: drop one of them")
    if (kubeconfig or context) and mode not in ("auto", "kubeconfig"):
        raise AuthError(f"--kubeconfig/--context are not read with --auth {mode}: drop one of them")
    if mode == "none":
        return Auth(None, "none")
    if mode in ("auto", "token"):
        if token:
            return _token_auth(token, "--token")
        if env.get(TOKEN_ENV):
            return _token_auth(env[TOKEN_ENV], f"${TOKEN_ENV}")
        if mode == "token":
            raise AuthError(f"--auth token needs --token or ${TOKEN_ENV}")
    if mode == "kubeconfig" or (mode == "auto" and (kubeconfig or context)):
        return _kubeconfig_token(kubeconfig or env.get("KUBECONFIG") or "~/.kube/config", context)
    paths = [env[SA_TOKEN_PATH_ENV]] if env.get(SA_TOKEN_PATH_ENV) else list(IN_CLUSTER_TOKEN_PATHS)
    for path in paths:
        if Path(path).is_file():
            try:
                value = Path(path).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise AuthError(f"cannot read in-cluster token file {path}: {type(exc).__name__}") from None
            return _token_auth(value, f"in-cluster token {path}")
    if mode == "in-cluster":
        raise AuthError(f"--auth in-cluster: no token file at {' or '.join(paths)} (set ${SA_TOKEN_PATH_ENV})")
    return Auth(None, "none")


def _token_auth(raw: str, source: str) -> Auth:
    """A bearer token as a Secret or file carries it (trailing newline stripped), checked without showing it."""
    token = raw.strip()
    if not token:
        raise AuthError(f"the token from {source} is empty")
    if not all(33 <= ord(ch) <= 126 for ch in token):  # what an HTTP header value can carry, no spaces
        raise AuthError(f"the token from {source} contains a space, control or non-ASCII character "
                        f"(not shown); a bearer token is printable ASCII")
    return Auth(token, source)


def _kubeconfig_token(path: str, context: str | None) -> Auth:
    import yaml
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config

    configuration = k8s_client.Configuration()
    expanded = os.pathsep.join(str(Path(p).expanduser()) for p in path.split(os.pathsep))
    try:
        k8s_config.load_kube_config(
            config_file=expanded, context=context, client_configuration=configuration, persist_config=False
        )
    except (k8s_config.ConfigException, OSError) as exc:
        raise AuthError(f"cannot read a token from kubeconfig {path}: {' '.join(str(exc).split())}") from None
    except (yaml.YAMLError, ValueError, TypeError, AttributeError, KeyError) as exc:
        # YAML garbage, binary bytes (UnicodeDecodeError) or a document that is not a mapping: the
        # kubernetes client raises these as they come (stranger trial: three different tracebacks).
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if isinstance(exc, TypeError | AttributeError | KeyError):  # said "'str' object does not support item
            first = "not a mapping of clusters, contexts and users"  # assignment" of a plain file (stranger trial)
        raise AuthError(f"cannot read a token from kubeconfig {path}: not a kubeconfig ({type(exc).__name__}"
                        f"{': ' + first if first else ''})") from None
    bearer = configuration.api_key.get("authorization", "")
    if not bearer.startswith("Bearer "):
        raise AuthError(
            f"the kubeconfig user of context {context or '(current)'} in {path} has no bearer token "
            "(client certificates cannot be forwarded to Kubeflow Pipelines); use --token"
        )
    return _token_auth(bearer.removeprefix("Bearer "), f"kubeconfig {path}" + (f" context {context}" if context else ""))


def check_host(host: str) -> str:
    """Normalise ``--host`` (no trailing slash); refuse one without http:// or https://, with a query,
    a fragment or user info. Messages show a password in it as ``***``.

    Raises:
        AuthError: not an http(s) URL. (An input error, like bad credentials.)

    """
    # A password was echoed in "cannot reach Kubeflow Pipelines at http://user:pw@..." (stranger trial).
    shown = re.sub(r"(?<=://)([^/?#@]*?):[^/?#]*@", r"\1:***@", host, count=1)
    if not host.startswith(("http://", "https://")):
        raise AuthError(f"--host must be an http:// or https:// URL, got {shown!r}")
    if any(ord(ch) <= 32 or ord(ch) == 127 for ch in host):
        raise AuthError(f"--host {shown!r} contains a space or control character (a trailing newline?)")
    import urllib.parse

    try:  # a port past 65535 was "cannot reach ..., Failed to parse", exit 1 (stranger trial)
        parts = urllib.parse.urlsplit(host)
        parts.port  # noqa: B018 - parsing it is the check
    except ValueError as exc:
        raise AuthError(f"--host {shown!r} is not a URL: {exc}") from None
    if not parts.hostname:
        raise AuthError(f"--host {shown!r} names no host")
    if "?" in host or "#" in host:  # the API paths were appended after it: wrong URLs (stranger trial)
        raise AuthError(f"--host {shown!r} has a query or fragment (?, #): give the API's base URL, "
                        "e.g. http://localhost:8080")
    if "@" in parts.netloc:  # never sent: the client sends a bearer token only
        raise AuthError(f"--host {shown!r} carries a user name or password, which is not sent; "
                        "drop it and give a bearer token (--token)")
    return host.rstrip("/")


def connect(host: str, auth: Auth, *, namespace: str | None = None, timeout: float = 10.0) -> Connection:
    """Check the server answers, then build the ``kfp.Client``.

    The check is one GET of ``/apis/v2beta1/healthz`` with a timeout and no retries, because
    ``kfp.Client()`` itself retries a failing healthz five times, 5 s apart, and waits
    without a timeout on a host that drops packets.

    Args:
        host: KFP API endpoint, e.g. ``http://localhost:8080``.
        auth: credentials from :func:`resolve_auth`.
        namespace: Kubernetes namespace for multi-user deployments (experiments, runs).
        timeout: seconds each request (the health check and every later one) may take to connect,
            and to answer.

    Returns:
        The connection.

    Raises:
        KfpError: the host is unreachable, times out, refuses the credentials, or is not a KFP API.

    """
    import kfp
    import kfp_server_api
    import urllib3

    host = check_host(host)
    configuration = kfp_server_api.Configuration(host=host)
    # No retries on connection errors, but follow redirects: a login proxy's redirect should
    # end on its login page, which is then named as such below.
    configuration.retries = urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=5)
    if auth.token:
        configuration.api_key["authorization"] = auth.token
        configuration.api_key_prefix["authorization"] = "Bearer"
    healthz = kfp_server_api.HealthzServiceApi(kfp_server_api.ApiClient(configuration))
    with api_errors(host, "health check", auth), _deadline(2 * timeout):
        # Raw answer: the generated client turns any non-JSON page into an empty healthz object.
        raw = healthz.healthz_service_get_healthz(_request_timeout=(timeout, timeout), _preload_content=False)
        data = raw.data
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        kind = raw.headers.get("Content-Type", "no content type")
        raise KfpError(
            f"{host} answered /apis/v2beta1/healthz with {kind}, not the KFP API's JSON "
            f"(a login page? credentials used: {auth.source}; see --token)"
        )
    checked = kfp_server_api.V2beta1GetHealthzResponse(multi_user=answer.get("multi_user"))

    class Client(kfp.Client):
        def get_kfp_healthz(self, sleep_duration: int = 5) -> Any:
            # kfp.Client() asks healthz again itself, without a timeout and with five retries (stranger
            # trial): it gets the answer just checked instead.
            return checked

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), api_errors(host, "connecting", auth):
        # The warning only says the client needs a v2 server, which the healthz answer just showed.
        warnings.simplefilter("ignore", FutureWarning)
        client = Client(host=host, existing_token=auth.token, namespace=namespace or "kubeflow")
    _bound_requests(client, timeout)
    # Without --namespace, kfp.Client falls back to its saved context or, in a pod, the pod's namespace.
    namespace = namespace or client.get_user_namespace() or None
    return Connection(client=client, host=host, auth=auth, namespace=namespace, multi_user=bool(answer.get("multi_user")),
                      timeout=timeout)


def _bound_requests(client: kfp.Client, timeout: float) -> None:
    """Send every later request of ``client`` with ``timeout`` and no retries, and refuse an answer that
    is not a JSON object.

    kfp.Client sends without a timeout and with urllib3's three retries: past the health check, `runs`
    waited 659 s on a server that never answered; and the generated client reads any page as an empty
    object, so an HTML page was "no runs" (stranger trial).
    """
    import urllib3

    rest = client._run_api.api_client.rest_client  # the ApiClient every API of kfp.Client 2.17 shares
    rest.pool_manager.connection_pool_kw["retries"] = urllib3.Retry(
        total=None, connect=0, read=0, status=0, other=0, redirect=5
    )
    send = rest.request

    def request(*args: Any, _request_timeout: Any = None, _preload_content: bool = True, **kwargs: Any) -> Any:
        # A (connect, read) pair: the generated client drops a lone float. Both at most, whole.
        with _deadline(2 * timeout):
            response = send(*args, _request_timeout=_request_timeout or (timeout, timeout),
                            _preload_content=_preload_content, **kwargs)
        if _preload_content:  # only 2xx answers come back; the others are ApiExceptions
            try:
                answer = json.loads(response.data)
            except ValueError:
                answer = None
            if not isinstance(answer, dict):
                raise _NotTheApi(response.getheader("Content-Type") or "no content type")
        return response

    rest.request = request


@contextlib.contextmanager
def api_errors(host: str, action: str, auth: Auth | None = None, timeout: float | None = None) -> Iterator[None]:
    """Turn API and connection errors raised inside the block into one-line KfpErrors.

    Messages name the host and the action, for refused credentials where they came from, and for an
    answer that did not come within ``timeout`` (requests after the health check) that timeout.
    """
    import kfp_server_api
    import urllib3

    try:
        yield
    except kfp_server_api.ApiException as exc:
        raise KfpError(_http_error_message(host, action, exc, auth)) from None
    except _NotTheApi as exc:
        raise KfpError(f"{host} answered with {exc}, not the KFP API's JSON ({action})") from None
    except _TooSlow as exc:
        raise KfpError(f"{host} did not finish answering within {exc.args[0]:g} s, twice --timeout (to connect, "
                       f"then to answer) ({action})") from None
    except urllib3.exceptions.HTTPError as exc:
        if timeout is not None and isinstance(getattr(exc, "reason", None) or exc, urllib3.exceptions.ReadTimeoutError):
            raise KfpError(f"{host} did not answer within {timeout:g} s ({action})") from None
        raise KfpError(f"cannot reach Kubeflow Pipelines at {host} ({action}): {_connection_reason(exc)}") from None


def _answered_id(conn: Connection, action: str, ident: str | None, what: str) -> str:
    """The id a create call's answer carries; an answer of ``{}`` printed "created (id None)" (stranger trial)."""
    if not ident:
        raise KfpError(f"{conn.host} answered without {what} id ({action}): not the KFP API's answer")
    return ident


def _http_error_message(host: str, action: str, exc: Any, auth: Auth | None) -> str:
    if exc.status == 0:  # the generated client's wrapper for TLS and transport errors
        return f"cannot reach Kubeflow Pipelines at {host} ({action}): {exc.reason}"
    detail = ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        body = json.loads(exc.body)
        detail = body.get("error_message") or body.get("message") or ""
    message = f"{host} answered HTTP {exc.status} {exc.reason or ''}".rstrip() + f" ({action})"
    if detail:
        message += f": {detail}"
    if exc.status in (401, 403):
        used = auth.source if auth else "unknown"
        message += f"; credentials used: {used} (see --token, --auth)"
    elif exc.status == 404 and action == "health check":
        message += "; is this the Kubeflow Pipelines API endpoint?"
    return message


def _connection_reason(exc: Exception) -> str:
    """The innermost cause urllib3 reports, in a few words."""
    import urllib3

    reason: Any = getattr(exc, "reason", None) or exc
    text = str(reason)
    # Refusals first: urllib3's NewConnectionError subclasses ConnectTimeoutError.
    if "Connection refused" in text:
        return "connection refused"
    if "Name or service not known" in text or "nodename nor servname" in text or "getaddrinfo failed" in text:
        return "unknown host name"
    if "timed out" in text or (
        isinstance(reason, urllib3.exceptions.TimeoutError) and not isinstance(reason, urllib3.exceptions.NewConnectionError)
    ):
        return "timed out"
    return text.split(": ", 1)[-1] if isinstance(reason, urllib3.exceptions.NewConnectionError) else text


def _name_filter(name: str) -> str:
    return json.dumps({"predicates": [{"operation": _EQUALS, "key": "display_name", "stringValue": name}]})


def find_pipeline_id(conn: Connection, name: str) -> str | None:
    """The id of the pipeline displayed as ``name``, or None."""
    with api_errors(conn.host, f"looking up pipeline {name!r}", conn.auth, conn.timeout):
        try:
            return conn.client.get_pipeline_id(name)
        except ValueError as exc:  # several pipelines of that name
            raise KfpError(str(exc)) from None


def list_versions(conn: Connection, pipeline_id: str) -> list[kfp_server_api.V2beta1PipelineVersion]:
    """All versions of a pipeline, newest first (every page)."""
    versions = []
    token = ""
    with api_errors(conn.host, "listing pipeline versions", conn.auth, conn.timeout):
        while True:
            page = conn.client.list_pipeline_versions(
                pipeline_id, page_token=token, page_size=100, sort_by="created_at desc"
            )
            versions.extend(page.pipeline_versions or [])
            token = page.next_page_token or ""
            if not token:
                return versions


def upload(
    conn: Connection,
    compiled: CompiledPipeline,
    *,
    name: str | None = None,
    version: str | None = None,
    now: datetime.datetime | None = None,
) -> UploadResult:
    """Upload a compiled pipeline, or add it as a version of the pipeline of that name.

    A new pipeline is created empty and the package uploaded as its first version, so every
    version (the first one too) carries the requested or default name. Idempotent: without
    ``version``, content already uploaded (same sha256, recorded in the version description) is
    not uploaded again; with ``version``, an existing version of that name and content is
    reused and one with other content is refused.

    Args:
        conn: the server.
        compiled: the pipeline package.
        name: pipeline name on the server (default: the IR's pipeline name).
        version: version name (default: :func:`default_version_name`).
        now: time for the default version name (tests).

    Returns:
        What exists on the server now, and what this call created.

    Raises:
        KfpError: the server refused, or ``version`` exists with other content.

    """
    import kfp_server_api

    name = name or compiled.name
    marker = HASH_MARKER + compiled.content_hash
    pipeline_id = find_pipeline_id(conn, name)
    created_pipeline = pipeline_id is None
    if pipeline_id is None:
        action = f"creating pipeline {name!r}"
        with api_errors(conn.host, action, conn.auth, conn.timeout):
            body = kfp_server_api.V2beta1Pipeline(name=name, display_name=name, description=compiled.description or None)
            pipeline_id = conn.client.pipelines.pipeline_service_create_pipeline(pipeline=body).pipeline_id
        pipeline_id = _answered_id(conn, action, pipeline_id, "a pipeline")
    else:
        versions = list_versions(conn, pipeline_id)
        if version is None:
            match = next((v for v in versions if marker in (v.description or "")), None)
        else:
            match = next((v for v in versions if v.display_name == version), None)
            if match is not None and marker not in (match.description or ""):
                raise KfpError(
                    f"pipeline {name!r} on {conn.host} already has a version {version!r} with other content; "
                    "choose another --version"
                )
        if match is not None:
            return UploadResult(pipeline_id, name, match.pipeline_version_id, match.display_name, False, False)
    version_name = version or default_version_name(compiled.content_hash, now)
    description = f"Compiled by resilient-training {__version__} from {compiled.key}; {marker}"
    action = f"uploading version {version_name!r} of {name!r}"
    with api_errors(conn.host, action, conn.auth, conn.timeout), _quiet():
        uploaded = conn.client.upload_pipeline_version(
            str(compiled.path), version_name, pipeline_id=pipeline_id, description=description
        )
    version_id = _answered_id(conn, action, uploaded.pipeline_version_id, "a pipeline version")
    return UploadResult(pipeline_id, name, version_id, version_name, created_pipeline, True)


def resolve_version(conn: Connection, pipeline_name: str, version: str | None) -> RunSource:
    """The uploaded version to run: ``version`` by name, else the newest.

    Raises:
        KfpError: no such pipeline or version on the server (with the command that uploads it).

    """
    pipeline_id = find_pipeline_id(conn, pipeline_name)
    if pipeline_id is None:
        raise KfpError(
            f"pipeline {pipeline_name!r} is not on {conn.host}; upload it first "
            f"(resilient-training upload --host {conn.host}) or send the package with --package"
        )
    with api_errors(conn.host, f"finding a version of {pipeline_name!r}", conn.auth, conn.timeout):
        if version is None:
            page = conn.client.list_pipeline_versions(pipeline_id, page_size=1, sort_by="created_at desc")
        else:
            page = conn.client.list_pipeline_versions(pipeline_id, page_size=2, filter=_name_filter(version))
    found = page.pipeline_versions or []
    if not found:
        what = f"version {version!r}" if version else "versions"
        raise KfpError(f"pipeline {pipeline_name!r} on {conn.host} has no {what}")
    chosen = found[0]
    return RunSource(
        label=f"{pipeline_name} version {chosen.display_name}",
        pipeline_id=pipeline_id,
        version_id=chosen.pipeline_version_id,
    )


def _check_namespace(conn: Connection) -> None:
    """Experiments and runs of a multi-user installation live in a namespace: say so up front."""
    if conn.multi_user and not conn.namespace:
        raise KfpError(
            f"{conn.host} is a multi-user Kubeflow Pipelines: give --namespace (your profile's namespace) "
            "for experiments and runs"
        )


def ensure_experiment(conn: Connection, name: str) -> tuple[str, bool]:
    """The id of experiment ``name``, created when missing.

    Returns:
        The experiment id, and whether this call created it.

    """
    _check_namespace(conn)
    with api_errors(conn.host, f"finding experiment {name!r}", conn.auth, conn.timeout):
        try:
            return conn.client.get_experiment(experiment_name=name, namespace=conn.namespace).experiment_id, False
        except ValueError as exc:
            if not str(exc).startswith("No experiment is found"):
                raise KfpError(f"experiment {name!r} on {conn.host}: {exc}") from None
    action = f"creating experiment {name!r}"
    with api_errors(conn.host, action, conn.auth, conn.timeout), _quiet():
        experiment_id = conn.client.create_experiment(name, namespace=conn.namespace).experiment_id
    return _answered_id(conn, action, experiment_id, "an experiment"), True


def find_experiment(conn: Connection, name: str) -> str:
    """The id of an existing experiment.

    Raises:
        KfpError: there is none of that name.

    """
    _check_namespace(conn)
    with api_errors(conn.host, f"finding experiment {name!r}", conn.auth, conn.timeout):
        try:
            return conn.client.get_experiment(experiment_name=name, namespace=conn.namespace).experiment_id
        except ValueError as exc:
            raise KfpError(f"experiment {name!r} on {conn.host}: {exc}") from None


def _source_kwargs(source: RunSource) -> dict[str, Any]:
    if source.package_path is not None:
        return {"pipeline_package_path": str(source.package_path)}
    return {"pipeline_id": source.pipeline_id, "version_id": source.version_id}


def submit(
    conn: Connection, *, experiment_id: str, run_name: str, source: RunSource, params: Mapping[str, Any],
    service_account: str | None = None,
) -> kfp_server_api.V2beta1Run:
    """Create one run of ``source`` in an experiment, its steps run as ``service_account`` (None: the server's).

    Returns:
        The run as the server created it.

    """
    action = f"creating run {run_name!r}"
    with api_errors(conn.host, action, conn.auth, conn.timeout), _quiet():
        # enable_caching=False: kfp applies it to a sent package's top-level tasks (a stored version keeps
        # what was compiled in, which is off for every step of this project's pipelines).
        run = conn.client.run_pipeline(
            experiment_id=experiment_id, job_name=run_name, params=dict(params), enable_caching=False,
            service_account=service_account, **_source_kwargs(source)
        )
    _answered_id(conn, action, run.run_id, "a run")
    return run


def find_recurring_run(conn: Connection, experiment_id: str, name: str) -> str | None:
    """The id of the recurring run called ``name`` in an experiment, or None."""
    with api_errors(conn.host, f"looking up recurring run {name!r}", conn.auth, conn.timeout):
        page = conn.client.list_recurring_runs(experiment_id=experiment_id, page_size=2, filter=_name_filter(name))
    found = page.recurring_runs or []
    return found[0].recurring_run_id if found else None


def schedule(
    conn: Connection,
    *,
    experiment_id: str,
    job_name: str,
    cron: str,
    max_concurrency: int,
    no_catchup: bool,
    source: RunSource,
    params: Mapping[str, Any],
    service_account: str | None = None,
) -> kfp_server_api.V2beta1RecurringRun:
    """Create an enabled recurring run (cron already checked by :func:`kfp_cron.validate_cron`), its
    steps run as ``service_account`` (None: the server's).

    Raises:
        KfpError: a recurring run of that name exists in the experiment, or the server refused.

    """
    existing = find_recurring_run(conn, experiment_id, job_name)
    if existing is not None:
        raise KfpError(
            f"a recurring run named {job_name!r} already exists in that experiment on {conn.host} (id {existing}); "
            "choose another --job-name, or delete it first"
        )
    action = f"creating recurring run {job_name!r}"
    with api_errors(conn.host, action, conn.auth, conn.timeout):
        job = conn.client.create_recurring_run(
            experiment_id=experiment_id,
            job_name=job_name,
            cron_expression=cron,
            max_concurrency=max_concurrency,
            no_catchup=no_catchup,
            params=dict(params),
            enabled=True,
            enable_caching=False,  # as in submit
            service_account=service_account,
            **_source_kwargs(source),
        )
    _answered_id(conn, action, job.recurring_run_id, "a recurring run")
    return job


def list_runs(conn: Connection, *, experiment_id: str | None = None, limit: int = 20) -> list[kfp_server_api.V2beta1Run]:
    """The newest runs, of one experiment or all."""
    _check_namespace(conn)
    with api_errors(conn.host, "listing runs", conn.auth, conn.timeout):
        page = conn.client.list_runs(
            experiment_id=experiment_id, namespace=conn.namespace, page_size=limit, sort_by="created_at desc"
        )
    return list(page.runs or [])


def list_recurring_runs(
    conn: Connection, *, experiment_id: str | None = None, limit: int = 20
) -> list[kfp_server_api.V2beta1RecurringRun]:
    """The newest recurring runs, of one experiment or all."""
    _check_namespace(conn)
    with api_errors(conn.host, "listing recurring runs", conn.auth, conn.timeout):
        page = conn.client.list_recurring_runs(
            experiment_id=experiment_id, namespace=conn.namespace, page_size=limit, sort_by="created_at desc"
        )
    return list(page.recurring_runs or [])


def ui_link(conn: Connection, kind: str, ident: str) -> str:
    """The KFP UI page of a run (``runs``), recurring run (``recurringrun``) or pipeline."""
    return f"{conn.host}/#/{kind}/details/{ident}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # kfp.Client prints "Run details: <link>" and the like; the CLI prints its own summary.
    with contextlib.redirect_stdout(io.StringIO()):
        yield
