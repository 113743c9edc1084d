"""--param values are typed by the compiled pipeline's inputs; bad ones are refused with the reason."""

from __future__ import annotations

import pytest

from resilient_training.kfp.compile import compile_pipeline
from resilient_training.kfp.params import ParamError, parse_params
from tests.support.kfp_fixture_pipelines import PIPELINES


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("compiled") / "tiny-train.yaml"
    return compile_pipeline("tiny-train", PIPELINES["tiny-train"], path).inputs


def test_inputs_come_from_the_ir_with_defaults_and_descriptions(inputs):
    assert list(inputs) == ["backend", "extra", "fault_steps", "inject_faults", "nodes", "run_id", "tolerance"]
    assert inputs["nodes"].type == "NUMBER_INTEGER"
    assert inputs["nodes"].default == 2
    assert inputs["nodes"].description == "number of training nodes."
    assert inputs["run_id"].optional is False
    assert inputs["tolerance"].optional is True


def test_values_are_converted_to_each_inputs_type(inputs):
    params = parse_params(
        ["run_id=123", "nodes=3", "tolerance=0.1", "inject_faults=FALSE", "fault_steps=[1, 2]",
         'extra={"a": {"b": 1}}', "backend=a=b"],
        inputs,
    )
    assert params == {
        "run_id": "123",  # a STRING input keeps digits as text
        "nodes": 3,
        "tolerance": 0.1,
        "inject_faults": False,
        "fault_steps": [1, 2],
        "extra": {"a": {"b": 1}},
        "backend": "a=b",  # only the first '=' splits
    }
    assert isinstance(params["nodes"], int) and isinstance(params["tolerance"], float)


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["nodes"], "--param 'nodes' is not key=value"),
        (["=3"], "--param '=3' is not key=value"),
        (["colour=red"], "unknown parameter 'colour'; the pipeline's parameters are: backend, extra,"),
        (["nodes=two"], "parameter 'nodes' must be an integer, got 'two'"),
        (["nodes=2.5"], "parameter 'nodes' must be an integer, got '2.5'"),
        (["tolerance=nan"], "parameter 'tolerance' must be a number, got 'nan'"),
        # Stranger trial: float() takes both; the KFP backend (Go) and the integers' rule do not.
        (["tolerance=٠.٥"], "parameter 'tolerance' must be a number, got '٠.٥'"),
        (["tolerance=0.0_5"], "parameter 'tolerance' must be a number, got '0.0_5'"),
        (["inject_faults=yes"], "parameter 'inject_faults' must be true or false, got 'yes'"),
        (["fault_steps={}"], "parameter 'fault_steps' must be a JSON list, got '{}'"),
        (["extra=[1]"], "parameter 'extra' must be a JSON object, got '[1]'"),
        (["extra={bad json"], "parameter 'extra' must be a JSON object"),
        # Stranger trial: nested past the parser's stack, RecursionError was a traceback.
        (["fault_steps=" + "[" * 5000 + "]" * 5000], "parameter 'fault_steps' must be a JSON list"),
        (["nodes=1", "nodes=2"], "parameter 'nodes' is given twice"),
        # Stranger trial 6: numbers were stripped, strings sent with the blank; one rule for every type now.
        (["nodes= 3"], "parameter 'nodes' value ' 3' has blanks around it: give nodes=3"),
        (["tolerance=0.1 "], "parameter 'tolerance' value '0.1 ' has blanks around it"),
        (["inject_faults=true "], "parameter 'inject_faults' value 'true ' has blanks around it"),
        (["backend=nccl "], "parameter 'backend' value 'nccl ' has blanks around it"),
        (["backend= "], "parameter 'backend' value ' ' has blanks around it"),
    ],
)
def test_bad_params_are_refused(inputs, items, message):
    with pytest.raises(ParamError) as caught:
        parse_params(["run_id=r", *items], inputs)
    assert message in str(caught.value)


def test_a_required_input_left_out_is_named(inputs):
    with pytest.raises(ParamError, match=r"missing required parameter\(s\): run_id"):
        parse_params(["nodes=3"], inputs)


def test_a_json_values_own_whitespace_is_not_blanks_around_it(inputs):
    params = parse_params(["run_id=r", "fault_steps= [1, 2] ", 'extra={"a": 1}\n', "backend="], inputs)
    assert params["fault_steps"] == [1, 2] and params["extra"] == {"a": 1} and params["backend"] == ""
