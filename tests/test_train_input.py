"""Bad input to `resilient-training train` is refused with the reason before any worker starts."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.runs import Run, train


def train_here(run_dir, *args: str, capsys) -> Run:
    """`train` refused in preflight, through the command's entry point in this process: its
    checkpoint check imports torch, seconds in a new process (the process boundary is covered by
    the other runs in this file).
    """
    from resilient_training.cli.main import main

    capsys.readouterr()
    code = main(["train", "--run-dir", str(run_dir), *args])
    captured = capsys.readouterr()
    return Run(code, captured.out + captured.err, run_dir)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--faults", "sigkill@12"], "expected TYPE@STEP:RANK"),
        (["--faults", "meteor@3:0"], "unknown fault type 'meteor'"),
        (["--faults", "sigkill@3:2", "--nproc", "2"], "rank 2 does not exist (world size 2)"),
        (["--checkpoint-every", "0"], "checkpoint_every must be a positive number of steps"),
        (["--steps", "-3"], "steps must be positive"),
        (["--faults", "writer-kill@5:0", "--no-async-checkpoint"], "writer-kill needs async checkpointing"),
        (["--nproc", "0"], "world size must be at least 1"),
        # A fourth stranger trial: the first started the workers (exit 1 after ~10 s), the others
        # trained, their values never read.
        (["--export-format", "hf"], "export_format hf writes a transformers model, and the built-in GPT task's is not "
                                    "one"),
        (["--pod-restart-delay", "nan"], "--pod-restart-delay: a setting of the simulated cluster, which runs only "
                                         "with --nodes N"),
        (["--rdzv-last-call", "-1", "--min-nodes", "1"], "--min-nodes, --rdzv-last-call: a setting of"),
    ],
)
def test_bad_input_starts_nothing(tmp_path, args, message):
    run = train(tmp_path / "run", "--steps", "10", *args)
    assert run.returncode == 2, run.output
    assert message in run.output
    assert not (tmp_path / "run" / "events").exists()


def test_run_dir_with_another_models_checkpoints_is_refused(tmp_path, capsys):
    # Synchronous saves: no writer process to start (a torch import); the checkpoint is all that is needed.
    sync = "--no-async-checkpoint"
    first = train(tmp_path / "run", "--nproc", "1", "--steps", "2", "--checkpoint-every", "2", "--no-inprocess", sync)
    assert first.returncode == 0, first.output[-2000:]
    events_before = sorted(p.name for p in (tmp_path / "run" / "events").iterdir())
    size_before = sum(p.stat().st_size for p in (tmp_path / "run" / "events").iterdir())
    # Without its config.json (a directory copied without it): the checkpoint's own check. With it,
    # config.json's check comes first (test_model_flags_changed_before_any_checkpoint_are_refused).
    (tmp_path / "run" / "config.json").unlink()
    second = train_here(tmp_path / "run", "--nproc", "1", "--steps", "4", "--model-d-model", "32", capsys=capsys)
    assert second.returncode == 2
    assert "holds checkpoints of a different model" in second.output
    assert "Use a new --run-dir" in second.output
    assert sorted(p.name for p in (tmp_path / "run" / "events").iterdir()) == events_before
    assert sum(p.stat().st_size for p in (tmp_path / "run" / "events").iterdir()) == size_before


def test_run_dir_made_with_other_task_args_is_refused(tmp_path):
    """Found by a stranger trial: ``--task-arg d_model=32`` on a ``d_model=64`` run passed the checkpoint
    check (it compares the ``--model-*`` flags), then every rank failed its restarts on a size mismatch.
    (Resuming with the same task arguments, at another world size: test_task.py.)
    """
    run_dir = tmp_path / "run"
    args = ["--checkpoint-every", "2", "--no-inprocess", "--no-async-checkpoint"]  # no writer process to start
    first = train(run_dir, "--nproc", "1", "--steps", "2", *args, "--task-arg", "d_model=64")
    assert first.returncode == 0, first.output[-2000:]
    events_before = {p.name: p.read_bytes() for p in (run_dir / "events").iterdir()}
    config_before = (run_dir / "config.json").read_bytes()
    # --max-restarts 0: the old code's failure comes fast
    second = train(run_dir, "--nproc", "1", "--steps", "4", *args, "--max-restarts", "0", "--task-arg", "d_model=32")
    assert second.returncode == 2, second.output[-2000:]
    assert second.output.count("\n") == 1, second.output
    assert "task arg d_model: '64' (now '32')" in second.output and "use a new --run-dir" in second.output
    assert {p.name: p.read_bytes() for p in (run_dir / "events").iterdir()} == events_before
    assert (run_dir / "config.json").read_bytes() == config_before


def test_task_args_are_compared_as_the_task_receives_them(tmp_path):
    """``lr=0.10`` resumes a run made with ``lr=0.1`` when the factory's ``lr`` is a float (the raw
    strings were compared: a needless refusal); a string parameter's spelling still counts, and so
    does a value of another kind. The latest manifest's settings are compared the same way."""
    from resilient_training.launch.local import LaunchError, check_same_task, check_same_task_args, claim_run_dir
    from resilient_training.run import checkpoint_format as cf
    from resilient_training.run import config as cfg
    from tests.test_task import USER_TASK

    def config(**args: str) -> cfg.TrainConfig:
        return cfg.TrainConfig(run_dir=str(tmp_path / "run"), task=f"{USER_TASK}:make_typed", task_args=args)

    made = {"width": "4", "lr": "0.1", "momentum": "true", "name": "7"}
    with claim_run_dir(config(**made)):
        pass
    same = {"width": "4", "lr": "0.10", "momentum": "true", "name": "7"}
    check_same_task(config(**same), tmp_path / "run")
    check_same_task_args({"task_args": made}, config(**same))
    for changed, said in [({"lr": "0.2"}, "task arg lr: '0.1' (now '0.2')"), ({"name": "07"}, "task arg name: '7'"),
                          ({"width": "4.0"}, "task arg width: '4' (now '4.0')"), ({"momentum": "1"}, "momentum")]:
        with pytest.raises(LaunchError, match=re.escape(said)):
            check_same_task(config(**{**same, **changed}), tmp_path / "run")
        with pytest.raises(cf.CheckpointRefused, match="other task settings"):
            check_same_task_args({"task_args": made}, config(**{**same, **changed}))


def test_model_flags_changed_before_any_checkpoint_are_refused(tmp_path, capsys):
    """Found by a stranger trial: a run stopped before its first checkpoint, resumed with another
    ``--model-*`` flag, started over with the other model in the same event log (the checkpoint
    check needs a checkpoint). Its config.json is what tells."""
    from resilient_training.launch.local import claim_run_dir
    from resilient_training.run import config as cfg

    run_dir = tmp_path / "run"
    with claim_run_dir(cfg.TrainConfig(run_dir=str(run_dir), model=cfg.ModelConfig(d_model=64, n_heads=4))):
        pass
    config_before = (run_dir / "config.json").read_bytes()
    second = train_here(run_dir, "--nproc", "1", "--steps", "4", "--model-d-model", "32", capsys=capsys)
    assert second.returncode == 2, second.output
    assert "--model-d-model 64 (now 32)" in second.output and "use a new --run-dir" in second.output
    assert (run_dir / "config.json").read_bytes() == config_before and not (run_dir / "events").exists()
    # The same flags resume (here: nothing to resume, so preflight passes and training would start).
    from resilient_training.launch.local import check_same_task

    check_same_task(cfg.TrainConfig(run_dir=str(run_dir), model=cfg.ModelConfig(d_model=64, n_heads=4)), run_dir)


def test_a_second_training_in_the_run_directory_is_refused_and_sigterm_stops_the_workers(tmp_path, capsys):
    """A cancelled step (SIGTERM) must not leave ft_launcher and its workers running. While the
    first trains, a second ``train`` in its directory is refused before it writes anything (found
    by a stranger trial: the two interleaved, and the gates promoted the second's untrained model).
    """
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "resilient_training.cli", "train", "--run-dir", str(run_dir),
                             "--nproc", "2", "--steps", "400", "--step-seconds", "0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(run_dir.glob("events/rank1.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert list(run_dir.glob("events/rank1.jsonl")), "workers never started"

    def workers() -> list[str]:
        out = subprocess.run(["pgrep", "-f", "--", f"--run-dir {run_dir} "], capture_output=True, text=True).stdout
        return [pid for pid in out.split() if int(pid) != proc.pid]

    assert workers()
    from resilient_training.run import config as cfg
    from resilient_training.run import layout

    records = layout.worker_records(cfg.TrainConfig(run_dir=str(run_dir)))
    while not records.exists() and time.monotonic() < deadline:  # the workers' pid records, in /dev/shm
        time.sleep(0.2)
    assert records.exists()
    before = {path: path.read_bytes() for path in [run_dir / "config.json", *run_dir.glob("events/*.jsonl")]}
    second = train_here(run_dir, "--nproc", "2", "--steps", "400", "--lr", "0", capsys=capsys)
    assert second.returncode == 2, second.output
    assert second.output.strip() == (f"error: run directory {run_dir} is in use by another training (pid {proc.pid}): "
                                     "wait for it to end, or train in another --run-dir")
    assert (run_dir / "config.json").read_bytes() == before[run_dir / "config.json"]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err == ("interrupted (SIGTERM): stopped the training and its workers; the same command resumes "
                   f"from the last committed checkpoint in {run_dir}\n"), err
    deadline = time.monotonic() + 30
    while workers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert workers() == []
    # The run's last event says so: the report said status unknown, as for a run still training.
    from resilient_training.gates import metrics
    from resilient_training.run import events as ev

    last = ev.read_events(run_dir)[-1]
    assert (last.event, last.rank, last["status"]) == ("end", -1, "cancelled"), last
    assert last["reason"].startswith("cancelled (SIGTERM); the workers were stopped"), last
    assert metrics.compute_metrics(run_dir)["status"] == "cancelled"
    assert not records.exists()  # left behind by a stopped run (a fourth stranger trial)
    from resilient_training.launch.local import claim_run_dir

    with claim_run_dir(cfg.from_dict(json.loads(before[run_dir / "config.json"]))):
        pass  # free again once the launcher and its workers are gone


def test_a_step_planted_from_another_run_is_refused_before_any_worker_starts(tmp_path, capsys):
    """Found by a stranger trial: another run's step of the same shape, copied in as `latest`,
    was restored, trained on, validated, judged converged and promoted. Each run directory has a
    run_uid, and each manifest records its run's."""
    import shutil

    from resilient_training.run import checkpoint_format as cf
    from resilient_training.run import config as cfg
    from resilient_training.runtime.checkpointing import check_compatible
    from tests.support.gates import TINY, write_checkpoint

    ours = write_checkpoint(tmp_path / "ours", step=3, world_size=1)
    theirs = write_checkpoint(tmp_path / "theirs", step=5, world_size=1, seed=999)
    shutil.copytree(theirs, ours.parent / theirs.name)
    (ours.parent / "latest").write_text(theirs.name)
    planted = train_here(tmp_path / "ours", "--nproc", "1", "--steps", "8", capsys=capsys)
    assert planted.returncode == 2 and planted.output.count("\n") == 1, planted.output
    assert "latest checkpoint (step 5) was saved by another run" in planted.output
    # The worker's own check at a restore (a cluster's workers do not come through preflight).
    config = cfg.TrainConfig(run_dir=str(tmp_path / "ours"), model=TINY)
    with pytest.raises(cf.CheckpointRefused, match="saved by another run"):
        check_compatible(cf.read_manifest(ours.parent / theirs.name), config)
    check_compatible(cf.read_manifest(ours), config)  # its own
    # A copy of the whole run directory is the same run.
    shutil.copytree(tmp_path / "theirs", tmp_path / "copy")
    check_compatible(cf.read_manifest(tmp_path / "copy" / "checkpoints" / theirs.name),
                     cfg.TrainConfig(run_dir=str(tmp_path / "copy"), model=TINY))


@pytest.mark.parametrize("how", ["run_uid-deleted", "run_uid-copied", "unlogged-step"])
def test_a_planted_step_that_claims_to_be_this_runs_is_refused_by_its_event_log(tmp_path, capsys, how):
    """Found by a third stranger trial: another run's step planted with ``run_uid`` deleted from its
    manifest (an older manifest's form, which is not checked) was resumed, trained on, validated,
    judged converged (its loss curve continued within tolerance) and promoted. The run's event
    log records the digest of every manifest it committed; a step it records no commit of is
    refused too."""
    import shutil

    from resilient_training.launch.local import check_committed_by_run
    from resilient_training.run import checkpoint_format as cf
    from tests.support.gates import TINY, rewrite_manifest, write_checkpoint

    ours = write_checkpoint(tmp_path / "ours", step=3, world_size=1)
    check_committed_by_run(tmp_path / "ours", ours, cf.read_manifest(ours))  # its own: resumed
    theirs = write_checkpoint(tmp_path / "theirs", step=5 if how == "unlogged-step" else 3, world_size=1, seed=999)
    planted = ours.parent / theirs.name
    shutil.rmtree(planted, ignore_errors=True)
    shutil.copytree(theirs, planted)
    uid = cf.read_run_uid(tmp_path / "ours")
    rewrite_manifest(planted, lambda m: m.pop("run_uid") if how == "run_uid-deleted" else m.update(run_uid=uid))
    rewrite_manifest(planted, lambda m: m.update(seed=1234))  # ours: the changed seed is refused on its own
    (ours.parent / "latest").write_text(planted.name)
    tiny = [flag for name in TINY.__slots__ for flag in (f"--model-{name.replace('_', '-')}", str(getattr(TINY, name)))]
    refused = train_here(tmp_path / "ours", "--nproc", "1", "--steps", "8", "--batch-size", "4", *tiny, capsys=capsys)
    assert refused.returncode == 2 and refused.output.count("\n") == 1, refused.output
    said = ("is not known to be this run's: the run's event log records no commit of step 5" if how == "unlogged-step"
            else "is not the checkpoint this run committed at step 3: its manifest's digest is not the one")
    assert said in refused.output, refused.output
    assert ("echo step_3 > " if how == "unlogged-step" else "No committed step before it") in refused.output


@pytest.mark.parametrize(("key", "value"), [("task", 5), ("model_config", [1]), ("task", ["a:b"])])
def test_a_manifest_with_a_task_or_model_of_the_wrong_type_is_one_line(tmp_path, capsys, key, value):
    """Found by a third stranger trial: ``task`` 5 and ``model_config`` [1] were tracebacks (exit 1)."""
    from tests.support.gates import TINY, rewrite_manifest, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "run", step=3, world_size=1)
    rewrite_manifest(ckpt, lambda m: m.update({key: value}))
    tiny = [flag for name in TINY.__slots__ for flag in (f"--model-{name.replace('_', '-')}", str(getattr(TINY, name)))]
    refused = train_here(tmp_path / "run", "--nproc", "1", "--steps", "8", "--batch-size", "4", *tiny, capsys=capsys)
    assert refused.returncode == 2 and refused.output.count("\n") == 1, refused.output
    assert "(step 3) has a damaged manifest" in refused.output and repr(value) in refused.output, refused.output


@pytest.mark.parametrize("damage", ["flipped", "cut", "deleted"])
def test_a_damaged_latest_checkpoint_is_refused_before_any_worker_starts(tmp_path, capsys, damage):
    """Found by a stranger trial: a chunk's bytes changed in place (same length) were restored and
    trained on, and every gate passed; a cut or deleted file took 19 restarts and 65 s to end in
    "a different model"."""
    from tests.support.gates import TINY, write_checkpoint

    ckpt = write_checkpoint(tmp_path / "run", step=3, world_size=1)
    tiny = [flag for name in TINY.__slots__ for flag in (f"--model-{name.replace('_', '-')}", str(getattr(TINY, name)))]
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "flipped":
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "cut":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        shard.unlink()
    refused = train_here(tmp_path / "run", "--nproc", "1", "--steps", "8", *tiny, capsys=capsys)
    assert refused.returncode == 2 and refused.output.count("\n") == 1, refused.output
    expected = {"flipped": "__0_0.distcp differs from what was committed (its checksum)",
                "cut": f"__0_0.distcp holds {len(data) // 2} bytes, the manifest records {len(data)}",
                "deleted": "__0_0.distcp is missing"}[damage]
    assert f"{ckpt} is damaged: {expected}" in refused.output, refused.output
    assert f"No committed step before it: remove {ckpt.parent / 'latest'}" in refused.output


@pytest.mark.parametrize("edit", ["no-files", "file-unlisted", "name-with-slash"])
def test_a_manifest_edited_to_skip_the_resume_check_is_refused(tmp_path, capsys, edit):
    """Found by the second stranger trial: the check hashed only what the manifest lists, so a
    manifest with no files, or without the damaged one, resumed it; a name with a slash was a
    traceback."""
    from tests.support.gates import TINY, write_checkpoint

    write_checkpoint(tmp_path / "run", step=2, world_size=1)
    ckpt = write_checkpoint(tmp_path / "run", step=3, world_size=1)
    tiny = [flag for name in TINY.__slots__ for flag in (f"--model-{name.replace('_', '-')}", str(getattr(TINY, name)))]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    if edit == "no-files":
        manifest["files"] = {}
        said = "manifest.json lists no files"
    elif edit == "file-unlisted":
        del manifest["files"]["__0_0.distcp"]
        said = "__0_0.distcp is not in the manifest"
    else:
        manifest["files"]["sub/x"] = manifest["files"].pop("data_rank_0.pt")
        said = "the manifest names 'sub/x', which is no file of a checkpoint directory"
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    refused = train_here(tmp_path / "run", "--nproc", "1", "--steps", "8", *tiny, capsys=capsys)
    assert refused.returncode == 2 and refused.output.count("\n") == 1, refused.output
    assert said in refused.output and f"echo step_2 > {ckpt.parent / 'latest'}" in refused.output, refused.output


@pytest.mark.parametrize("uid", ["missing", "empty", "directory", "dangling-link", "not-text"])
def test_a_lost_run_uid_is_named_with_the_way_back(tmp_path, capsys, uid):
    """Found by the second stranger trial: a deleted run_uid was replaced by a new one during the
    check (every later resume refused as "another run"), and a directory, a dangling link or bytes
    that are no text there were tracebacks."""
    import os

    from tests.support.gates import TINY, write_checkpoint

    write_checkpoint(tmp_path / "run", step=3, world_size=1)
    path = tmp_path / "run" / "run_uid"
    recorded = path.read_text().strip()
    path.unlink()
    if uid == "empty":
        path.write_text("")
    elif uid == "directory":
        path.mkdir()
    elif uid == "dangling-link":
        os.symlink(tmp_path / "nowhere", path)
    elif uid == "not-text":
        path.write_bytes(b"\xff\xfe")
    tiny = [flag for name in TINY.__slots__ for flag in (f"--model-{name.replace('_', '-')}", str(getattr(TINY, name)))]
    refused = train_here(tmp_path / "run", "--nproc", "1", "--steps", "8", *tiny, capsys=capsys)
    assert refused.returncode == 2 and refused.output.count("\n") == 1, refused.output
    assert str(path) in refused.output, refused.output
    if uid in ("missing", "empty"):
        assert f"record run uid {recorded!r}: if they are this run's, write that uid into it" in refused.output
        assert (uid == "missing") == (not path.exists())  # nothing made in its place


def test_lr_and_batch_size_changed_on_a_resume_are_refused(tmp_path, capsys):
    """Found by a stranger trial: `--lr 0` on a resume was recorded in config.json and the manifest,
    while the restored optimizer trained on at the old rate. A --task-arg of the same name is
    compared as a task argument instead."""
    from resilient_training.launch.local import check_same_task, claim_run_dir
    from resilient_training.run import config as cfg

    run_dir = tmp_path / "run"
    with claim_run_dir(cfg.TrainConfig(run_dir=str(run_dir))):
        pass
    for flags, said in ((["--lr", "0"], "--lr 0.003 (now 0.0)"), (["--batch-size", "4"], "--batch-size 8 (now 4)"),
                        (["--seed", "7"], "--seed 1234 (now 7)")):  # third stranger trial: resumed silently
        refused = train_here(run_dir, "--nproc", "1", "--steps", "4", *flags, capsys=capsys)
        assert refused.returncode == 2 and said in refused.output, refused.output
    check_same_task(cfg.TrainConfig(run_dir=str(run_dir)), run_dir)  # the same settings resume
    with pytest.raises(Exception, match="task arg lr: unset"):
        check_same_task(cfg.TrainConfig(run_dir=str(run_dir), lr=0.0, task_args={"lr": "0"}), run_dir)


def test_a_changed_lr_is_refused_by_the_checkpoint_when_config_json_is_gone(tmp_path, capsys):
    """Second stranger trial: with config.json deleted, `--lr 0.05` resumed and was never used (the
    restored optimizer kept 0.003). The latest manifest's task settings say the same."""
    from tests.support.gates import TINY, write_checkpoint

    write_checkpoint(tmp_path / "run", step=3, world_size=1)  # lr 0.003, batch size 4
    assert not (tmp_path / "run" / "config.json").exists()
    tiny = [flag for name in TINY.__slots__ for flag in (f"--model-{name.replace('_', '-')}", str(getattr(TINY, name)))]
    refused = train_here(tmp_path / "run", "--nproc", "1", "--steps", "8", "--batch-size", "4", "--lr", "0.05", *tiny,
                         capsys=capsys)
    assert refused.returncode == 2 and refused.output.count("\n") == 1, refused.output
    assert "was saved with other task settings: lr '0.003' (now '0.05')" in refused.output, refused.output
    # The same value written another way resumes: the effective settings are compared.
    from resilient_training.launch.local import check_same_task_args
    from resilient_training.run import checkpoint_format as cf
    from resilient_training.run import config as cfg

    manifest = cf.read_manifest(tmp_path / "run" / "checkpoints" / "step_3")
    check_same_task_args(manifest, cfg.TrainConfig(run_dir=str(tmp_path / "run"), model=TINY, lr=3e-3,
                                                   data=cfg.DataConfig(batch_size=4)))
    with pytest.raises(cf.CheckpointRefused, match="--seed 1234 \\(now 7\\)"):  # config.json gone: the manifest says
        check_same_task_args(manifest, cfg.TrainConfig(run_dir=str(tmp_path / "run"), model=TINY, lr=3e-3, seed=7,
                                                       data=cfg.DataConfig(batch_size=4)))


def test_a_resume_below_the_latest_checkpoints_step_is_refused(tmp_path, capsys):
    """A fourth stranger trial: a finished 30-step run resumed with --steps 12 restored step 30,
    logged "completed" at step 12, and the convergence gate then blamed an edited log."""
    from resilient_training.run import checkpoint_format as cf
    from resilient_training.run import config as cfg
    from resilient_training.runtime.checkpointing import check_compatible
    from tests.support.gates import TINY, write_checkpoint

    latest = write_checkpoint(tmp_path / "run", step=6, world_size=1)
    lower = train_here(tmp_path / "run", "--nproc", "1", "--steps", "4", capsys=capsys)
    assert lower.returncode == 2 and lower.output.count("\n") == 1, lower.output
    assert ("latest checkpoint is at step 6, past the run's target step 4 (--steps): a resume trains on from that "
            "checkpoint; give --steps 6 or more, or a new --run-dir") in lower.output
    # A cluster's workers (no pre-flight) refuse it at their restore: "retrying cannot help".
    with pytest.raises(cf.CheckpointRefused, match="past the run's target step 4"):
        check_compatible(cf.read_manifest(latest), cfg.TrainConfig(run_dir=str(tmp_path / "run"), model=TINY, steps=4))
    check_compatible(cf.read_manifest(latest), cfg.TrainConfig(run_dir=str(tmp_path / "run"), model=TINY, steps=6))
