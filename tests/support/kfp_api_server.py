"""A small stateful Kubeflow Pipelines v2beta1 API server for tests (http.server in a thread).

It speaks the endpoints kfp.Client 2.17 calls for upload/submit/schedule/runs/schedules, with
the real server's shapes: snake_case JSON (protojson UseProtoNames), int64 as strings, enums as
names, multipart uploads in the ``uploadfile`` field, 409 on duplicate names, filters on
``display_name`` with EQUALS, ``created_at desc`` sorting and page tokens. Every request is
recorded so tests can assert what the client sent.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import threading
import uuid
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

API = "/apis/v2beta1"


@dataclasses.dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    json: Any = None
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class FakeKfpServer:
    """State plus a ThreadingHTTPServer bound to 127.0.0.1 on a free port."""

    def __init__(
        self, *, token: str | None = None, max_page_size: int = 100, login_proxy: bool = False, port: int = 0,
        multi_user: bool = False, broken: str | None = None, hang_s: float = 5.0,
        broken_paths: tuple[str, ...] = ("",),
    ) -> None:
        self.required_token = token
        self.multi_user = multi_user
        # Like a Kubeflow install behind an auth proxy: API calls are redirected to an HTML login page.
        self.login_proxy = login_proxy
        self.max_page_size = max_page_size
        # Not quite the KFP API (stranger trial): healthz answers as the API does, every other endpoint
        # "hang"s (hang_s, or until the server stops, then closes without an answer), answers "empty" JSON
        # {} or an "html" page, each with 200; only those under API + one of broken_paths, when given.
        # "trickle": a JSON answer one byte every 0.2 s (healthz too), each byte well within any read timeout.
        assert broken in (None, "hang", "empty", "html", "trickle"), broken
        self.broken = broken
        self.broken_paths = broken_paths
        self.hang_s = hang_s
        self._release = threading.Event()
        self.requests: list[Request] = []
        self.pipelines: dict[str, dict[str, Any]] = {}
        self.versions: dict[str, dict[str, Any]] = {}
        self.experiments: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, dict[str, Any]] = {}
        self.recurring_runs: dict[str, dict[str, Any]] = {}
        self._clock = itertools.count()
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> FakeKfpServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def calls(self, method: str, path: str) -> list[Request]:
        """Recorded requests with this method and exact path."""
        return [r for r in self.requests if r.method == method and r.path == path]

    # --- dispatch -------------------------------------------------------------------------

    def handle(self, request: Request) -> tuple[int, Any]:
        with self._lock:
            self.requests.append(request)
            try:
                self._authorize(request)
                return 200, self._route(request)
            except ApiError as exc:
                return exc.status, {"error_message": exc.message, "error_details": exc.message, "code": exc.status}

    def _authorize(self, request: Request) -> None:
        if self.required_token is not None and request.headers.get("authorization") != f"Bearer {self.required_token}":
            raise ApiError(401, "Unauthenticated: missing or invalid bearer token")

    def _route(self, r: Request) -> Any:
        parts = r.path.removeprefix(API).strip("/").split("/")
        if not r.path.startswith(API + "/"):
            raise ApiError(404, f"no route {r.path}")
        match (r.method, parts):
            case ("GET", ["healthz"]):
                return {"multi_user": self.multi_user, "pipeline_store": "database"}
            case ("GET", ["pipelines"]):
                return self._page(r, self.pipelines.values(), "pipelines")
            case ("POST", ["pipelines"]):
                return self._create_pipeline(r.json)
            case ("POST", ["pipelines", "upload_version"]):
                return self._upload_version(r)
            case ("GET", ["pipelines", pipeline_id, "versions"]):
                self._get(self.pipelines, pipeline_id, "pipeline")
                found = [v for v in self.versions.values() if v["pipeline_id"] == pipeline_id]
                return self._page(r, found, "pipeline_versions")
            case ("POST", ["experiments"]):
                return self._create_experiment(r.json)
            case ("GET", ["experiments"]):
                found = [e for e in self.experiments.values() if e.get("namespace", "") == r.query.get("namespace", "")]
                return self._page(r, found, "experiments")
            case ("POST", ["runs"]):
                return self._create_run(r.json, self.runs, "run_id", state={"state": "PENDING"})
            case ("GET", ["runs"]):
                return self._page(r, self._in_experiment(r, self.runs), "runs")
            case ("POST", ["recurringruns"]):
                return self._create_recurring_run(r.json)
            case ("GET", ["recurringruns"]):
                # recurring_run.proto names this field recurringRuns (camelCase) in the proto itself.
                return self._page(r, self._in_experiment(r, self.recurring_runs), "recurringRuns")
        raise ApiError(404, f"no route {r.method} {r.path}")

    # --- resources ------------------------------------------------------------------------

    def _now(self) -> str:
        # A fixed base plus one second per object: creation order is the created_at order.
        base = datetime.datetime(2026, 11, 29, 12, 0, 0, tzinfo=datetime.UTC)
        return (base + datetime.timedelta(seconds=next(self._clock))).strftime("%Y-%m-%dT%H:%M:%SZ")

    @staticmethod
    def _get(table: dict[str, dict[str, Any]], ident: str, kind: str) -> dict[str, Any]:
        if ident not in table:
            raise ApiError(404, f"{kind} {ident} not found")
        return table[ident]

    def _create_pipeline(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("display_name") or body.get("name")
        if not name:
            raise ApiError(400, "pipeline display_name is required")
        if any(p["display_name"] == name for p in self.pipelines.values()):
            raise ApiError(409, f"pipeline {name} already exists")
        pipeline = {
            "pipeline_id": str(uuid.uuid4()), "name": body.get("name") or name, "display_name": name,
            "description": body.get("description", ""), "created_at": self._now(), "namespace": body.get("namespace", ""),
        }
        self.pipelines[pipeline["pipeline_id"]] = pipeline
        return pipeline

    def _upload_version(self, r: Request) -> dict[str, Any]:
        if "uploadfile" not in r.files:
            raise ApiError(400, "Failed to create a pipeline version")
        pipeline_id = r.query.get("pipelineid", "")
        self._get(self.pipelines, pipeline_id, "pipeline")
        name = r.query.get("name") or r.query.get("display_name")
        if any(v["pipeline_id"] == pipeline_id and v["display_name"] == name for v in self.versions.values()):
            raise ApiError(409, "Failed to create a pipeline version")
        documents = list(yaml.safe_load_all(r.files["uploadfile"]))
        if not documents or "pipelineInfo" not in documents[0]:
            raise ApiError(400, "Failed to create a pipeline version: not a pipeline spec")
        version = {
            "pipeline_id": pipeline_id, "pipeline_version_id": str(uuid.uuid4()), "name": name, "display_name": name,
            "description": r.query.get("description", ""), "created_at": self._now(), "pipeline_spec": documents[0],
        }
        self.versions[version["pipeline_version_id"]] = version
        return version

    def _create_experiment(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("display_name")
        namespace = body.get("namespace") or ""
        if not name:
            raise ApiError(400, "experiment display_name is required")
        if any(e["display_name"] == name and e["namespace"] == namespace for e in self.experiments.values()):
            raise ApiError(409, f"experiment {name} already exists")
        experiment = {
            "experiment_id": str(uuid.uuid4()), "display_name": name, "description": body.get("description") or "",
            "namespace": namespace, "created_at": self._now(), "storage_state": "AVAILABLE",
        }
        self.experiments[experiment["experiment_id"]] = experiment
        return experiment

    def _check_source(self, body: dict[str, Any]) -> None:
        self._get(self.experiments, body.get("experiment_id", ""), "experiment")
        reference = body.get("pipeline_version_reference")
        if reference:
            version = self._get(self.versions, reference.get("pipeline_version_id", ""), "pipeline version")
            if version["pipeline_id"] != reference.get("pipeline_id"):
                raise ApiError(400, "pipeline version does not belong to the pipeline")
        elif not body.get("pipeline_spec"):
            raise ApiError(400, "either pipeline_spec or pipeline_version_reference is required")

    def _create_run(self, body: dict[str, Any], table: dict[str, dict[str, Any]], id_key: str,
                    state: dict[str, Any]) -> dict[str, Any]:
        self._check_source(body)
        if not body.get("display_name"):
            raise ApiError(400, "display_name is required")
        created = {**body, id_key: str(uuid.uuid4()), "created_at": self._now(), **state}
        table[created[id_key]] = created
        return created

    def _create_recurring_run(self, body: dict[str, Any]) -> dict[str, Any]:
        # The real server's checks (recurring_run_server.go): max concurrency 1-10, a parsable cron.
        max_concurrency = int(body.get("max_concurrency") or 0)
        if not 1 <= max_concurrency <= 10:
            raise ApiError(400, f"The max concurrency of the recurring run is out of range. Support 1-10. "
                                f"Received {max_concurrency}.")
        cron = (body.get("trigger") or {}).get("cron_schedule", {}).get("cron")
        if cron is not None and not 5 <= len(cron.split()) <= 6 and not cron.startswith("@"):
            raise ApiError(400, "Schedule cron is not a supported format")
        state = {"status": "ENABLED" if body.get("mode") == "ENABLE" else "DISABLED",
                 "max_concurrency": str(max_concurrency), "namespace": body.get("namespace", "")}
        return self._create_run(body, self.recurring_runs, "recurring_run_id", state=state)

    def _in_experiment(self, r: Request, table: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        experiment_id = r.query.get("experiment_id")
        return [x for x in table.values() if experiment_id is None or x.get("experiment_id") == experiment_id]

    def _page(self, r: Request, items: Any, key: str) -> dict[str, Any]:
        items = list(items)
        if r.query.get("filter"):
            items = [x for x in items if _matches(x, json.loads(r.query["filter"]))]
        if r.query.get("sort_by", "").strip() == "created_at desc":
            items.sort(key=lambda x: x["created_at"], reverse=True)
        size = min(int(r.query.get("page_size") or 10), self.max_page_size)
        start = int(r.query.get("page_token") or 0)
        page = items[start:start + size]
        answer: dict[str, Any] = {"total_size": len(items)}
        if page:
            answer[key] = page
        if start + size < len(items):
            answer["next_page_token"] = str(start + size)
        return answer


def _matches(item: dict[str, Any], filter_: dict[str, Any]) -> bool:
    for predicate in filter_.get("predicates", []):
        if predicate.get("operation") not in (1, "EQUALS"):
            raise ApiError(400, f"fake server supports EQUALS only, got {predicate.get('operation')}")
        if item.get(predicate["key"]) != predicate.get("stringValue", predicate.get("string_value")):
            return False
    return True


def _handler(server: FakeKfpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
            pass

        def _serve(self) -> None:
            url = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            request = Request(self.command, url.path, query, {k.lower(): v for k, v in self.headers.items()})
            content_type = self.headers.get("Content-Type", "")
            if content_type.startswith("multipart/form-data"):
                message = BytesParser(policy=HTTP).parsebytes(
                    f"Content-Type: {content_type}\r\n\r\n".encode() + body
                )
                for part in message.iter_parts():
                    request.files[part.get_param("name", header="content-disposition")] = part.get_payload(decode=True)
            elif body:
                request.json = json.loads(body)
            if server.login_proxy:
                server.requests.append(request)
                if url.path.startswith(API):
                    self.send_response(302)
                    self.send_header("Location", "/login")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                page = b"<html><body>Log in</body></html>"
                self.send_response(200)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)
                return
            if server.broken == "trickle" and url.path.startswith(tuple(API + p for p in server.broken_paths)):
                server.requests.append(request)
                data = b"{" + b" " * 200 + b"}"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                for byte in data:
                    if server._release.wait(0.2):
                        break
                    try:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                    except OSError:
                        break
                self.close_connection = True
                return
            if (server.broken and not url.path.endswith("/healthz")
                    and url.path.startswith(tuple(API + p for p in server.broken_paths))):
                server.requests.append(request)
                if server.broken == "hang":
                    server._release.wait(server.hang_s)
                    self.close_connection = True
                    return
                self._answer(200, b"{}" if server.broken == "empty" else b"<html><body>Hello</body></html>",
                             "application/json" if server.broken == "empty" else "text/html; charset=utf-8")
                return
            status, answer = server.handle(request)
            self._answer(status, json.dumps(answer).encode())

        def _answer(self, status: int, data: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _serve

    return Handler
