"""The task interface: loading ``--task``, refusing broken tasks before any worker starts, and a
user's own task (own model, SGD, StatefulDataLoader, scheduler, clipping, accumulation) trained
with faults, validated, read back by plain torch and resumed at other world sizes.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from resilient_training.run import checkpoint_format as fmt
from resilient_training.run import config as cfg
from resilient_training.run import layout
from resilient_training.runtime import task as tk
from tests.support.runs import train

USER_TASK = str(Path(__file__).parent / "support" / "user_task.py")


def test_the_default_task_is_the_built_in_gpt_with_the_runs_model_flags():
    config = cfg.from_argv(["--run-dir", "r", "--model-d-model", "48", "--lr", "0.01", "--task-arg", "seq_len=8"])
    task = tk.task_from_config(config)
    assert type(task).__name__ == "GPTTask"
    assert (task.cfg.d_model, task.cfg.seq_len, task.lr, task.batch_size) == (48, 8, 0.01, 8)


def test_a_task_file_and_its_arguments():
    task = tk.load_task(f"{USER_TASK}:make", {"width": "4"})
    assert task.width == 4 and task.lr == 0.05
    assert tk.load_task(f"{USER_TASK}:make") is not task  # a callable makes a new task each time
    with pytest.raises(tk.TaskError, match="does not accept these --task-arg settings: got an unexpected keyword"
                       r".*'depth' \(it takes: width, lr\)$"):
        tk.load_task(f"{USER_TASK}:make", {"depth": "3"})
    with pytest.raises(tk.TaskError, match="is an object, so it takes no --task-arg"):
        tk.load_task(f"{USER_TASK}:model_raises", {"width": "3"})


def test_annotated_task_arguments_arrive_converted_by_the_command_lines_rules():
    """A factory's int, float and bool parameters get their values converted; a str (or unannotated)
    one gets the string. What int()/float() forgive and the command line refuses (stranger trial:
    each task parsed its own numbers, and '٤', '1_0' and 'nan' passed) is refused here too.
    """
    task = tk.load_task(f"{USER_TASK}:make_typed", {"width": "4", "lr": "0.5", "momentum": "false", "name": "7"})
    assert task.settings == (4, 0.5, False, "7")
    assert [type(v) for v in task.settings] == [int, float, bool, str]
    assert tk.load_task(f"{USER_TASK}:make_typed").settings == (16, 0.05, True, "x")  # the defaults, untouched
    task = tk.load_task(f"{USER_TASK}:TypedTask", {"width": "4", "lr": "0.5"})  # a class: its __init__'s
    assert (task.width, task.lr) == (4, 0.5) and type(task.width) is int
    for name, value, kind in [("width", "٤", "an integer"), ("width", "1_0", "an integer"), ("width", "4 ", "an integer"),
                              ("width", "4.0", "an integer"), ("lr", "nan", "a finite number"),
                              ("lr", "0.0_5", "a finite number"), ("momentum", "yes", "true or false")]:
        with pytest.raises(tk.TaskError, match=rf"^task .*:make_typed: task argument {name}='{value}' is not {kind}$"):
            tk.load_task(f"{USER_TASK}:make_typed", {name: value})
    # The built-in tasks take **settings / strings and convert them by the same rules.
    for spec, args in [("resilient_training.tasks.gpt:task", {"d_model": "٤"}),
                       ("resilient_training.tasks.gpt:task", {"lr": "0.0_1"}),
                       ("resilient_training.tasks.llama:task", {"seq_len": "1_6"})]:
        with pytest.raises(tk.TaskError, match="is not an? (int|integer|float|number)$"):
            tk.load_task(spec, args)


@pytest.mark.parametrize(("spec", "message"), [
    ("user_task.py:make", "user_task.py does not exist"),
    (f"{USER_TASK}:nothing", "has no attribute 'nothing'"),
    ("no_such_module_here:task", "task module no_such_module_here failed to import: ModuleNotFoundError"),
    (f"{USER_TASK}:not_a_task", "is a int, not a task or a callable returning one"),
    (f"{USER_TASK}:model_not_a_module", "task build_model() returned a dict, not a torch.nn.Module"),
    (f"{USER_TASK}:model_raises", "task build_model() raised RuntimeError: no GPU here"),
    (f"{USER_TASK}:optimizer_wrong_type", "task build_optimizer() returned a list, not a torch.optim.Optimizer"),
    (f"{USER_TASK}:data_without_state", "task build_data() returned a list_iterator without state_dict, "
                                        "load_state_dict"),
    ("resilient_training", "must be MODULE:ATTR or path/to/file.py:ATTR"),
    (f"{USER_TASK}:empty_layer", "task build_model() has parameters with no elements (0.weight [0, 8], 0.bias [0], "
                                 "1.weight [1, 0]): FSDP cannot shard an empty parameter"),
    # A fourth stranger trial: each of these started the workers (exit 1, the run directory
    # written), and the last three were retried 8 times or trained on wrongly.
    (f"{USER_TASK}:accumulation_zero", "task grad_accumulation must be a positive integer, got 0"),
    (f"{USER_TASK}:accumulation_string", "task grad_accumulation must be a positive integer, got 'two'"),
    (f"{USER_TASK}:clip_negative", "task grad_clip must be a finite number >= 0, got -1.0"),
    (f"{USER_TASK}:clip_nan", "task grad_clip must be a finite number >= 0, got nan"),
    (f"{USER_TASK}:scheduler_wrong_type", "task build_lr_scheduler() returned a str without step, state_dict"),
    (f"{USER_TASK}:optimizer_over_other_tensors", "task build_optimizer() returned an optimizer over 2 tensor(s) "
                                                  "that are not the model's parameters"),
    (f"{USER_TASK}:scheduler_it_steps", "task build_optimizer() attached an LR scheduler to the optimizer (its param "
                                        "groups have initial_lr), but build_lr_scheduler() returns none"),
])
def test_a_broken_task_is_one_line_and_exit_2_before_any_worker_starts(tmp_path, spec, message, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    argv = ["train", "--run-dir", str(run_dir), "--task", spec]
    if spec == "user_task.py:make":
        # One case through the real command (the exit status and stderr of a process of its own);
        # the others call its entry point in this process (a torch import less each).
        proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", *argv], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        code, stderr = proc.returncode, proc.stderr
    else:
        from resilient_training.cli.main import main

        monkeypatch.chdir(tmp_path)
        code, stderr = main(argv), capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if "Warning" not in line and "import pynvml" not in line]
    assert len(lines) == 1 and message in lines[0], stderr
    assert "Traceback" not in stderr
    assert not run_dir.exists()  # nothing written


def test_what_a_refused_task_warned_about_is_not_printed_before_the_one_line(tmp_path, recwarn):
    """A stranger trial's one-line refusal came after a screen of a library's import warnings."""
    task_file = tmp_path / "noisy_task.py"
    task_file.write_text(
        "import sys, warnings\n"
        f"sys.path.insert(0, {str(Path(USER_TASK).parent)!r})\n"
        "warnings.warn('this data library is deprecated', DeprecationWarning)\n"
        "warnings.warn('noisy at import', UserWarning)\n"
        "from user_task import optimizer_wrong_type as broken, make\n")
    argv = ["train", "--run-dir", str(tmp_path / "run"), "--task", f"{task_file}:broken"]
    proc = subprocess.run([sys.executable, "-W", "always", "-m", "resilient_training.cli", *argv], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: task build_optimizer() returned a list, not a torch.optim.Optimizer"], proc.stderr
    # A task that passes still shows them (after its checks).
    config = cfg.from_argv(["--run-dir", str(tmp_path / "run"), "--task", f"{task_file}:make"])
    tk.preflight(config, world_size=1)
    assert {str(w.message) for w in recwarn} >= {"this data library is deprecated", "noisy at import"}


@pytest.mark.parametrize("command", ["run", "bench"])
def test_the_pipelines_refuse_a_broken_task_before_anything_runs(tmp_path, command, capsys):
    argv = [command, "--output-dir", str(tmp_path / "out"), "--task", f"{USER_TASK}:optimizer_wrong_type"]
    if command == "run":  # through the real command; `bench` through its entry point in this process
        proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", *argv], capture_output=True, text=True,
                              timeout=120)
        code, stderr = proc.returncode, proc.stderr
    else:
        from resilient_training.cli.main import main

        code, stderr = main(argv), capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    assert "error: task build_optimizer() returned a list, not a torch.optim.Optimizer" in stderr
    assert "Traceback" not in stderr and not (tmp_path / "out").exists()


def test_a_loss_that_is_not_a_scalar_names_the_method():
    task = tk.load_task(f"{USER_TASK}:loss_not_scalar")
    model = tk.build_model(task)
    batch = next(iter(tk.build_data(task, 0, 1, 0)))
    with pytest.raises(tk.TaskError, match=r"task loss\(\) returned a tensor of shape \[16, 1\] and dtype float32, "
                       "not a scalar"):
        tk.check_loss(task.loss(model, batch))
    import torch  # a scalar of integers: its dtype is what is wrong (the message said only "shape []")

    with pytest.raises(tk.TaskError, match=r"returned a tensor of shape \[\] and dtype int64, not a scalar floating"):
        tk.check_loss(torch.tensor(1))


def _last_manifest(run_dir: Path) -> dict:
    return fmt.read_manifest(fmt.read_latest(layout.checkpoints_dir(run_dir)))


@pytest.mark.slow
def test_a_user_task_trains_through_faults_validates_and_resumes_at_another_world_size(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from resilient_training.gates.validate import validate

    run_dir = tmp_path / "run"
    args = ["--task", f"{USER_TASK}:make", "--task-arg", "width=24", "--checkpoint-every", "3"]
    first = train(run_dir, "--nproc", "2", "--steps", "9", "--faults", "exception@5:1", *args)
    assert first.returncode == 0, first.output[-3000:]
    manifest = _last_manifest(run_dir)
    assert manifest["task_args"] == {"width": "24"} and manifest["optimizer"]["type"] == "SGD"
    assert "lr_scheduler.last_epoch" in manifest["objects"]
    # a StatefulDataLoader's own state, per rank: 9 steps x 2 micro-batches = 18 batches, of which
    # 16 (256 samples of rank 1 / 16) made the first epoch
    assert manifest["data_state"]["1"]["state"]["_num_yielded"] == 2
    report = validate(run_dir)
    assert report.valid, [str(f) for f in report.all_findings]

    # plain torch reads the model: the task's own state_dict, buffer included
    step_dir = fmt.read_latest(layout.checkpoints_dir(run_dir))
    dcp_to_torch_save(step_dir, tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    model = tk.load_task(f"{USER_TASK}:make", {"width": "24"}).build_model()
    assert set(plain["model"]) == set(model.state_dict())
    model.load_state_dict(plain["model"], strict=True)
    assert float(model.scale) == 2.0
    assert set(plain["optim"]["state"]["layers.0.weight"]) == {"momentum_buffer"}

    resumed = train(run_dir, "--nproc", "1", "--steps", "12", *args)
    assert resumed.returncode == 0, resumed.output[-3000:]
    loads = [e for e in resumed.events if e.event == "load_done" and e.get("path")]
    assert loads[-1].step == 9 and loads[-1]["source"] == "storage (resharded)"
    assert _last_manifest(run_dir)["world_size"] == 1
    report = validate(run_dir)
    assert report.valid, [str(f) for f in report.all_findings]


STRANGER_TASK = str(Path(__file__).parent / "support" / "stranger_task.py")


def _losses(run) -> dict[int, float]:
    return {e.step: e["loss"] for e in run.events if e.event == "step" and e.rank == 0}  # the last of each step


@pytest.mark.slow
def test_a_task_drawing_from_the_global_generators_replays_exactly_through_faults(tmp_path):
    """A third stranger trial's dropout differed after every restart (and between two clean runs),
    and the convergence gate failed the run: the global generators are seeded at every step from
    (--seed, rank, step). A killed rank restarts its process; an exception restarts in-process."""
    from resilient_training.gates.convergence import check_convergence

    args = ["--nproc", "2", "--steps", "12", "--checkpoint-every", "4", "--task", f"{STRANGER_TASK}:task",
            "--task-arg", "dropout=0.3"]
    clean = train(tmp_path / "clean", *args)
    faulted = train(tmp_path / "faulted", *args, "--faults", "sigkill@6:1,exception@10:0")
    assert clean.returncode == 0 and faulted.returncode == 0, (clean.output[-2000:], faulted.output[-2000:])
    assert _losses(faulted) == _losses(clean)  # every step, bit for bit
    assert [e for e in faulted.events if e.event == "restart_done"]  # both faults did restart
    report = check_convergence(tmp_path / "faulted")
    assert report.passed, report.format()


@pytest.mark.parametrize(("task_arg", "why"), [("share=true", "a block listed twice was sharded twice"),
                                               ("sched=plateau", "ReduceLROnPlateau.step() needs the loss")])
def test_shared_blocks_and_a_plateau_scheduler_train(tmp_path, task_arg, why):
    """Third stranger trial: both failed every step, and were retried 8 times ({why})."""
    run = train(tmp_path / "run", "--nproc", "2", "--steps", "6", "--checkpoint-every", "3", "--task",
                f"{STRANGER_TASK}:task", "--task-arg", task_arg, "--no-inprocess", "--max-restarts", "0")
    assert run.returncode == 0, run.output[-3000:]
    assert max(_losses(run)) == 6


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """8 steps on 2 ranks (read-only; each test resumes a copy): (run directory, rank 0's losses)."""
    from resilient_training.run import events as ev
    from tests.support.runs import two_rank_gpt_run

    run_dir = two_rank_gpt_run(tmp_path_factory.getbasetemp())  # shared with test_argo.py and test_export.py
    assert _last_manifest(run_dir)["data_state"]["0"]["state"] == {"position": 8 * 2 * 8}  # steps x ranks x batch
    return run_dir, {e.step: e["loss"] for e in ev.read_events(run_dir) if e.event == "step" and e.rank == 0}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3])
def test_the_built_in_task_resumes_at_another_world_size_at_the_same_global_sample(tmp_path, world, two_rank_run):
    from resilient_training.gates.validate import validate
    from tests.support.gates import copy_run

    run_dir = copy_run(two_rank_run[0], tmp_path / "run")
    losses_before = two_rank_run[1]
    resumed = train(run_dir, "--nproc", str(world), "--steps", "12", "--checkpoint-every", "4",
                    "--no-async-checkpoint")
    assert resumed.returncode == 0, resumed.output[-3000:]
    loads = [e for e in resumed.events if e.event == "load_done" and e.get("path")]
    assert loads[-1].step == 8 and loads[-1]["source"] == "storage (resharded)"
    manifest = _last_manifest(run_dir)
    assert manifest["world_size"] == world and manifest["step"] == 12
    # continued at global sample 128: 4 more steps of `world` ranks x 8 samples
    assert manifest["data_state"]["0"]["state"] == {"position": 128 + 4 * world * 8}
    after = [e["loss"] for e in resumed.events if e.event == "step" and e.rank == 0 and e.step == 9]
    assert after and after[-1] < losses_before[1]  # it resumed the trained model, not a fresh one
    report = validate(run_dir)
    assert report.valid, [str(f) for f in report.all_findings]


def test_a_worker_that_cannot_import_the_task_asks_not_to_be_restarted(tmp_path):
    """The launcher's preflight ran elsewhere (a cluster pod's image may lack the task): exit 93."""
    from resilient_training.run import events as ev

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "resilient_training.runtime.worker", "--run-dir", str(run_dir),
                           "--task", "no_such_module_here:task", "--no-inprocess", "--no-ft-launcher"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 93, proc.stderr[-2000:]
    end = [e for e in ev.read_events(run_dir) if e.event == "end"]
    assert end[-1]["status"] == "failed" and "task module no_such_module_here failed to import" in end[-1]["reason"]


def test_a_worker_whose_model_the_promotion_cannot_export_stops_before_training(tmp_path):
    """A cluster's pipeline with ``export=hf`` and a task that builds no transformers model (in
    the trainer image, which nothing before the job can import) trained to the end, then failed
    at promotion: the workers refuse it first, and ask not to be restarted (exit 93).
    """
    from resilient_training.run import events as ev

    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "resilient_training.runtime.worker", "--run-dir", str(run_dir),
                           "--export-format", "hf", "--no-inprocess", "--no-ft-launcher"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 93, proc.stderr[-2000:]
    events = ev.read_events(run_dir)
    assert not [e for e in events if e.event in ("step", "ckpt_begin")]
    reason = [e for e in events if e.event == "end"][-1]["reason"]
    assert reason == ("export_format hf: the run's task (resilient_training.tasks.gpt:task) builds a GPT, not a "
                      "transformers model: export it with safetensors or torch"), reason


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_a_transformers_task_passes_the_hf_export_check():
    config = cfg.from_argv(["--run-dir", "r", "--task", "resilient_training.tasks.llama:LlamaTask",
                            "--export-format", "hf"])
    tk.check_export(config, tk.task_from_config(config))
    tk.preflight(config, world_size=1)


@pytest.mark.slow
def test_a_task_file_named_relative_to_the_current_directory_reaches_the_workers(tmp_path):
    """Also: a half-imported module hands over to the launcher instead of retrying in-process.
    Seen in CI: an in-process restart interrupted torch's lazy import of dynamo; the module it
    left half-initialized failed all eight in-process retries and the job. A new process works.
    """
    import json
    import shutil

    from resilient_training.run import events as ev

    shutil.copy(USER_TASK, tmp_path / "my_task.py")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", "train", "--run-dir", str(run_dir),
                           "--nproc", "1", "--steps", "2", "--checkpoint-every", "2",
                           "--task", "my_task.py:half_imported_once"],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    task = json.loads((run_dir / "config.json").read_text())["task"]
    assert task == f"{tmp_path / 'my_task.py'}:half_imported_once"
    events = ev.read_events(run_dir)
    failures = [e for e in events if e.event == "failure_detected"]
    assert [(e.attempt, e["cause"]) for e in failures] == [(0, "interrupted_import")]
    assert not [e for e in events if e.event == "restart_begin" and e.get("layer") == "inprocess"]
    assert [e.attempt for e in events if e.event == "restart_done" and e.get("layer") == "launcher"] == [1]
    end = next(e for e in events if e.event == "end" and e.attempt == 0)
    assert end["status"] == "failed" and "handing over to the launcher" in end["reason"]


def test_the_built_in_task_from_the_runs_flags_starts_without_a_torch_import_in_the_cli():
    """Its values are checked by TrainConfig; the task check (a torch import, 2.4-2.7 s on the
    CI machine) is left to tasks it cannot check: user tasks and ``--task-arg``.
    """
    code = ("import sys, time; from resilient_training.launch import local; from resilient_training.run import config; "
            "local.preflight(config.TrainConfig(run_dir=sys.argv[1]), world_size=2); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, "r"], capture_output=True, text=True, check=True, cwd="/tmp")
    assert out.stdout.strip() == "False", out.stderr[-2000:]


@pytest.mark.slow
def test_a_task_that_breaks_its_interface_while_training_stops_at_once(tmp_path):
    """Found by a stranger trial: a loss that is not a scalar was retried by 8 in-process restarts
    (40 lines, the same TaskError each time). A task's broken contract is never retried."""
    from resilient_training.run import events as ev

    run = train(tmp_path / "run", "--nproc", "2", "--steps", "6", "--task", f"{USER_TASK}:loss_not_scalar")
    assert run.returncode != 0
    assert "FAILED: stopped without a restart: task loss() returned a tensor of shape [16, 1]" in run.output
    events = ev.read_events(tmp_path / "run")
    assert not [e for e in events if e.event in ("restart_begin", "restart_done")]
    # Each rank finds it at its own step 1 (no collective before the check); one may be stopped first.
    assert {e.rank for e in events if e.event == "failure_detected" and e["cause"] == "TaskError"} <= {0, 1}
    assert [e for e in events if e.event == "failure_detected" and e["cause"] == "TaskError"]


@pytest.mark.slow
def test_a_task_bug_met_again_at_every_replay_stops_after_three_tries(tmp_path):
    """Found by a stranger trial: a KeyError in the task's code, met at the same step after every
    restore, was retried by the in-process layer up to its limit (8), then reported as a gave-up
    restart. The third identical try stops the run, naming it a bug."""
    from resilient_training.run import events as ev

    run = train(tmp_path / "run", "--nproc", "2", "--steps", "20", "--checkpoint-every", "2",
                "--task", f"{USER_TASK}:bad_sample")
    assert run.returncode != 0
    said = re.search(r"the same failure at step (\d+) in 3 tries in a row \(KeyError: 'sample 100 is missing'\): "
                     r"a bug in the task's code or data, not a fault \(the task's code: retrying cannot help\)",
                     run.output)
    assert said, run.output[-3000:]
    events = ev.read_events(tmp_path / "run")
    failed = [e for e in events if e.event == "failure_detected" and e["cause"] == "KeyError"]
    assert len(failed) == 3 and {(e.rank, e.step) for e in failed} == {(failed[0].rank, int(said[1]))}, failed
    assert len([e for e in events if e.event == "restart_begin" and e.rank == failed[0].rank]) == 2
    assert {e.attempt for e in events} == {0}  # no launcher restart either


def test_a_task_file_imports_the_modules_beside_it(tmp_path, monkeypatch):
    """Found by a stranger trial: `import mytask` from a task file failed unless PYTHONPATH named its folder."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "team_helpers_rt.py").write_text("WIDTH = '5'\n")
    (tmp_path / "team_task_rt.py").write_text(
        "import importlib.util, team_helpers_rt\n"
        f"spec = importlib.util.spec_from_file_location('ut_rt', {USER_TASK!r})\n"
        "ut = importlib.util.module_from_spec(spec); spec.loader.exec_module(ut)\n"
        "def make():\n    return ut.make(width=team_helpers_rt.WIDTH)\n")
    assert tk.load_task(f"{tmp_path / 'team_task_rt.py'}:make").width == 5


EXITING_TASK = """\
import importlib.util, os, sys
WHERE = os.environ.get("RT_TASK_EXIT", "")
if WHERE == "import-os":
    os._exit(0)
if WHERE == "import-sys":
    sys.exit(0)
spec = importlib.util.spec_from_file_location("ut_exiting", {user_task!r})
ut = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ut)


class Exiting(ut.Task):
    def build_model(self):
        if WHERE == "build_model":
            os._exit(0)
        if WHERE == "c-exit":
            import ctypes
            ctypes.CDLL(None).exit(0)
        if WHERE == "exec":
            os.execv("/bin/true", ["true"])
        return super().build_model()

    def build_optimizer(self, model):
        if WHERE == "build_optimizer":
            sys.exit(0)
        return super().build_optimizer(model)


def make(width="16", lr="0.05"):
    if WHERE == "factory":
        sys.exit(0)
    return Exiting(int(width), float(lr))
"""


@pytest.fixture(scope="module")
def exiting_task_run(tmp_path_factory):
    """A run of a task that ends the process when ``RT_TASK_EXIT`` names where; validated without it."""
    root = tmp_path_factory.mktemp("exiting")
    task_file = root / "exiting_task.py"
    task_file.write_text(EXITING_TASK.format(user_task=USER_TASK))
    run = train(root / "run", "--nproc", "1", "--steps", "2", "--checkpoint-every", "2", "--task", f"{task_file}:make")
    assert run.returncode == 0, run.output[-3000:]
    valid = _cli("validate-checkpoint", str(root / "run"), where="")  # recorded: export needs it
    assert valid.returncode == 0, valid.stdout + valid.stderr
    return root / "run"


def _cli(*args: str, where: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run([sys.executable, "-m", "resilient_training.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RT_TASK_EXIT": where})


@pytest.mark.parametrize("where, said", [
    ("import-os", "failed to import: TaskError: the run's task tried to end the process (os._exit(0))"),
    ("import-sys", "failed to import: SystemExit: 0"),  # an import's SystemExit was always caught
    ("factory", "the run's task tried to end the process (sys.exit(0))"),
    ("build_model", "the run's task tried to end the process (os._exit(0))"),
    ("build_optimizer", "the run's task tried to end the process (sys.exit(0))")], ids=lambda v: v if " " not in v else "")
def test_a_task_that_ends_the_process_is_not_a_valid_checkpoint(exiting_task_run, where, said):
    """Found by a stranger trial: a task calling os._exit(0) while the gate built its model made
    validate-checkpoint exit 0, a "yes" that nothing had judged."""
    proc = _cli("validate-checkpoint", str(exiting_task_run), "--no-record", where=where)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "INVALID" in proc.stdout and "load_failed" in proc.stdout, proc.stdout
    assert said in proc.stdout, proc.stdout


@pytest.mark.parametrize("where", ["c-exit", "exec"])
@pytest.mark.parametrize("command", ["validate-checkpoint", "export"])
def test_a_task_that_ends_the_process_below_python_is_no_verdict(exiting_task_run, tmp_path, where, command):
    """The C library's exit (ctypes) or an exec while the gate ran the task: status 0 was "valid"."""
    argv = ["--no-record"] if command == "validate-checkpoint" else ["--format", "hf", "-o", str(tmp_path / "hf")]
    proc = _cli(command, str(exiting_task_run), *argv, where=where)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1:] == [
        f"error: {command} ended without a verdict (exit status 0): the run's task ended the process below Python "
        "(the C library's exit or an exec) while it ran"], proc.stderr
    assert not (tmp_path / "hf").exists()


def test_an_hf_export_whose_task_ends_the_process_is_refused(exiting_task_run, tmp_path):
    proc = _cli("export", str(exiting_task_run), "--format", "hf", "-o", str(tmp_path / "hf"), where="build_model")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the run's task tried to end the process (os._exit(0))" in proc.stderr, proc.stderr
    assert not (tmp_path / "hf").exists()
