"""`resilient-training run` as a process: stopped from outside, what it leaves behind, what it says
when promotion fails (findings of a stranger trial). Real `run` processes, real signals.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_TASK = f"{ROOT / 'examples' / 'char_conv' / 'task.py'}:task"
MARKER = "RT_TEST_RUN_MARKER"  # inherited by everything `run` starts: how the test finds its tree
SMALL = ["--steps", "6", "--checkpoint-every", "3", "--faults", "", "--min-improvement", "0", "--max-final-loss", "50"]

pytestmark = pytest.mark.slow


def _tree(marker: str) -> list[str]:
    """The live processes (not zombies) whose environment holds ``marker``: `run`'s tree."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if f"{MARKER}={marker}".encode() not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":
            found.append(f"{entry} {cmd[:120]}")
    return found


@pytest.fixture
def scratch() -> Iterator[Path]:
    """`run`'s TMPDIR: short, as ft_launcher's unix socket paths (108 bytes) under it need."""
    path = Path(tempfile.mkdtemp(prefix="rtt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(tmp_path: Path, scratch: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "TMPDIR": str(scratch)}
    # Its own session: the test can send SIGINT to its group as a terminal's Ctrl-C would. SIGINT
    # as a terminal leaves it: a suite started in the background (`cmd &`) inherits it ignored, and
    # the Ctrl-C test's run then trained to its end (CI, one clean clone).
    proc = subprocess.Popen([sys.executable, "-m", "resilient_training.cli", "run", "--output-dir",
                             str(tmp_path / "out"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, marker


def _wait_training(out: Path, timeout: float = 120) -> Path:
    """The run directory once its workers have recorded themselves (the whole tree is up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run_dir in (out / "runs").iterdir() if (out / "runs").is_dir() else []:
            if _worker_records(run_dir).is_dir():
                return run_dir
        time.sleep(0.5)
    raise AssertionError("the training never started")


def _temporary_dirs(scratch: Path) -> list[Path]:
    """What `run` left in its TMPDIR: kfp.local's `mktemp -d` per step (tmp.XXXXXX, one per step per
    run, piled up in /tmp) and `run`'s own scratch directory. torch's compile cache may stay: a cache.
    """
    return [p for p in scratch.iterdir() if p.name.startswith(("tmp.", "rt-local-"))]


def _assert_nothing_left(marker: str, scratch: Path, run_dir: Path, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while (left := _tree(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, "left running:\n" + "\n".join(left)
    assert _temporary_dirs(scratch) == []
    assert not _worker_records(run_dir).exists()
    assert _tier_folders(run_dir) == []  # the node-local tier's copies stayed in /dev/shm (stranger trial)


def _tier_folders(run_dir: Path) -> list[Path]:
    return sorted(_worker_records(run_dir).parent.glob(_worker_records(run_dir).name.replace("-workers", "-*")))


def _worker_records(run_dir: Path) -> Path:
    """Where the run's workers record their pids (runtime/gpu_reclaim.py): a completed run removes
    it, a killed one left it in /dev/shm.
    """
    return Path("/dev/shm/resilient-training") / f"{hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]}-workers"


@pytest.mark.parametrize(("signum", "code", "how"), [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "Ctrl-C")])
def test_a_signal_to_run_stops_everything_it_started_with_one_line(tmp_path: Path, scratch: Path, signum: int,
                                                                  code: int, how: str) -> None:
    """SIGTERM to `run`'s pid alone (a supervisor, `kill PID`) left the executor, the launcher and
    the workers training on; Ctrl-C printed kfp.local's KeyboardInterrupt traceback.
    """
    proc, marker = _start(tmp_path, scratch, "--steps", "200", "--faults", "",
                          "--train-overrides", '{"local_checkpoint_every": 3}')
    try:
        run_dir = _wait_training(tmp_path / "out")
        deadline = time.monotonic() + 60
        while not [p for p in _tier_folders(run_dir) if not p.name.endswith("-workers")]:
            assert time.monotonic() < deadline, "no node-local save in 60 s"
            time.sleep(0.2)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # the terminal sends Ctrl-C to the foreground group
        else:
            proc.send_signal(signum)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, (out[-2000:], err[-2000:])
    assert err.count("\n") == 1 and err.startswith(f"interrupted ({how}): stopped the pipeline"), err
    assert "Traceback" not in out + err
    _assert_nothing_left(marker, scratch, run_dir)
    from resilient_training.run import events as ev

    last = ev.read_events(run_dir)[-1]  # the run's own end: the report said status unknown
    assert (last.event, last.rank, last["status"]) == ("end", -1, "cancelled"), last


def test_sigkill_of_run_takes_its_training_down_too(tmp_path: Path, scratch: Path) -> None:
    """Nothing can run in `run` after SIGKILL: the processes it started notice that it died."""
    proc, marker = _start(tmp_path, scratch, "--steps", "200", "--faults", "")
    try:
        run_dir = _wait_training(tmp_path / "out")
        assert len(_tree(marker)) > 3  # the host, the step's executor, the launcher, its workers
        proc.kill()
        proc.communicate(timeout=30)
        _assert_nothing_left(marker, scratch, run_dir)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_failed_promotion_is_reported_as_it_happened_and_a_taken_dest_is_refused_before_training(
        tmp_path: Path, scratch: Path) -> None:
    """A transformers task whose tokenizer cannot be saved, exported as hf: promotion copies the
    checkpoint, then the export fails. The summary said "exported model: DEST/hf" (no such
    directory) and printed the component's whole traceback; then the same DEST trained 30 s before
    promotion refused it. (A task that is no transformers model is refused before training now.)
    """
    task_file = tmp_path / "broken_tokenizer.py"
    task_file.write_text(
        "from resilient_training.tasks.llama import task as llama\n\n\n"
        "class Task:\n"
        "    def __init__(self, inner):\n"
        "        self._inner = inner\n\n"
        "    def __getattr__(self, name):\n"
        "        return getattr(self._inner, name)\n\n"
        "    def tokenizer(self):\n"
        "        raise RuntimeError('the tokenizer files are not here')\n\n\n"
        "def task(**settings):\n"
        "    return Task(llama(**settings))\n")
    llama = ["--task", f"{task_file}:task", "--task-arg", "preset=tiny", "--task-arg", "seq_len=32",
             "--task-arg", "batch_size=4"]
    dest = tmp_path / "promoted"
    # Another run's directory in the same output, newer than anything this run writes: two `run`s
    # sharing an output directory once printed each other's run directory, records and report.
    decoy = tmp_path / "out" / "runs" / "decoy"
    (decoy / "events").mkdir(parents=True)
    (decoy / "gates").mkdir()
    (decoy / "gates" / "validation.json").write_text('{"passed": false, "findings": ["the decoy\'s"]}')
    later = time.time() + 3600
    for path in (decoy / "events", decoy / "gates" / "validation.json"):
        os.utime(path, (later, later))
    proc, _ = _start(tmp_path, scratch, *SMALL, *llama, "--export", "hf", "--promote-to", str(dest))
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, (out[-3000:], err[-3000:])
    assert "validation:         PASSED" in out and "convergence:        PASSED" in out, out
    assert "decoy" not in out and "run directory:      " + str(tmp_path / "out" / "runs") in out, out
    assert "Traceback" not in out + err and "exported model" not in out, out
    summary = out.split("=== resilient-training: summary")[1]
    assert "promoted model:     none: the promote step failed: " in summary, summary
    assert f"{dest} holds this run's checkpoint (step 6, promoted before the failure), without the hf export" \
        in summary, summary
    assert (dest / "promotion.json").is_file() and not (dest / "hf").exists()
    failed = err.strip().splitlines()[-1]
    assert failed.startswith("FAILED: step promote-model failed: ") and "(its output: " in failed, err
    assert _temporary_dirs(scratch) == []

    again = subprocess.run([sys.executable, "-m", "resilient_training.cli", "run", "--output-dir",
                            str(tmp_path / "again"), *SMALL, "--promote-to", str(dest)], capture_output=True,
                           text=True, cwd=ROOT, timeout=120)
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert f"--promote-to {dest} already holds a promoted model (step 6 of " in again.stderr
    assert not (tmp_path / "again").exists()  # refused before anything was written


def test_a_promote_to_where_nothing_can_be_made_is_refused_before_training(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("as another user, /proc is refused by the access() check already")
    proc = subprocess.run([sys.executable, "-m", "resilient_training.cli", "run", "--output-dir",
                           str(tmp_path / "out"), "--promote-to", "/proc/rt-x"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--promote-to /proc/rt-x: cannot create a file in /proc" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_ctrl_c_once_the_pipeline_had_ended_does_not_say_nothing_was_started(monkeypatch: pytest.MonkeyPatch,
                                                                             capsys: pytest.CaptureFixture[str],
                                                                             tmp_path: Path) -> None:
    """A stranger trial pressed Ctrl-C while the summary was being made: the model had been promoted,
    and `run` said "nothing was started"."""
    from resilient_training.cli import local

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(local, "_RAN", [])
    assert local._guard(interrupted)(None) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C): nothing was started\n"
    monkeypatch.setattr(local, "_RAN", [tmp_path])
    assert local._guard(interrupted)(None) == 130
    err = capsys.readouterr().err
    assert err.startswith(f"interrupted (Ctrl-C) after the pipeline had ended: its outputs are in {tmp_path} ")
    assert err.count("\n") == 1


def test_an_s3_dest_without_aws_credentials_is_refused_before_training(tmp_path: Path) -> None:
    """A stranger trial trained a whole run, then its promotion to s3:// failed for want of credentials."""
    none = str(tmp_path / "none")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_CONFIG_FILE": none, "AWS_SHARED_CREDENTIALS_FILE": none}
    done = subprocess.run([sys.executable, "-m", "resilient_training.cli", "run", "--output-dir", str(tmp_path / "o"),
                           "--promote-to", "s3://my-bucket/models/x"], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("error: --promote-to s3://my-bucket/models/x: no AWS credentials found (environment, "
                           "profile or instance role), which the promote step needs: set them, or promote to a "
                           "directory\n")
    assert not (tmp_path / "o").exists()
