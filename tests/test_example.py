"""examples/char_conv: a user's task outside the package, trained resiliently, resumed elsewhere, exported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient_training.cli.main import main
from resilient_training.runtime import task as tk
from tests.support.runs import check_recovered, rank0_losses, train

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "char_conv"
TASK = f"{EXAMPLE / 'task.py'}:task"


def test_the_example_is_a_complete_task_of_its_own_and_learns_on_cpu():
    source = (EXAMPLE / "task.py").read_text()
    assert "resilient_training" not in source.replace("``resilient_training``", "")  # it imports nothing of ours
    task = tk.load_task(TASK, {"lr": "0.05"})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = tk.build_model(task)
        optimizer = tk.build_optimizer(task, model)
        assert type(optimizer) is torch.optim.SGD  # not AdamW: the trainer must not assume one
        scheduler = tk.lr_scheduler(task, optimizer)
        data = tk.build_data(task, 0, 1, 0)
        from torchdata.stateful_dataloader import StatefulDataLoader

        assert isinstance(data, StatefulDataLoader)
        losses = []
        for _ in range(3):  # epochs: the trainer calls iter() again at the end of each
            for batch in data:
                loss = tk.check_loss(task.loss(model, batch))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 0.7 * losses[0], losses


def test_the_example_s_dockerfile_starts_from_the_trainer_image_and_ships_the_task_and_its_data():
    text = (EXAMPLE / "Dockerfile").read_text()
    assert "ARG TRAINER_IMAGE=ghcr.io/resilient-training/trainer:" in text and "FROM ${TRAINER_IMAGE}" in text
    assert "COPY examples/char_conv/task.py /opt/char_conv/task.py" in text
    assert "COPY examples/char_conv/data /opt/char_conv/data" in text


def test_rendered_job_runs_the_example_task_from_the_image():
    proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", "render-job", "--name", "char-conv",
                           "--nodes", "2", "--gpus-per-node", "1", "--pvc", "fsx-claim",
                           "--image", "registry.example/char-conv:0.1.0", "--task", "/opt/char_conv/task.py:task",
                           "--task-arg", "lr=0.05", "--steps", "200"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import yaml

    job = yaml.safe_load(proc.stdout)
    containers = [spec["template"]["spec"]["containers"][0] for spec in job["spec"]["pytorchReplicaSpecs"].values()]
    for container in containers:
        assert container["image"] == "registry.example/char-conv:0.1.0"
        argv = container["command"] + container.get("args", [])
        assert "/opt/char_conv/task.py:task" in argv and "lr=0.05" in argv


@pytest.mark.slow
def test_an_exception_on_two_workers_then_resume_at_another_world_size_then_export(tmp_path):
    # In-process only: the whole-pipeline test below kills a worker of this task (launcher layer).
    run = train(tmp_path / "run", "--nproc", "2", "--steps", "16", "--checkpoint-every", "4",
                "--task", TASK, "--faults", "exception@11:0")
    check_recovered(run, "exception@11:0", layer="inprocess", cause="exception")
    first_loss = rank0_losses(run.events)[0][2]
    # Resume the finished run with 3 workers and a further target: DCP reshards 2 -> 3.
    resumed = train(run.run_dir, "--nproc", "3", "--steps", "24", "--checkpoint-every", "4", "--task", TASK)
    assert resumed.returncode == 0, resumed.output[-3000:]
    events = resumed.events
    third = [e for e in events if e.event == "start" and e["world_size"] == 3]
    assert {e.rank for e in third} == {0, 1, 2}
    load = next(e for e in events if e.event == "load_done" and e.ts > third[0].ts)
    assert load.step == 16 and load["path"] is not None
    after = [(s, loss) for ts, s, loss in rank0_losses(events) if ts > load.ts]
    assert after[0][0] == 17 and after[-1][0] == 24
    before = [loss for ts, s, loss in rank0_losses(events) if ts < third[0].ts and s in (15, 16)]
    # The restored weights carry on: the loss continues where the 2-worker run left it, far below a fresh start.
    assert after[0][1] < 0.8 * first_loss and after[0][1] < 1.1 * max(before), (first_loss, before, after)
    assert any(e.event == "end" and e["status"] == "completed" and e.step == 24 for e in events)
    # Validate (now at world size 1: resharded 3 -> 1), export, and load it into the user's own model.
    assert main(["validate-checkpoint", str(run.run_dir)]) == 0
    out = tmp_path / "char_conv.safetensors"
    assert main(["export", str(run.run_dir), "--format", "safetensors", "-o", str(out)]) == 0
    from safetensors.torch import load_file

    manifest = json.loads((run.run_dir / "checkpoints" / "step_24" / "manifest.json").read_text())
    assert manifest["world_size"] == 3
    model = tk.load_task(manifest["task"], manifest["task_args"]).build_model()
    model.load_state_dict(load_file(str(out)), strict=True)


@pytest.mark.slow
def test_the_whole_local_pipeline_runs_the_example_and_exports_the_promoted_model(tmp_path):
    from safetensors.torch import load_file

    proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", "run", "--output-dir", str(tmp_path / "out"),
                           "--task", TASK, "--task-arg", "lr=0.05", "--steps", "16", "--checkpoint-every", "4",
                           "--faults", "sigkill@6:1", "--export", "safetensors", "--max-final-loss", "50"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "validation:         PASSED" in proc.stdout and "convergence:        PASSED" in proc.stdout
    convergence = Path(proc.stdout.split("convergence:        PASSED  (")[1].split(")")[0])
    thresholds = json.loads(convergence.read_text())["thresholds"]
    assert (thresholds["max_final_loss"], thresholds["max_final_loss_from"]) == (50.0, "given")
    exported = Path(proc.stdout.split("exported model:")[1].split()[0])
    assert exported.name == "model.safetensors" and (exported.parent / "promotion.json").is_file()
    model = tk.load_task(TASK, {"lr": "0.05"}).build_model()
    model.load_state_dict(load_file(str(exported)), strict=True)
    # The promoted directory, export inside, validates on its own (a stranger trial found it INVALID).
    check = subprocess.run([sys.executable, "-m", "resilient_training.cli", "validate-checkpoint",
                            str(exported.parent)], capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and check.stdout.startswith("VALID"), check.stdout + check.stderr
