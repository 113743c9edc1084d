"""Pipeline parameters from ``--param key=value``, typed by the compiled pipeline's inputs.

Values are converted to the parameter type declared in the pipeline's IR (its root
``inputDefinitions``), so a run is never created with ``nodes="two"`` or a misspelt key: the
KFP server would accept both and the run would fail minutes later on the cluster.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any


class ParamError(ValueError):
    """A ``--param`` that is malformed, unknown, of the wrong type, or a required one missing."""


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineInput:
    """One input parameter of a compiled pipeline."""

    name: str
    type: str
    """IR parameter type: STRING, NUMBER_INTEGER, NUMBER_DOUBLE, BOOLEAN, LIST or STRUCT."""
    optional: bool
    default: Any = None
    description: str = ""


def pipeline_inputs(pipeline_spec: Mapping[str, Any]) -> dict[str, PipelineInput]:
    """The input parameters of a compiled pipeline.

    Args:
        pipeline_spec: the first YAML document of a compiled pipeline (the PipelineSpec).

    Returns:
        Inputs by name, in the order the IR lists them.

    """
    definitions = pipeline_spec.get("root", {}).get("inputDefinitions", {})
    inputs = {}
    for name, spec in definitions.get("parameters", {}).items():
        inputs[name] = PipelineInput(
            name=name,
            type=spec.get("parameterType", "STRING"),
            optional=bool(spec.get("isOptional", False)),
            default=spec.get("defaultValue"),
            description=spec.get("description", ""),
        )
    # Artifact inputs cannot be given a value from the command line; keep them so a required
    # one is reported instead of being forgotten.
    for name, spec in definitions.get("artifacts", {}).items():
        inputs[name] = PipelineInput(name=name, type="ARTIFACT", optional=bool(spec.get("isOptional", False)))
    return inputs


def split_param(item: str, flag: str = "--param") -> tuple[str, str]:
    """Split ``key=value`` (the value may contain ``=``).

    Raises:
        ParamError: no ``=`` or an empty key.

    """
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ParamError(f"{flag} {item!r} is not key=value")
    return key, value


def parse_params(items: Iterable[str], inputs: Mapping[str, PipelineInput], flag: str = "--param") -> dict[str, Any]:
    """Turn ``--param key=value`` items into typed pipeline arguments.

    Args:
        items: the raw ``key=value`` strings, in command-line order.
        inputs: the pipeline's inputs (:func:`pipeline_inputs`).
        flag: the option the items came with, for the messages (``--param``, ``--default``).

    Returns:
        Arguments by name, converted to each input's type; inputs left out keep their defaults
        (they are not sent).

    Raises:
        ParamError: a malformed item, an unknown key, a key given twice, a value of the wrong
            type, or a required input left out.

    """
    params: dict[str, Any] = {}
    for item in items:
        key, raw = split_param(item, flag)
        if key not in inputs:
            known = ", ".join(inputs) or "none"
            raise ParamError(f"unknown parameter {key!r}; the pipeline's parameters are: {known}")
        if key in params:
            raise ParamError(f"parameter {key!r} is given twice")
        refuse_blanks(key, raw, json_value=inputs[key].type in ("LIST", "STRUCT"))
        params[key] = convert(inputs[key], raw)
    missing = [name for name, spec in inputs.items() if not spec.optional and name not in params]
    if missing:
        raise ParamError(f"missing required parameter(s): {', '.join(missing)} (give them with {flag} KEY=VALUE)")
    return params


def refuse_blanks(name: str, raw: str, *, json_value: bool) -> None:
    """``ParamError`` when ``raw`` has blanks around it (``steps= 40``, ``region=us-east-1 ``): numbers
    were stripped and strings sent with the blank, so one rule for all; a JSON value's blanks are JSON's own.
    The one rule for ``--param`` and Argo's ``--cron-param``.
    """
    if not json_value and raw != raw.strip():
        from resilient_training.run.paths import has_control

        stripped = raw.strip()
        if has_control(raw[:len(raw) - len(raw.lstrip())] + raw[len(raw.rstrip()):]):  # a pasted newline, a tab
            raise ParamError(f"parameter {name!r} value {raw!r} contains a control character (a newline?) at an end: "
                             f"give {name}={stripped}")
        raise ParamError(f"parameter {name!r} value {raw!r} has blanks around it: give {name}={stripped}")


def parse_int(raw: str) -> int:
    """An integer as the KFP backend (Go) reads one: ASCII digits only (``int()`` also takes '٤' and '1_0');
    the command line's own rule, blanks around it allowed (an earlier step's output file).
    """
    from resilient_training.run.config import strict_int

    return strict_int(raw.strip())


def parse_float(raw: str) -> float:
    """A finite number by :func:`parse_int`'s rule: ASCII only (``float()`` also takes '٠.٥' and '0.0_5')."""
    from resilient_training.run.config import strict_finite_float

    return strict_finite_float(raw.strip())


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:  # json.loads would keep the last one silently
        raise ValueError(f"key {repeated[0]!r} is given twice")
    return dict(pairs)


def parse_json(raw: str) -> Any:
    """JSON for a list or dict parameter; a key given twice in an object is refused."""
    try:
        return json.loads(raw, object_pairs_hook=_refuse_repeated_keys)
    except RecursionError:  # nested deeper than the parser's stack: not a setting anyone means
        raise ValueError("JSON nested too deeply") from None


def convert(spec: PipelineInput, raw: str) -> Any:
    """Convert one raw value to the type the IR declares for ``spec``.

    Raises:
        ParamError: the value does not fit the type.

    """
    expected = {
        "STRING": "a string",
        "NUMBER_INTEGER": "an integer",
        "NUMBER_DOUBLE": "a number",
        "BOOLEAN": "true or false",
        "LIST": "a JSON list",
        "STRUCT": "a JSON object",
    }.get(spec.type)
    if expected is None:
        raise ParamError(f"parameter {spec.name!r} is of type {spec.type} and cannot be set with --param")
    value: Any
    try:
        if spec.type == "STRING":
            return raw
        if spec.type == "NUMBER_INTEGER":
            return parse_int(raw)
        if spec.type == "NUMBER_DOUBLE":
            return parse_float(raw)
        if spec.type == "BOOLEAN":
            lowered = raw.strip().lower()
            if lowered not in ("true", "false"):
                raise ValueError(raw)
            return lowered == "true"
        value = parse_json(raw)
        if not isinstance(value, list if spec.type == "LIST" else dict):
            raise ValueError(raw)
        return value
    except ValueError as exc:
        repeated = f" ({exc})" if "given twice" in str(exc) else ""
        raise ParamError(f"parameter {spec.name!r} must be {expected}{repeated}, got {raw!r}") from None
