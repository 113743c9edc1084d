"""The project's pipelines compiled to KFP IR YAML, loaded back, and fingerprinted.

Pipelines are found through a registry: a ``dict[str, Callable]`` of ``@dsl.pipeline``
functions, by default ``resilient_training.pipelines.PIPELINES``. The first entry is the
default pipeline of ``upload``/``submit``/``schedule``.
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import hashlib
import importlib
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from resilient_training.kfp.params import PipelineInput, pipeline_inputs

DEFAULT_REGISTRY = "resilient_training.pipelines:PIPELINES"


class CompileError(ValueError):
    """No such pipeline, no registry, or a pipeline that does not compile or load back."""


@dataclasses.dataclass(frozen=True, slots=True)
class CompiledPipeline:
    """One pipeline compiled to a file, with what the server commands need from it."""

    key: str
    """Name in the registry (what ``--pipeline`` takes)."""
    path: Path
    name: str
    """``pipelineInfo.name`` of the IR: the pipeline's name on the KFP server by default."""
    description: str
    content_hash: str
    """sha256 of the compiled file: the same source compiles to the same bytes."""
    spec: dict[str, Any]
    """The PipelineSpec (first YAML document)."""
    num_tasks: int

    @property
    def inputs(self) -> dict[str, PipelineInput]:
        return pipeline_inputs(self.spec)

    def caching_summary(self) -> str:
        """One line for ``submit``/``schedule``: is any step of this pipeline served from a KFP cache?"""
        steps = executor_tasks(self.spec)
        cached = cached_tasks(self.spec)
        if not cached:
            return (f"caching: off for all {len(steps)} steps (compiled in: a KFP server runs each step anew, "
                    "never from an earlier run)")
        return (f"caching: ON for {len(cached)} of {len(steps)} steps ({', '.join(cached)}): a KFP server may serve "
                "them from an earlier run with the same inputs")


def executor_tasks(spec: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every task of a PipelineSpec that runs a container, in every DAG (root, exit handler, conditions).

    Keys are ``<dag component>/<task>`` (``root/teardown-storage``, ``comp-condition-3/promote-model``).
    """
    components = spec.get("components", {})
    dags = {"root": spec.get("root", {}), **components}
    found = {}
    for dag_name, component in dags.items():
        for task_name, task in (component.get("dag") or {}).get("tasks", {}).items():
            ref = components.get(task.get("componentRef", {}).get("name", ""), {})
            if "executorLabel" in ref:
                found[f"{dag_name}/{task_name}"] = task
    return found


def cached_tasks(spec: Mapping[str, Any]) -> list[str]:
    """The container tasks a KFP server may serve from its cache (``cachingOptions.enableCache``)."""
    return sorted(key for key, task in executor_tasks(spec).items()
                  if (task.get("cachingOptions") or {}).get("enableCache"))


def load_registry(reference: str = DEFAULT_REGISTRY) -> dict[str, Callable[..., Any]]:
    """Import a pipeline registry.

    Args:
        reference: ``module:attribute`` naming a dict of pipeline name -> ``@dsl.pipeline``.

    Returns:
        The registry (insertion order kept: the first entry is the default pipeline).

    Raises:
        CompileError: the module or attribute is missing, or the registry is empty.

    """
    module_name, _, attribute = reference.partition(":")
    attribute = attribute or "PIPELINES"
    if not module_name.strip():
        raise CompileError(f"--registry {reference!r} names no module: give MODULE[:ATTRIBUTE]")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError) as exc:  # ValueError: a relative name such as ".x"
        raise CompileError(f"cannot import pipeline registry module {module_name!r}: {exc}") from None
    registry = getattr(module, attribute, None)
    if not isinstance(registry, Mapping) or not registry:
        raise CompileError(f"no pipelines registered: {module_name}.{attribute} is missing or empty")
    return dict(registry)


def select(registry: Mapping[str, Callable[..., Any]], name: str | None) -> dict[str, Callable[..., Any]]:
    """The pipelines a command works on: all of them, or the one named.

    Raises:
        CompileError: ``name`` is not in the registry (the message lists the known names), or
            an entry is not a pipeline.

    """
    if name is not None and name not in registry:
        raise CompileError(f"unknown pipeline {name!r}; known pipelines: {', '.join(map(str, registry))}")
    selected = dict(registry) if name is None else {name: registry[name]}
    from kfp.dsl.base_component import BaseComponent

    for key, pipeline in selected.items():  # before anything is compiled or written
        if not isinstance(pipeline, BaseComponent):
            raise CompileError(f"registry entry {key!r} is a {type(pipeline).__name__}, not a @dsl.pipeline")
    return selected


def default_pipeline(registry: Mapping[str, Callable[..., Any]], name: str | None) -> tuple[str, Callable[..., Any]]:
    """The one pipeline ``upload``/``submit``/``schedule`` act on: ``name``, else the first registered."""
    key = name if name is not None else next(iter(registry))
    return key, select(registry, key)[key]


def output_paths(keys: list[str], output: Path) -> dict[str, Path]:
    """Where each pipeline's YAML goes: ``output`` itself when it names a .yaml file, else ``output/<key>.yaml``.

    Raises:
        CompileError: a single file was asked for several pipelines, or a path cannot be written.

    """
    if output.suffix.lower() in (".yaml", ".yml"):  # X.YAML made a directory (stranger trial)
        if len(keys) != 1:
            raise CompileError(
                f"-o {output} is one file but {len(keys)} pipelines are selected ({', '.join(keys)}); "
                "give a directory or --pipeline NAME"
            )
        paths = {keys[0]: output}
    else:
        paths = {key: output / f"{key}.yaml" for key in keys}
    from resilient_training.run.paths import check_writable

    try:  # before anything is compiled or created
        for path in paths.values():
            check_writable(path, "-o", directory=False)
    except ValueError as exc:
        raise CompileError(str(exc)) from None
    return paths


def compile_pipeline(key: str, pipeline: Callable[..., Any], path: Path,
                     defaults: Mapping[str, Any] | None = None) -> CompiledPipeline:
    """Compile one pipeline to IR YAML and prove the file loads back with kfp.

    Args:
        key: the pipeline's registry name.
        pipeline: the ``@dsl.pipeline`` function.
        path: the YAML file to write (parents are created).
        defaults: parameters whose defaults the IR gets instead of the function's (typed, checked
            by the caller): what a KFP UI's "Create run" form starts from.

    Returns:
        The compiled pipeline.

    Raises:
        CompileError: the pipeline does not compile, or the file does not load back as the
            same pipeline.
        OSError: ``path`` cannot be written.

    """
    import yaml
    from kfp import compiler, components

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        compiler.Compiler().compile(pipeline_func=pipeline, package_path=str(path),
                                    pipeline_parameters=dict(defaults) if defaults else None)
    except OSError as exc:
        if exc.filename == str(path):  # the file system's refusal (/proc, a full disk), not the pipeline's
            raise
        raise CompileError(f"pipeline {key!r} does not compile: {type(exc).__name__}: {exc}") from None
    except Exception as exc:  # kfp raises many types for user errors; all mean "does not compile"
        raise CompileError(f"pipeline {key!r} does not compile: {type(exc).__name__}: {exc}") from None
    data = _stable_header(path.read_text(), defaults or {}).encode()
    path.write_bytes(data)
    try:
        documents = list(yaml.safe_load_all(data))
    except yaml.YAMLError as exc:
        raise CompileError(f"pipeline {key!r} compiled to YAML that does not load back: {exc}"[:500]) from None
    spec = documents[0]
    name = spec.get("pipelineInfo", {}).get("name", "")
    loaded = components.load_component_from_file(str(path))
    if loaded.name != name or not spec.get("root", {}).get("dag", {}).get("tasks"):
        raise CompileError(f"{path} does not load back as pipeline {name!r} with a DAG")
    return CompiledPipeline(
        key=key,
        path=path,
        name=name,
        description=spec.get("pipelineInfo", {}).get("description", ""),
        content_hash=hashlib.sha256(data).hexdigest(),
        spec=spec,
        num_tasks=len(spec["root"]["dag"]["tasks"]),
    )


_HEADER_DEFAULT = re.compile(r"^(#    \S+: \S+ \[Default: )(.*)\]$")


def _sorted(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _sorted(value[key]) for key in sorted(value)}
    return [_sorted(item) for item in value] if isinstance(value, list) else value


def _stable_header(text: str, defaults: Mapping[str, Any]) -> str:
    """The header comment kfp writes, with the defaults the IR was compiled with (kfp writes the
    function's) and dict defaults in sorted key order, as the YAML below it has them.

    kfp prints each default as ``str()`` of a protobuf Struct turned into a dict, whose key order
    changes from one process to the next: the recovery benchmark's ``strategies`` made every compile
    a new sha256, so `upload` added a version each time (stranger trial).
    """
    lines = text.split("\n")
    for index, line in enumerate(lines):
        if not line.startswith("#"):
            break
        match = _HEADER_DEFAULT.match(line)
        if match is None:
            continue
        name = line[5:].split(":", 1)[0]  # "#    NAME: TYPE [Default: ...]"
        if name in defaults:
            lines[index] = f"{match.group(1)}{_sorted(defaults[name])!r}]"
            continue
        try:
            value = ast.literal_eval(match.group(2))
        except (ValueError, SyntaxError):
            continue  # a string kfp quoted without escaping: its text is already stable
        if isinstance(value, dict | list):
            lines[index] = f"{match.group(1)}{_sorted(value)}]"
    return "\n".join(lines)


def load_package(path: Path) -> CompiledPipeline:
    """Read an already compiled pipeline file (``--package FILE``).

    Raises:
        CompileError: the file is missing or is not a KFP pipeline.

    """
    import yaml

    try:
        data = path.read_bytes()
        spec = next(iter(yaml.safe_load_all(data)), None)
    except (OSError, yaml.YAMLError) as exc:  # a YAML parser's message spans lines: one line here
        raise CompileError(f"cannot read pipeline package {path}: {' '.join(str(exc).split())}") from None
    if not isinstance(spec, dict) or "pipelineInfo" not in spec or "root" not in spec:
        raise CompileError(f"{path} is not a compiled KFP pipeline (no pipelineInfo/root)")
    return CompiledPipeline(
        key=path.stem,
        path=path,
        name=spec["pipelineInfo"].get("name", path.stem),
        description=spec["pipelineInfo"].get("description", ""),
        content_hash=hashlib.sha256(data).hexdigest(),
        spec=spec,
        num_tasks=len(spec["root"].get("dag", {}).get("tasks", {})),
    )


def default_version_name(content_hash: str, now: datetime.datetime | None = None) -> str:
    """A pipeline version name: UTC timestamp, then the first 12 hex digits of the content hash.

    Sorting by name sorts by upload time; the hash says which build it is without git.
    """
    now = now or datetime.datetime.now(datetime.UTC)
    return f"{now.strftime('%Y%m%d-%H%M%S')}-{content_hash[:12]}"
