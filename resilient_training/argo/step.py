"""One Argo Workflows step: a pipeline component's own function, run by KFP's own executor.

``python -m resilient_training.argo.step COMPONENT --outputs DIR [--artifacts DIR] [NAME=VALUE ...]``

Each ``NAME=VALUE`` is one argv element (Argo substitutes parameters into separate arguments
and execs the command without a shell), typed by the component's declared input types, so the
step gets exactly the Python values the KFP component gets. The function then runs through
``kfp.dsl.executor.Executor``, the code a KFP pod runs, and its outputs are written where Argo
reads them: one file per output parameter (``DIR/<name>``, e.g. ``DIR/Output``, ``DIR/run_dir``)
and output artifacts (metrics, summaries, the report) as files under ``--artifacts``.

Exit codes: the component's own failure is 1 with its traceback (the step fails, as in KFP);
arguments that cannot be used (unknown component or input, a value of the wrong type, a required
input left out) are 2 with one line, before anything runs or is written.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from resilient_training.kfp.params import parse_float, parse_int, parse_json

# The components an Argo step may run (the resilient-training pipeline's); nothing else is imported.
COMPONENTS: tuple[str, ...] = (
    "check_arguments",
    "provision_storage",
    "launch_training",
    "validate_checkpoint",
    "check_convergence",
    "promote_model",
    "resilience_report",
    "teardown_storage",
)
_PIPELINE_STEPS = {"check_arguments": "resilient_training.pipelines.check_step"}
EXECUTOR_OUTPUT = "executor_output.json"
# KFP input types (ComponentSpec.inputs[...].type) that an argument can carry, and how they read.
_EXPECTED = {"String": "a string", "Integer": "an integer", "Float": "a number", "Boolean": "true or false",
             "Dict": "a JSON object", "List": "a JSON list"}


class StepError(ValueError):
    """Arguments a step cannot run with: exit 2, nothing written."""


def load_component(name: str) -> Any:
    """The ``@dsl.component`` of one of :data:`COMPONENTS` (imported only when named)."""
    if name not in COMPONENTS:
        raise StepError(f"unknown component {name!r}; known: {', '.join(COMPONENTS)}")
    # The pipeline's own first step lives beside it (it takes the pipeline's parameters).
    module = importlib.import_module(_PIPELINE_STEPS.get(name, f"resilient_training.components.{name}"))
    return getattr(module, name)


def parse_arguments(component: Any, items: Sequence[str]) -> dict[str, Any]:
    """``NAME=VALUE`` items typed by the component's inputs (required ones must be given).

    Raises:
        StepError: malformed item, unknown or repeated name, wrong type, required input missing.

    """
    inputs = component.component_spec.inputs or {}
    values: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name:
            raise StepError(f"argument {item!r} is not NAME=VALUE")
        spec = inputs.get(name)
        if spec is None or spec.type not in _EXPECTED:
            known = ", ".join(n for n, s in inputs.items() if s.type in _EXPECTED)
            raise StepError(f"{component.name} has no input {name!r}; its inputs: {known}")
        if name in values:
            raise StepError(f"input {name!r} is given twice")
        values[name] = _convert(name, spec.type, raw)
    missing = [n for n, s in inputs.items() if s.type in _EXPECTED and not s.optional and n not in values]
    if missing:
        raise StepError(f"{component.name} needs {', '.join(missing)} (NAME=VALUE)")
    return values


def _convert(name: str, kind: str, raw: str) -> Any:
    try:
        if kind == "String":
            return raw
        if kind == "Integer":
            return parse_int(raw)
        if kind == "Float":
            return parse_float(raw)
        if kind == "Boolean":
            lowered = raw.strip().lower()
            if lowered not in ("true", "false"):
                raise ValueError(raw)
            return lowered == "true"
        value = parse_json(raw)
        if not isinstance(value, dict if kind == "Dict" else list):
            raise ValueError(raw)
        return value
    except ValueError as exc:
        repeated = f" ({exc})" if "given twice" in str(exc) else ""
        raise StepError(f"input {name!r} must be {_EXPECTED[kind]}{repeated}, got {raw!r}") from None


def _check_gate_inputs(name: str, component: Any, values: dict[str, Any]) -> None:
    """What the convergence gate refuses about its arguments themselves, as bad input (one line, exit 2):
    a threshold out of range, a run directory that is not there. Nothing checks `argo submit -p` values
    before the run, so these surfaced after the whole training as a traceback (stranger trial).
    """
    if name != "check_convergence":
        return
    from resilient_training.pipelines import arguments

    inputs = component.component_spec.inputs or {}
    try:
        arguments.check_convergence_step({key: values.get(key, spec.default) for key, spec in inputs.items()
                                          if key in values or spec.default is not None})
    except ValueError as exc:
        raise StepError(str(exc)) from None


def executor_input(component: Any, values: dict[str, Any], outputs: Path, artifacts: Path) -> dict[str, Any]:
    """The ``executor_input`` a KFP driver would hand this component, with local output paths."""
    parameters, artifact_outputs = {}, {}
    for name, spec in (component.component_spec.outputs or {}).items():
        if spec.type in _EXPECTED:
            parameters[name] = {"outputFile": str(outputs / name)}
        else:
            schema = spec.type.split("@")[0]
            artifact_outputs[name] = {"artifacts": [{
                "name": name, "uri": str(artifacts / name), "metadata": {},
                "type": {"schemaTitle": schema},
            }]}
    return {
        "inputs": {"parameterValues": values},
        "outputs": {"parameters": parameters, "artifacts": artifact_outputs,
                    "outputFile": str(outputs / EXECUTOR_OUTPUT)},
    }


def run_step(name: str, items: Sequence[str], outputs: Path, artifacts: Path | None = None) -> dict[str, str]:
    """Run component ``name`` with ``NAME=VALUE`` items; write its outputs for Argo.

    Returns:
        Each output parameter's text as written to ``outputs/<name>``.

    Raises:
        StepError: the arguments cannot be used (nothing was run or written).

    """
    component = load_component(name)
    values = parse_arguments(component, items)
    _check_gate_inputs(name, component, values)
    artifacts = artifacts or outputs / "artifacts"
    request = executor_input(component, values, outputs, artifacts)
    from kfp.dsl.executor import Executor

    outputs.mkdir(parents=True, exist_ok=True)
    Executor(request, component).execute()
    result = json.loads((outputs / EXECUTOR_OUTPUT).read_text())
    written = {}
    for key, value in (result.get("parameterValues") or {}).items():
        # Argo compares parameters as text: booleans as true/false, structures as JSON.
        text = value if isinstance(value, str) else json.dumps(value)
        (outputs / key).write_text(text)
        written[key] = text
    for key, entry in (result.get("artifacts") or {}).items():
        artifact = entry["artifacts"][0]
        path = Path(request["outputs"]["artifacts"][key]["artifacts"][0]["uri"])
        if artifact.get("metadata") and not path.exists():
            # Metrics live in the artifact's metadata (KFP stores them in MLMD); keep them as a file.
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(artifact["metadata"], indent=1, default=str))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m resilient_training.argo.step",
        description="Run one resilient-training pipeline component in an Argo step (KFP's executor, no KFP server).",
    )
    parser.add_argument("component", metavar="COMPONENT", help=f"one of: {', '.join(COMPONENTS)}")
    parser.add_argument("--outputs", type=Path, required=True, metavar="DIR",
                        help="where output parameters are written, one file per name (Argo valueFrom.path)")
    parser.add_argument("--artifacts", type=Path, metavar="DIR", help="where output artifacts go (default DIR/artifacts)")
    parser.add_argument("arguments", nargs="*", metavar="NAME=VALUE", help="component inputs, typed by the component")
    # Intermixed: NAME=VALUE items may follow --outputs (the order Argo templates write).
    args = parser.parse_intermixed_args(argv)
    try:
        written = run_step(args.component, args.arguments, args.outputs, args.artifacts)
    except StepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for key, text in written.items():
        print(f"output {key}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
