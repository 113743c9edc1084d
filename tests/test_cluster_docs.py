"""docs/cluster.md stays honest: its pipeline snippet compiles, its component tables name real parameters."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "cluster.md"


def test_pipeline_snippet_compiles(tmp_path):
    from kfp import compiler

    (snippet,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    namespace: dict = {}
    exec(compile(snippet, str(DOC), "exec", dont_inherit=True), namespace)  # noqa: S102 - our own documentation
    compiler.Compiler().compile(namespace["cluster_pipeline"], str(tmp_path / "pipeline.yaml"))
    assert "exit-handler" in (tmp_path / "pipeline.yaml").read_text()


def test_parameter_tables_match_the_components():
    from resilient_training.components.launch_training import launch_training
    from resilient_training.components.provision_storage import provision_storage
    from resilient_training.components.teardown_storage import teardown_storage

    text = DOC.read_text()
    for component in (provision_storage, launch_training, teardown_storage):
        section = text.split(f"### {component.name.replace('-', '_')}")[1].split("###")[0]
        documented = set()
        for row in re.findall(r"^\| (`[^|]+) \|", section, flags=re.M):
            documented |= set(re.findall(r"`([a-z_]+)`", row))
        actual = set(inspect.signature(component.python_func).parameters)
        assert documented == actual, component.name
