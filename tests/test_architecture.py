"""The layout is the architecture: imports go one way, and a component never imports a sibling.

Layers, lowest first (a layer may import itself and the layers listed for it, nothing else):

    run < runtime < tasks, launch < storage < gates/bench < components < pipelines < kfp < argo < cli

Every import counts, also those inside functions (the lazy ones that keep ``--help`` fast).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = "resilient_training"

ALLOWED: dict[str, set[str]] = {
    "run": set(),
    "runtime": {"run"},
    # Built-in tasks; loaded by name (importlib) like any user's task, never imported statically.
    "tasks": {"run", "runtime"},
    "launch": {"run", "runtime"},
    # Storage names and deletes the run's objects: it uses the Kubernetes names, client and job deletion.
    "storage": {"run", "launch"},
    "gates": {"run", "runtime"},
    "bench": {"run", "launch", "gates"},
    "components": {"run", "runtime", "launch", "storage", "gates", "bench"},
    # pipelines/arguments.py checks a run's arguments with the steps' own validators before it exists.
    "pipelines": {"run", "launch", "storage", "gates", "components", "bench"},
    "kfp": {"run", "pipelines"},
    # Argo steps run the components' own functions (argo.step); the CronWorkflow reuses kfp's cron fields.
    "argo": {"run", "launch", "components", "pipelines", "kfp"},
    "cli": {"run", "runtime", "launch", "storage", "gates", "bench", "components", "pipelines", "kfp", "argo"},
}


def layer_of_file(path: Path) -> tuple[str, str]:
    """(layer, component name or '') of a source file."""
    rel = path.relative_to(ROOT).parts
    if rel[0] == PKG:
        return (rel[1] if len(rel) > 2 else "package"), ""
    if rel[0] == "components":
        return "components", rel[1] if len(rel) > 2 else ""
    return rel[0], ""


def layer_of_module(module: str) -> tuple[str, str]:
    parts = module.split(".")
    if parts[0] != PKG or len(parts) == 1:
        return "", ""
    if parts[1] == "components":
        return "components", parts[2] if len(parts) > 2 else ""
    if parts[1] == "pipelines":
        return "pipelines", ""
    if parts[1] == "__version__":
        return "", ""
    return parts[1], ""


def imports_of(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    rel = path.relative_to(ROOT).parts[:-1]
    package = ".".join(rel if rel[0] == PKG else (PKG, *rel))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            # `from resilient_training import run` imports the subpackage itself
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if module == PKG]
    return out


def source_files() -> list[Path]:
    files = [p for p in (ROOT / PKG).rglob("*.py")]
    files += [p for p in (ROOT / "components").rglob("*.py") if "tests" not in p.relative_to(ROOT).parts]
    files += [p for p in (ROOT / "pipelines").rglob("*.py") if "tests" not in p.relative_to(ROOT).parts]
    return sorted(files)


def violations(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        layer, component = layer_of_file(path)
        for lineno, module in imports_of(path):
            if module.startswith("tests"):
                found.append(f"{path.relative_to(ROOT)}:{lineno} imports test code {module}")
                continue
            target, target_component = layer_of_module(module)
            if not target or target == layer and target != "components":
                continue
            if target == "components" and layer == "components":
                if target_component and target_component != component:
                    found.append(f"{path.relative_to(ROOT)}:{lineno} imports sibling component {module}")
                continue
            if layer == "package":
                found.append(f"{path.relative_to(ROOT)}:{lineno} the package root imports {module}")
            elif target not in ALLOWED.get(layer, set()):
                found.append(f"{path.relative_to(ROOT)}:{lineno} {layer} may not import {target} ({module})")
    return found


def test_imports_go_one_way_and_components_never_import_a_sibling():
    assert violations(source_files()) == []


def test_every_source_file_is_in_a_known_layer():
    layers = {layer_of_file(p)[0] for p in source_files()}
    assert layers <= {*ALLOWED, "package"}


@pytest.mark.parametrize(("where", "line", "expected"), [
    ("resilient_training/run/planted.py", "from resilient_training.runtime import trainer", "run may not import runtime"),
    ("resilient_training/runtime/planted.py", "from resilient_training.launch import local",
     "runtime may not import launch"),
    ("resilient_training/gates/planted.py", "import resilient_training.cli.main", "gates may not import cli"),
    ("resilient_training/launch/planted.py", "from resilient_training.components.launch_training import x",
     "launch may not import components"),
    ("components/promote_model/planted.py", "from resilient_training.components.validate_checkpoint import v",
     "imports sibling component"),
    ("resilient_training/gates/planted.py", "from tests.support import gates", "imports test code"),
    ("resilient_training/storage/planted.py", "    from resilient_training.bench import strategy",
     "storage may not import bench"),
])
def test_a_planted_bad_import_is_caught(where, line, expected):
    path = ROOT / where
    assert not path.exists()
    body = f"def f():\n{line}\n" if line.startswith(" ") else f"{line}\n"
    path.write_text(body)
    try:
        found = violations([path])
    finally:
        path.unlink()
    assert len(found) == 1 and expected in found[0], found


def test_a_component_folder_is_a_leaf():
    """component.py, __init__.py, README.md and tests/: the logic lives in the library."""
    for folder in sorted(p for p in (ROOT / "components").iterdir() if p.is_dir() and p.name != "__pycache__"):
        names = {p.name for p in folder.iterdir() if p.name != "__pycache__"}
        assert names <= {"component.py", "__init__.py", "README.md", "tests"}, (folder.name, names)
        assert {"component.py", "README.md"} <= names, folder.name
