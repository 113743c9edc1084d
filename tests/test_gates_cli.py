"""The gate subcommands' exit codes and output: 0 passed, 1 failed/refused, 2 unusable input (nothing written)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resilient_training.cli.main import main
from tests.support.gates import ScriptedLog, write_checkpoint


@pytest.fixture
def run(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    write_checkpoint(path, step=30, train_steps=3)  # the gate judges the losses up to the checkpoint's step
    log = ScriptedLog(path)
    log.steps(1, 30, checkpoint_every=3)
    log.end()
    log.close()
    return path


def test_validate_then_gate_then_promote(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "dest"
    assert main(["promote", str(run), str(dest)]) == 1  # neither gate ran yet
    assert "refused: checkpoints/step_30 was never validated" in capsys.readouterr().err
    assert main(["validate-checkpoint", str(run)]) == 0
    assert capsys.readouterr().out.startswith("VALID checkpoints/step_30 (step 30, 2 ranks")
    assert main(["check-convergence", str(run), "--json"]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["passed"] and [c["name"] for c in verdict["checks"]] == [
        "finite", "completed", "final_loss", "improvement", "continuity"]
    assert main(["promote", str(run), str(dest), "--json"]) == 0
    outcome = json.loads(capsys.readouterr().out)
    assert outcome["promoted"] is True and outcome["already_promoted"] is False
    assert main(["promote", str(run / "checkpoints/step_30"), str(dest)]) == 0
    assert "already promoted (no-op)" in capsys.readouterr().out


def test_promote_and_export_json_say_why_when_refused(run: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a stranger trial: ``--json`` printed nothing on a refusal, so a script reading stdout
    saw no outcome at all. Each refusal and usage error is JSON on stdout and one line on stderr."""
    cases = [
        (["promote", str(run), str(tmp_path / "dest"), "--json"], 1, "promoted", "refused", "never validated"),
        (["promote", str(run), "s3://BAD/x", "--json"], 2, "promoted", "usage_error", "bucket"),
        (["export", str(run), "--format", "safetensors", "-o", str(tmp_path / "m.st"), "--json"], 1,
         "exported", "refused", "validat"),
        (["export", str(run), "--format", "pickle", "-o", str(tmp_path / "m"), "--json"], 2,
         "exported", "usage_error", "pickle"),
    ]
    for argv, code, key, kind, words in cases:
        assert main(argv) == code, argv
        captured = capsys.readouterr()
        outcome = json.loads(captured.out)
        assert outcome[key] is False and outcome["outcome"] == kind and outcome["exit_code"] == code, argv
        assert words in outcome["error"], (argv, outcome)
        line = captured.err.strip()
        assert "\n" not in line and line.startswith("refused: " if code == 1 else "error: ") and words in line
    assert not (tmp_path / "dest").exists() and not (tmp_path / "m.st").exists()


def test_invalid_checkpoint_exits_1_with_json_findings(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (run / "checkpoints/step_30/manifest.json").write_text("not json")
    assert main(["validate-checkpoint", str(run), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] is False
    assert [(f["code"], f["file"]) for f in report["findings"]] == [
        ("manifest_invalid", "checkpoints/step_30/manifest.json")]


def test_failed_gate_exits_1(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-convergence", str(run), "--max-final-loss", "0.5"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED convergence gate") and "FAIL final_loss" in out


@pytest.mark.parametrize("command", ["validate-checkpoint", "check-convergence"])
@pytest.mark.parametrize("case", ["missing", "file", "not-a-run"])
def test_unusable_paths_exit_2_and_write_nothing(tmp_path: Path, command: str, case: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "target"
    if case == "file":
        target.write_text("x")
    elif case == "not-a-run":
        target.mkdir()
    before = sorted(tmp_path.rglob("*"))
    assert main([command, str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(target) in err
    if case == "file":  # was "the earlier convergence record …/gates/convergence.json cannot be removed" (a stranger trial)
        assert err.startswith(f"error: {target} is not a directory"), err
    assert sorted(tmp_path.rglob("*")) == before


def test_bad_flags_exit_2(run: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["check-convergence", str(run), "--window", "many"])
    assert exc.value.code == 2
    assert main(["check-convergence", str(run), "--window", "0"]) == 2


def test_console_script_is_installed(run: Path) -> None:
    exe = Path(sys.executable).with_name("resilient-training")
    proc = subprocess.run([str(exe), "validate-checkpoint", str(run), "--json", "--no-record"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["checkpoints"][0]["step"] == 30
    assert not (run / "gates").exists()


def test_report_json_names_the_run_absolutely(run: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a stranger trial: ``report RUN --json`` from inside the run said ``"run_dir": "."``,
    which names nothing once the JSON is kept elsewhere."""
    monkeypatch.chdir(run)
    assert main(["report", ".", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_dir"] == str(run.resolve())


def test_report_dash_o_prints_the_html_and_writes_no_file(run: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A stranger trial's ``-o -`` wrote a file named ``-`` (and ``-o /dev/stdout``, as root, replaced
    the link with a file: refused now, tests/test_bad_input.py)."""
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(run), "-o", "-"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("<!DOCTYPE html>") and out.rstrip().endswith("</html>"), out[:200]
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("command", ["validate-checkpoint", "check-convergence"])
@pytest.mark.parametrize("case", ["gates-is-a-file", "record-is-a-dir"])
def test_a_record_that_cannot_be_written_is_one_line_before_the_gate_runs(
        run: Path, command: str, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a stranger trial: a traceback after the whole validation, and a temporary file left."""
    gate = "validation" if command == "validate-checkpoint" else "convergence"
    if case == "gates-is-a-file":
        (run / "gates").write_text("not a directory")
    else:
        (run / "gates" / f"{gate}.json").mkdir(parents=True)
    assert main([command, str(run)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "cannot be written" in captured.err
    if case == "record-is-a-dir":
        assert [p.name for p in (run / "gates").iterdir()] == [f"{gate}.json"]  # nothing left beside it


@pytest.mark.parametrize("flags", [["--json"], []])  # a long output breaks while printing, a short one at the flush
def test_output_to_a_reader_that_went_away_is_no_traceback(run: Path, flags: list[str]) -> None:
    """Found by a stranger trial: `… | head -1` printed a BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "resilient_training.cli", "check-convergence", str(run),
                             "--no-record", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_a_manifest_nested_past_the_recursion_limit_is_a_finding_not_a_traceback(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Stranger trial: 200000 '[' as a manifest gave a RecursionError traceback in all three gates."""
    (run / "checkpoints" / "step_30" / "manifest.json").write_text("[" * 200000 + "]" * 200000)
    assert main(["validate-checkpoint", str(run)]) == 1
    out = capsys.readouterr().out
    assert "manifest_invalid" in out and "nested too deeply" in out, out
    for command in (["check-convergence", str(run)], ["promote", str(run), str(tmp_path / "promoted")]):
        assert main(command) in (1, 2)
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.count("\n") <= 2, err


def test_report_json_is_strict_json_with_a_nan_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stranger trial: a NaN loss (which the event log allows: the NaN fault) made ``report --json``
    print a bare ``NaN``, which standard JSON parsers refuse. Non-finite numbers are null."""
    log = ScriptedLog(tmp_path / "run")
    log.start()
    log.emit("load_done", 0, path="", seconds=0.0)
    log.steps(1, 4, loss=lambda step: float("nan") if step == 3 else 5.0 - step)
    log.end()
    log.close()

    def refuse(token: str) -> None:
        raise ValueError(f"not JSON: {token}")

    assert main(["report", str(tmp_path / "run"), "--json"]) == 0
    out = capsys.readouterr().out
    metrics = json.loads(out, parse_constant=refuse)
    assert metrics["status"] == "completed"
    assert main(["report", str(tmp_path / "run"), "--json", str(tmp_path / "m.json")]) == 0
    json.loads((tmp_path / "m.json").read_text(), parse_constant=refuse)


def test_gates_are_refused_while_a_training_holds_the_run_and_a_training_while_a_gate_reads_it(
        run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fourth stranger trial: promote copied step 20 while a resume trained on, and validation
    judged a checkpoint the training pruned meanwhile. A training holds RUN/.lock exclusively, the
    gates shared."""
    import os

    from resilient_training.launch.local import LaunchError, claim_run_dir
    from resilient_training.run import config as cfg
    from resilient_training.run.gate_records import reading_run
    from tests.support.gates import TINY

    config = cfg.TrainConfig(run_dir=str(run), model=TINY, steps=30)
    with claim_run_dir(config):
        for argv in (["validate-checkpoint", str(run)], ["check-convergence", str(run)],
                     ["promote", str(run / "checkpoints" / "step_30"), str(tmp_path / "dest")],
                     ["export", str(run), "--format", "torch", "-o", str(tmp_path / "m.pt")]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            said = f"run directory {run} is training (pid {os.getpid()}, or the workers it started): "
            assert err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "dest").exists() and not (tmp_path / "m.pt").exists()
    with reading_run(run / "checkpoints" / "step_30", "validate it"):
        with pytest.raises(LaunchError, match="is being read by a gate .*: wait for it to end"):
            with claim_run_dir(config):
                pass
    assert main(["validate-checkpoint", str(run)]) == 0  # free again


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_run_lock_removed_or_replaced_mid_training_is_made_again(
        run: Path, how: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Earlier stranger trials: deleting RUN/.lock while a training ran let every gate read the run
    (a lock on a file no longer at that path keeps nobody out). The training makes it again."""
    import os
    import time

    from resilient_training.launch.local import LockKeeper, claim_run_dir
    from resilient_training.run import config as cfg
    from tests.support.gates import TINY

    lock = run / ".lock"
    with claim_run_dir(cfg.TrainConfig(run_dir=str(run), model=TINY, steps=30)):
        lock.unlink()
        if how == "replaced":
            lock.write_text("")  # a file nobody holds: a gate could lock it shared
        deadline = time.monotonic() + 10 * LockKeeper.INTERVAL_S
        while main(["check-convergence", str(run), "--no-record"]) != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        err = capsys.readouterr().err
        assert f"run directory {run} is training (pid {os.getpid()}" in err.splitlines()[-1], err
        assert f"warning: {lock} was removed or replaced while this training ran: made again" in err, err
    assert main(["check-convergence", str(run), "--no-record"]) in (0, 1)  # free again
    assert not list(run.glob(".lock.*")), list(run.iterdir())


def test_a_gate_whose_run_lock_was_replaced_records_no_verdict(run: Path) -> None:
    """A gate that locked a file the training then replaced (see LockKeeper), or found no lock file
    while a training has taken one since, records nothing: the training may have changed the run."""
    import fcntl
    import os

    from resilient_training.run import gate_records

    lock = run / ".lock"
    lock.write_text("")
    with gate_records.reading_run(run, "judge it"):
        lock.unlink()
        lock.write_text("")
        with pytest.raises(gate_records.RecordError, match=r"\.lock was removed or replaced while this gate read "
                           r"the run: a training may have taken it meanwhile; judge it again"):
            gate_records.write_record(run, gate_records.CONVERGENCE, {"passed": True})
    lock.unlink()
    with gate_records.reading_run(run, "judge it"):
        gate_records.write_record(run, gate_records.CONVERGENCE, {"passed": True})  # no training: recorded
        fd = os.open(lock, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # as a training that began meanwhile
            with pytest.raises(gate_records.RecordError, match="a training may have taken it meanwhile"):
                gate_records.write_record(run, gate_records.CONVERGENCE, {"passed": True})
        finally:
            os.close(fd)
    assert gate_records._guards == []


def test_a_training_withdraws_the_gates_earlier_verdicts(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fourth stranger trial: a resume cancelled after the gates had passed, then promote said yes on
    their verdicts while the convergence gate now said the run ended cancelled."""
    from resilient_training.launch.local import claim_run_dir
    from resilient_training.run import config as cfg
    from resilient_training.run import gate_records
    from tests.support.gates import TINY

    assert main(["validate-checkpoint", str(run)]) == 0
    assert main(["check-convergence", str(run), "--max-final-loss", "100", "--min-improvement", "0"]) == 0
    assert gate_records.read_record(run, gate_records.VALIDATION) is not None
    assert gate_records.read_record(run, gate_records.CONVERGENCE) is not None
    with claim_run_dir(cfg.TrainConfig(run_dir=str(run), model=TINY, steps=30)):
        assert gate_records.read_record(run, gate_records.VALIDATION) is None
        assert gate_records.read_record(run, gate_records.CONVERGENCE) is None
    capsys.readouterr()


def test_a_sigkilled_gate_takes_its_child_along(run: Path) -> None:
    """A fourth stranger trial: `kill -KILL` of validate-checkpoint's process left its child (the
    validation itself) running, which wrote a passed record seconds later."""
    import time

    proc = subprocess.Popen([sys.executable, "-m", "resilient_training.cli", "validate-checkpoint", str(run)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    deadline = time.monotonic() + 60
    while not children.read_text().split() and time.monotonic() < deadline:
        time.sleep(0.02)
    (child,) = children.read_text().split()
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        try:
            if Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break  # dead (a zombie until init reaps it)
        except OSError:
            break
        time.sleep(0.05)
    else:
        assert not Path(f"/proc/{child}").exists(), "the validation outlived its command"
    time.sleep(1.0)
    assert not (run / "gates" / "validation.json").exists()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_a_run_lock_that_is_no_regular_file_is_named_not_followed_or_waited_on(
        run: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A fourth stranger trial's re-trial: a FIFO at RUN/.lock hung every gate and `train` silently;
    `train` wrote its pid through a symbolic link there into the link's target."""
    import os

    from resilient_training.launch.local import LaunchError, claim_run_dir, preflight
    from resilient_training.run import config as cfg
    from tests.support.gates import TINY

    lock, target = run / ".lock", tmp_path / "target"
    target.write_text("999999\n")
    {"fifo": lambda: os.mkfifo(lock), "symlink": lambda: lock.symlink_to(target), "directory": lock.mkdir}[kind]()
    assert main(["check-convergence", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {lock} is not a regular file") and err.count("\n") == 1, err
    assert err.endswith(": it is the run's training lock; remove it\n"), err
    config = cfg.TrainConfig(run_dir=str(run), model=TINY, steps=40)
    with pytest.raises(LaunchError, match=r"\.lock is not a regular file.*remove it"):
        preflight(config, world_size=1)
    with pytest.raises(LaunchError, match=r"\.lock is not a regular file.*remove it"):
        with claim_run_dir(config):
            pass
    assert target.read_text() == "999999\n"


def test_a_run_directory_inside_another_run_is_refused(run: Path) -> None:
    """A fourth stranger trial's re-trial trained into RUN/checkpoints/step_20 (a committed
    checkpoint, then found damaged), outside the lock of the run around it."""
    from resilient_training.launch.local import LaunchError, preflight
    from resilient_training.run import config as cfg

    for inner in (run / "checkpoints" / "step_30", run / "checkpoints", run / "sub" / "run"):
        with pytest.raises(LaunchError, match=f"lies inside the run {run}: train in a directory of its own"):
            preflight(cfg.TrainConfig(run_dir=str(inner), steps=40), world_size=1)
    assert not (run / "sub").exists()
